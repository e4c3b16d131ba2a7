"""Mode offload's experts' ring in scheduler terms: per step size the cost model homes routed layers A
(experts on the host) or E (every expert of the layer streamed into a ring slot and run on the GPU), and
the choice follows the step's tokens: a decode step keeps the host, a prompt chunk streams."""
from __future__ import annotations

import dataclasses

import pytest

import scheduler
from kestrel_stream.loading.presets import PRESETS
from scheduler import offload
from scheduler.step_sim import PoolRates, op_costs

CONFIG = PRESETS["qwen3-30b-a3b"]
POOL = scheduler.profile.H200_POOL
SLOT_BYTES = 128 * 3 * 768 * 2048 * 34 // 32          # one layer's every Q8_0 expert


def base(slots: int = 2) -> offload.OffloadPlacement:
    per_layer, _, head = offload._layer_items(CONFIG)
    budget = sum(sum(g.values()) for g in per_layer) + head + (1 << 20)
    return offload.place(CONFIG, budget, POOL).with_expert_ring(slots, SLOT_BYTES)


def letters(p) -> str:
    return "".join(offload.HOME_LETTERS[h] for h in p.homes)


def test_a_decode_step_keeps_the_experts_on_the_host_and_a_prompt_chunk_streams_them():
    b = base()
    one, chunk = offload.place_for_tokens(b, CONFIG, POOL, 1), offload.place_for_tokens(b, CONFIG, POOL, 512)
    assert set(letters(one)) == {"A"} and not one.expert_streamed_bytes
    assert letters(chunk).count("E") > 0 and chunk.expert_streamed_bytes == letters(chunk).count("E") * SLOT_BYTES
    assert chunk.predicted.copy_busy_us > 0 and "experts streamed" in chunk.describe()
    # streamed layers grow with the step (never fewer at more tokens, over the sizes a prompt chunk takes)
    counts = [letters(offload.place_for_tokens(b, CONFIG, POOL, t)).count("E") for t in (1, 64, 512)]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] > counts[1] > 0, counts


def test_the_choice_is_the_cost_models_fastest():
    """Every count of streamed layers predicts a step no faster than the one chosen; all on the host and all
    streamed are among them."""
    b, T = base(), 512
    chosen = offload.place_for_tokens(b, CONFIG, POOL, T)
    rates = PoolRates.of(POOL)
    costs = op_costs(CONFIG, T, 0, POOL, rates, SLOT_BYTES)
    for homes in (b.homes, tuple("experts" for _ in b.homes)):
        sim = offload._predict(costs, homes, b.head, 1, POOL, rates, b.expert_slot_count)
        assert sim.total_us >= chosen.predicted.total_us - 1e-3


def test_a_slower_link_streams_later():
    """With the link at a tenth of its rate the same step streams fewer layers (the threshold is the cost
    model's, from the measured GB/s, not a constant)."""
    slow = dataclasses.replace(POOL, h2d_GBps=POOL.h2d_GBps / 10, h2d_joint_GBps=POOL.h2d_joint_GBps / 10)
    b = base()
    fast_e = letters(offload.place_for_tokens(b, CONFIG, POOL, 64)).count("E")
    slow_e = letters(offload.place_for_tokens(b, CONFIG, slow, 64)).count("E")
    assert slow_e < fast_e


def test_no_ring_no_streamed_experts():
    b = base(slots=0)
    assert set(letters(offload.place_for_tokens(b, CONFIG, POOL, 512))) == {"A"}


@pytest.mark.parametrize("tokens", [1, 512])
def test_the_plan_puts_a_streamed_layer_s_router_and_experts_on_the_gpu(tokens):
    p = offload.place_for_tokens(base(), CONFIG, POOL, tokens)
    plan = scheduler.build_plan(CONFIG, tokens=tokens, mode="offload", profile=POOL, gpu_available=True,
                                offload=p)
    scheduler.audit_plan(plan, CONFIG)
    sides = {(op.layer, op.kind): seg.side for seg in plan.segments for op in seg.ops if op.kind in
             ("router", "experts")}
    for layer, home in enumerate(p.homes):
        want = "gpu" if home == "experts" else "cpu"
        assert sides[(layer, "router")] == sides[(layer, "experts")] == want, (layer, home)
