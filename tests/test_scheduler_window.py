"""Residency window policy: resident selection, no LRU thrash on cyclic decode, budget errors."""
from __future__ import annotations

import json

import pytest

from kestrel_stream.model.config import ModelConfig
from scheduler import H200_MEASURED, WindowBudgetError, WindowItem, build_plan, plan_window, window_items
from window_sim import simulate_lru, simulate_window

QWEN3_1_7B = ModelConfig(arch="qwen3", hidden_size=2048, intermediate_size=6144,
                         num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=128, vocab_size=151936, tie_word_embeddings=True)


def gpu_items(config=QWEN3_1_7B, tokens=1):
    plan = build_plan(config, tokens, "gpu", H200_MEASURED)
    return window_items(plan.ops_on("gpu"))


def item(name, nbytes):
    return WindowItem(name, nbytes, nbytes)


def test_everything_fits_means_nothing_streams():
    items = gpu_items()
    total = sum(i.nbytes for i in items)
    window = plan_window(items, total)
    assert window.streamed == () and window.ring_bytes == 0
    assert window.resident_bytes == total
    assert simulate_window(window, items, 3).misses_per_step == [0, 0, 0]


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_resident_set_under_budgets(fraction):
    items = gpu_items()
    total = sum(i.nbytes for i in items)
    window = plan_window(items, int(total * fraction))
    assert window.used_bytes <= window.budget_bytes
    assert window.resident_bytes + window.streamed_bytes_per_step == total
    assert window.slot_bytes == max(i.nbytes for i in items if i.name in window.streamed)
    # lm_head (330 MB) is the largest item: streaming it would make every slot that large
    assert "lm_head" in window.resident and window.reasons["lm_head"].startswith("resident")
    assert all(window.reasons[i.name] == "resident: too small to stream"
               for i in items if i.name.endswith("norm"))
    json.dumps(window.to_dict())


def test_larger_budgets_stream_less():
    items = gpu_items()
    total = sum(i.nbytes for i in items)
    streamed = [plan_window(items, int(total * f)).streamed_bytes_per_step
                for f in (0.25, 0.5, 0.75, 1.0)]
    assert streamed == sorted(streamed, reverse=True) and streamed[-1] == 0
    assert streamed[0] > streamed[1] > streamed[2]


def test_selection_trades_slot_size_against_resident_bytes():
    items = [item("A", 10), item("B", 6), item("C", 6), item("D", 3)]
    # slot of 6: A must stay resident (10) + one 6-byte slot = 16, stream B, C, D = 15 B/step;
    # a slot of 10 would leave room only for B and stream A, C, D = 19 B/step
    window = plan_window(items, 16, slot_count=1, prefetch_distance=0, small_item_bytes=0)
    assert window.resident == ("A",) and window.streamed == ("B", "C", "D")
    assert (window.slot_bytes, window.streamed_bytes_per_step) == (6, 15)


@pytest.mark.parametrize("slots,distance", [(1, 0), (2, 1), (4, 3)])
def test_cyclic_decode_misses_exactly_the_streamed_set(slots, distance):
    items = gpu_items()
    total = sum(i.nbytes for i in items)
    budget = int(total * 0.5)
    window = plan_window(items, budget, slot_count=slots, prefetch_distance=distance)
    steps = 6
    stats = simulate_window(window, items, steps)
    streamed = len(window.streamed)
    assert streamed > 0
    assert stats.misses_per_step == [streamed] * steps
    assert stats.hits_per_step == [len(window.resident)] * steps
    # prefetch runs `distance` items into the next step, once: after that one copy per item
    assert stats.copies_per_step == [streamed + distance] + [streamed] * (steps - 1)
    assert stats.streamed_bytes_per_step[1:] == [window.streamed_bytes_per_step] * (steps - 1)
    # on-demand copies only while warming up, or always without prefetch
    assert stats.exposed_copies == (1 if distance else streamed * steps)
    # an LRU cache of the same bytes evicts exactly the weight needed next: every access misses
    lru = simulate_lru(items, budget, steps)
    assert lru[1:] == [len(items)] * (steps - 1)
    assert min(lru[1:]) > max(stats.misses_per_step)


def test_prefetch_cannot_outrun_the_ring():
    items = gpu_items()
    with pytest.raises(ValueError, match="overwrite a slot still being read"):
        plan_window(items, 10**10, slot_count=2, prefetch_distance=2)
    with pytest.raises(ValueError, match="at least one slot"):
        plan_window(items, 10**10, slot_count=0, prefetch_distance=0)


def test_too_small_budget_is_a_clear_error():
    items = gpu_items()
    with pytest.raises(WindowBudgetError) as caught:
        plan_window(items, 100 * 2**20)
    message = str(caught.value)
    assert "104857600 B" in message and "too small" in message
    assert "lm_head" in message and "--vram-budget" in message
    assert isinstance(caught.value, ValueError)


def test_untied_embedding_is_resident_or_on_the_host_never_streamed():
    untied = ModelConfig(arch="qwen3", hidden_size=2048, intermediate_size=6144,
                         num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=128, vocab_size=151936, tie_word_embeddings=False)
    items = gpu_items(untied)
    embed = next(i for i in items if i.name == "embed")
    assert not embed.streamable and embed.saved_bytes_per_step == 4 * 2048
    total = sum(i.nbytes for i in items)
    roomy = plan_window(items, total)
    assert "embed" in roomy.resident and roomy.on_host == ()
    tight = plan_window(items, total - embed.nbytes // 2)
    assert tight.on_host == ("embed",) and "embed" not in tight.streamed
    assert "on the host" in tight.reasons["embed"]
    assert "embed" in tight.describe() and "lm_head" in tight.describe()
