"""The resident experts of mode offload chosen by routing frequency (scheduler/expert_residency.py): the choice
that maximizes the expected resident share within the pool's slots, the uniform choice blind to the counts,
and a workload whose router prefers some experts (random weights, bench/synthetic.bias_router) run on the
emulated device, where the choice by a calibration prompt's routing finds more of later prompts' experts
resident than the uniform one (both printed, with their tok/s: the timing belongs to bench/moe_offload.py)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bench.moe_offload import resident_choices
from bench.synthetic import bias_router, random_q8_weights
from kestrel_stream.loading.presets import PRESETS
from scheduler import expert_residency
from test_moe_device_emulated import emulated, offload_engine  # noqa: F401  (a fixture)

COUNTS = [[10, 0, 5, 5], [1, 1, 1, 97]]       # two routed layers (ids 0 and 2) of four experts
LAYERS = [0, 2]


def test_frequency_takes_the_largest_shares_over_every_layer():
    choice = expert_residency.choose(COUNTS, LAYERS, 4, slots=3)
    assert choice.experts == {0: (0, 2), 2: (3,)}       # shares .5, .25(, .25: ties to the lower id), .97
    assert choice.expected_share == pytest.approx((0.75 + 0.97) / 2)
    assert choice.slot_table() == {(0, 0): 0, (0, 2): 1, (2, 3): 2}


def test_uniform_gives_every_layer_the_same_slots_spread_over_the_ids():
    choice = expert_residency.choose(COUNTS, LAYERS, 4, slots=5, policy="uniform")
    assert choice.experts == {0: (0, 1, 2), 2: (0, 2)}
    assert choice.expected_share == pytest.approx((0.75 + 0.02) / 2)


def test_no_counts_yet_is_uniform_and_more_slots_than_experts_hold_them_all():
    zeros = [[0] * 4, [0] * 4]
    assert expert_residency.choose(zeros, LAYERS, 4, 2).experts == {0: (0,), 2: (0,)}
    everything = expert_residency.choose(COUNTS, LAYERS, 4, 100)
    assert everything.used_slots == 8 and everything.expected_share == pytest.approx(1.0)
    with pytest.raises(ValueError, match="frequency, uniform"):
        expert_residency.choose(COUNTS, LAYERS, 4, 2, policy="random")


def test_the_hit_rate_pools_the_layers_selections():
    assert expert_residency.hit_rate(COUNTS, LAYERS, {0: (0,), 2: (3,)}) == pytest.approx(107 / 120)
    assert expert_residency.hit_rate([[0, 0]], [0], {0: (1,)}) == 0.0


def test_a_biased_router_pays_for_the_frequency_choice(emulated):  # noqa: F811
    cfg = dataclasses.replace(PRESETS["qwen3-moe-tiny"], num_experts=16, num_experts_per_tok=2, num_hidden_layers=4,
                              dense_layers=(1,), head_dim=32)
    weights = random_q8_weights(cfg, seed=3)
    preferred = bias_router(weights, preferred=3, strength=1.0)
    slots = 12                                          # a quarter of the 3 x 16 experts
    engine = offload_engine(weights, slots, policy="uniform")
    rng = np.random.default_rng(5)
    prompt = lambda n: [int(t) for t in rng.integers(0, cfg.vocab_size, n)]   # noqa: E731
    rows = resident_choices(engine, prompt(32), [prompt(16) for _ in range(3)], new_tokens=4)
    engine.close()
    for row in rows:
        print(f"resident experts by {row['policy']}: {row['resident']} of 48 (preferred {preferred}); expected "
              f"share {row['expected_share']:.1%}, hit rate {row['hit_rate']:.1%}, {row['tok_s']:.1f} tok/s "
              "(emulated device)")
    uniform, frequency = rows
    assert uniform["resident"] == frequency["resident"] >= slots
    assert frequency["hit_rate"] > uniform["hit_rate"] + 0.2
