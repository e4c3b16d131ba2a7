"""Cross-step priming of the residency window: every step ends by copying the next step's first streamed
items into their slots, and every read still sees its own weight.

tests/window_order.py records what WeightWindow enqueues as a happens-before graph (CUDA's stream and
event semantics, graph capture and replay) and checks every ring slot over all interleavings, across
eager steps, captured steps replayed later, timed steps and launch lists of different token counts.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

import fake_cuda
from bench.synthetic import random_q8_weights
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.run.device import weight_window as stream_window
from kestrel_stream.run.device.budget import arena_needs, budget_for_weight_fraction, plan_arena
from kestrel_stream.run.executor import StepCounters
from kestrel_stream.run.device.weight_window import WeightWindow, step_launch_items, weight_tensors
from window_order import Launch, OrderLog

SMALL = ModelConfig(arch="qwen3", hidden_size=256, intermediate_size=256, num_hidden_layers=6,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=256,
                    tie_word_embeddings=True)


@pytest.fixture(scope="module")
def weights():
    return random_q8_weights(SMALL, seed=3)


def build(monkeypatch, weights, slots, distance, fraction=0.5, streamed=None, cls=WeightWindow):
    """(log, window, compute stream, two launch lists of the same streamed order); streamed: the first
    `streamed` projections stream (a hand-made plan), else the planner's choice at `fraction`."""
    log = OrderLog()
    monkeypatch.setattr(stream_window, "driver", log.module())
    if streamed is None:
        needs = arena_needs(SMALL, 8, 2, 16, 16)
        budget = budget_for_weight_fraction(SMALL, needs, fraction, slots)
        _, plan = plan_arena(SMALL, needs, budget, slots, distance, small_item_bytes=0)
    else:
        names = [name for name in weight_tensors(weights) if name != "lm_head"]   # the embed gathers from it
        plan = types.SimpleNamespace(streamed=tuple(names[:streamed]), slot_count=slots, prefetch_distance=distance,
                                     on_host=())
    compute = log.module().Stream("compute")
    window = cls(weights, types.SimpleNamespace(alloc=log.alloc), plan, compute)
    items = step_launch_items(SMALL)
    one = [Launch(log, window.qweight(name) if name else None, name) for name in items]
    # another token count: more launches without a window weight (a split attention's merge, say)
    other = [launch for name in items
             for launch in [Launch(log, window.qweight(name) if name else None, name)]
             + ([Launch(log, None, None)] if name is None else [])]
    return log, window, compute, (one, other)


def run_mixed_steps(log, window, compute, lists, timed: bool = True) -> int:
    """Eager steps, a timed one, captured steps replayed between eager ones; returns the steps run."""
    one, other = lists
    counters = StepCounters()
    window.enqueue_step(one, compute)                # the first step after the load's prime
    window.enqueue_step(other, compute)
    window.timing = timed                            # an eager step with timing events
    window.enqueue_step(one, compute)
    window.timing = False
    window.account(counters)                         # reads every timing event it recorded
    with log.capturing(compute) as g1:               # a capture runs nothing
        window.enqueue_step(one, compute)
    log.launch(g1.graph, compute)
    log.launch(g1.graph, compute)
    window.enqueue_step(other, compute)              # eager after a replay
    with log.capturing(compute) as g2:
        window.enqueue_step(other, compute)
    log.launch(g2.graph, compute)
    log.launch(g1.graph, compute)                    # replays of different buckets back to back
    window.enqueue_step(one, compute)
    assert counters.copy_busy_ms == (0.0 if timed else None) and counters.window_misses == len(window.streamed)
    return 9


@pytest.mark.parametrize("slots,distance", [(1, 0), (2, 0), (2, 1), (3, 1), (3, 2), (4, 1)])
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_every_read_sees_its_own_weight_across_eager_captured_and_replayed_steps(
        monkeypatch, weights, slots, distance, fraction):
    log, window, compute, lists = build(monkeypatch, weights, slots, distance, fraction)
    n = len(window.streamed)
    assert n > slots and window.primed == distance + 1
    steps = run_mixed_steps(log, window, compute, lists)
    assert log.check_slots(window) == steps * n


@pytest.mark.parametrize("slots,distance", [(2, 1), (3, 2), (4, 1), (4, 3)])
@pytest.mark.parametrize("streamed", [1, 2, 3, 5])
def test_fewer_streamed_items_than_slots_or_the_prefetch_distance(monkeypatch, weights, slots, distance, streamed):
    log, window, compute, lists = build(monkeypatch, weights, slots, distance, streamed=streamed)
    assert window.primed == min(distance + 1, streamed)
    steps = run_mixed_steps(log, window, compute, lists)
    assert log.check_slots(window) == steps * streamed


