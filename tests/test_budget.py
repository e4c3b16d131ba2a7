"""--vram-budget parsing and the split of a budget over KV caches, activations and the weight window."""
from __future__ import annotations

import pytest

from kestrel_stream.run.device.budget import (ALIGN, arena_needs, budget_for_weight_fraction, parse_vram_budget,
                                   plan_arena, resolve_budget, weight_items)
from kestrel_stream.cli.main import build_parser
from kestrel_stream.loading.presets import PRESETS
from scheduler import WindowBudgetError
from window_sim import simulate_window

QWEN3_1_7B = PRESETS["qwen3-1.7b"]
NEEDS = arena_needs(QWEN3_1_7B, max_tokens=64, sessions=3, max_seq_len=1024, attention_splits=16)


@pytest.mark.parametrize("text,value", [("2GiB", 2 << 30), ("1500MB", 1_500_000_000), ("1500mb", 1_500_000_000),
                                        ("4000000000", 4_000_000_000), ("0.5", 0.5), ("1.0", 1.0),
                                        ("512 MiB", 512 << 20), ("1.5GB", 1_500_000_000), (None, None),
                                        (3 << 30, 3 << 30), (0.25, 0.25)])
def test_budget_sizes_and_fractions(text, value):
    assert parse_vram_budget(text) == value


@pytest.mark.parametrize("text,why", [("2 parsecs", "expected a size"), ("1.5", r"in \(0, 1\]"), ("0.0", r"in \(0, 1\]"),
                                      ("-1GB", "expected a size"), ("0", "positive"), ("", "expected a size")])
def test_bad_budgets_say_what_is_wrong(text, why):
    with pytest.raises(ValueError, match=why) as caught:
        parse_vram_budget(text)
    assert "--vram-budget" in str(caught.value)


def test_cli_parses_the_budget_at_the_boundary(capsys):
    args = build_parser().parse_args(["generate", "--model", "m", "--prompt-ids", "1", "--vram-budget", "2GiB"])
    assert args.vram_budget == 2 << 30
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--model", "m", "--prompt-ids", "1", "--vram-budget", "lots"])
    assert "--vram-budget 'lots'" in capsys.readouterr().err


def test_fraction_of_free_vram_and_the_default():
    assert resolve_budget(0.5, free_bytes=10 << 30, full_bytes=1 << 30) == 5 << 30
    assert resolve_budget(None, free_bytes=10 << 30, full_bytes=1 << 30) is None        # fits: no limit
    assert resolve_budget(None, free_bytes=10 << 30, full_bytes=20 << 30) == (10 << 30) - (512 << 20)
    assert resolve_budget(3 << 30, free_bytes=1, full_bytes=1) == 3 << 30


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75, 1.0])
def test_qwen3_1_7b_window_under_budgets(fraction):
    budget = budget_for_weight_fraction(QWEN3_1_7B, NEEDS, fraction)
    capacity, window = plan_arena(QWEN3_1_7B, NEEDS, budget)
    items = weight_items(QWEN3_1_7B)
    weight_bytes = sum(i.nbytes for i in items)
    assert capacity <= budget
    if fraction == 1.0:
        assert window is None and capacity >= weight_bytes + NEEDS.total
        return
    assert window.slot_count == 2 and window.prefetch_distance == 1
    assert window.resident_bytes + window.streamed_bytes_per_step == weight_bytes
    assert window.used_bytes <= fraction * weight_bytes + 2 * ALIGN * (len(items) + 2)
    assert "lm_head" in window.resident and "embed kernel" in window.reasons["lm_head"]
    # what streams is what the budget could not hold, plus the ring and less than one item of packing gap
    shortfall = weight_bytes - fraction * weight_bytes
    assert shortfall <= window.streamed_bytes_per_step <= shortfall + window.ring_bytes + window.slot_bytes
    stats = simulate_window(window, items, 3)
    assert stats.misses_per_step == [len(window.streamed)] * 3


def test_budgets_stream_less_as_they_grow():
    streamed = [plan_arena(QWEN3_1_7B, NEEDS, budget_for_weight_fraction(QWEN3_1_7B, NEEDS, f))[1]
                .streamed_bytes_per_step for f in (0.25, 0.5, 0.75)]
    assert streamed[0] > streamed[1] > streamed[2] > 0


def test_no_budget_keeps_everything_resident():
    capacity, window = plan_arena(QWEN3_1_7B, NEEDS, None)
    assert window is None
    assert capacity == sum(i.nbytes for i in weight_items(QWEN3_1_7B)) + NEEDS.total + 2 * ALIGN * 113


def test_too_small_for_kv_and_activations_names_the_numbers():
    with pytest.raises(WindowBudgetError) as caught:
        plan_arena(QWEN3_1_7B, NEEDS, 500 << 20)
    message = str(caught.value)
    assert "524288000 B" in message and "KV caches 672.0 MiB (3 sessions x 1024 positions)" in message
    assert "--vram-budget" in message and "nothing left" in message


def test_too_small_for_one_slot_names_the_window():
    budget = NEEDS.total + (300 << 20)       # lm_head (330 MB) must stay resident: no room for it and a slot
    with pytest.raises(WindowBudgetError) as caught:
        plan_arena(QWEN3_1_7B, NEEDS, budget)
    message = str(caught.value)
    assert "too small for gpu mode" in message and "lm_head" in message and "slot" in message
    assert isinstance(caught.value, ValueError)      # the CLI reports it as an error, not a traceback


def test_untied_embedding_stays_resident_in_gpu_mode():
    config = PRESETS["qwen3-8b"]
    needs = arena_needs(config, 64, 3, 256, 16)
    _, window = plan_arena(config, needs, budget_for_weight_fraction(config, needs, 0.25))
    assert "embed" in window.resident and "lm_head" not in window.resident or window.on_host == ()
    assert window.on_host == () and "embed kernel" in window.reasons["embed"]