@pytest.mark.parametrize("slots,distance", [(1, 0), (2, 1), (3, 1), (3, 2)])
def test_each_step_copies_every_item_once_and_ends_with_the_primes(monkeypatch, weights, slots, distance):
    log, window, compute, (one, _) = build(monkeypatch, weights, slots, distance)
    n, primed = len(window.streamed), window.primed
    sizes = [nbytes for _, nbytes in window.copies]
    # the load's prime
    assert log.count("copy", window.copy_stream) == primed and window.prime_bytes == sum(sizes[:primed])
    item_at = {view.ctypes.data: k for k, (view, _) in enumerate(window.copies)}
    counters = StepCounters()
    for step in range(3):
        start = len(log.nodes)
        window.enqueue_step(one, compute)
        window.account(counters)
        copies = [i for i in range(start, len(log.nodes)) if log.nodes[i]["kind"] == "copy"]
        assert [item_at[log.nodes[i]["src"]] for i in copies[:n - primed]] == list(range(primed, n))
        # the copy lane ends: (wait slot j released, copy item j) per primed slot in release order, join
        primes = [item_at[log.nodes[i]["src"]] for i in copies[n - primed:]]
        assert primes == [j for _, j in sorted(((j + (n - 1 - j) // slots * slots), j) for j in range(primed))]
        reader = {k: i for i in range(start, len(log.nodes)) for k in [log.nodes[i].get("weight")]
                  if log.nodes[i]["kind"] == "kernel" and k in window.streamed}
        for i, j in zip(copies[n - primed:], primes):
            wait = log.nodes[i - 1]
            assert wait["kind"] == "wait" and wait["event"] == f"slot {j} released"
            release = log.nodes[wait["preds"][-1]]
            last = max(k for k in range(n) if k % slots == j)
            assert release["event"] == f"slot {j} released" and wait["preds"][-1] == reader[window.streamed[last]] + 1
        assert log.nodes[len(log.nodes) - 2]["event"] == "window join"
    assert counters.streamed_bytes == 3 * window.streamed_bytes_per_step == 3 * sum(sizes)
    assert counters.window_misses == 3 * n and counters.window_hits == 3 * len(window.resident)


def test_the_checker_catches_a_prime_that_does_not_wait_for_the_slot(monkeypatch, weights):
    unguarded = type("Unguarded", (WeightWindow,), {"_prime": lambda self, j, timed: self._copy(j, timed)})
    log, window, compute, lists = build(monkeypatch, weights, 2, 1, cls=unguarded)
    run_mixed_steps(log, window, compute, lists)
    with pytest.raises(AssertionError, match="races the read"):
        log.check_slots(window)


def test_the_checker_catches_a_step_that_starts_unprimed(monkeypatch, weights):
    unprimed = type("Unprimed", (WeightWindow,), {"_prime": lambda self, j, timed: None,
                                                   "_prime_at_load": lambda self: None})
    log, window, compute, lists = build(monkeypatch, weights, 3, 1, cls=unprimed)
    run_mixed_steps(log, window, compute, lists, timed=False)
    with pytest.raises(AssertionError, match="before any copy|holding"):
        log.check_slots(window)


def test_the_checker_catches_primes_left_out_of_the_graph(monkeypatch, weights):
    """Primes issued outside the captured step (after its join) would not be part of its replays."""
    class Late(WeightWindow):
        def _prime(self, j, timed):
            self._late.append(j)

        def enqueue_step(self, launches, stream):
            self._late = []
            super().enqueue_step(launches, stream)
            capturing, self.copy_stream.capturing = self.copy_stream.capturing, stream.capturing
            for j in self._late:
                WeightWindow._prime(self, j, None)
            self.copy_stream.capturing = capturing

    log, window, compute, (one, _) = build(monkeypatch, weights, 2, 1, cls=Late)
    with log.capturing(compute) as graph:
        window.enqueue_step(one, compute)
    with pytest.raises(AssertionError, match="not joined"):
        log.launch(graph.graph, compute)


def test_mixed_token_counts_match_the_cpu_engine_on_the_emulated_device(monkeypatch):
    import test_gpu_window as on_gpu
    fake_cuda.install(monkeypatch, mode="deferred")
    for copies in ("eager", "lazy"):     # copies run as soon as allowed, or only when compute waits for them
        monkeypatch.setitem(fake_cuda.POLICY, "eager", ("window copy h2d",) if copies == "eager" else ())
        weights = on_gpu.random_weights("qwen3", seed=1)
        gpu = on_gpu.streaming_executor(weights, 0.25, slots=3, distance=1)
        assert gpu.steps.window.primed == 2 and len(gpu.steps.window.streamed) > 6
        on_gpu.compare_mixed_steps(gpu, weights)
        gpu.close()


def test_steps_on_another_stream_are_refused(monkeypatch, weights):
    log, window, compute, (one, _) = build(monkeypatch, weights, 2, 1)
    with pytest.raises(AssertionError, match="compute stream"):
        window.enqueue_step(one, log.module().Stream("other"))
    np.testing.assert_equal(log.count("kernel"), 0)


def test_the_host_waits_for_a_steps_outputs_not_for_the_next_steps_primes(monkeypatch):
    """Lazy copies (a copy runs only when a stream waits for it): after an eager streamed step returns its
    logits, the primes of the next step are still queued on the copy stream; the next step finds them."""
    import test_gpu_window as on_gpu
    fake_cuda.install(monkeypatch, mode="deferred")
    monkeypatch.setitem(fake_cuda.POLICY, "eager", ())
    weights = on_gpu.random_weights("qwen3", seed=1)
    gpu = on_gpu.streaming_executor(weights, 0.25, slots=3, distance=1)
    gpu.use_graphs = False
    kv = gpu.alloc_kv(64)
    copy = gpu.steps.window.copy_stream
    gpu.forward([(kv, np.arange(5), 0)])
    first = gpu.forward([(kv, np.array([7]), 5)])[0]
    assert copy.done < len(copy.ops), "the host waited for the primes"
    second = gpu.forward([(kv, np.array([7]), 6)])[0]
    assert np.isfinite(first).all() and np.isfinite(second).all()
    gpu.free_kv(kv)
    gpu.close()
