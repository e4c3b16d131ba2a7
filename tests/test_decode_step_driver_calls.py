"""What a replayed batch-8 greedy decode step costs the host, counted at the driver (emulated device).

The executor's own counters are what it says it did; this counts what reached the
driver layer (tests/fake_cuda.py) over many `decode_batch(..., greedy=True)` steps of
eight sessions in gpu mode: one graph launch and one host sync per step, no eager
kernel launch, no copy besides the block-table rows of sessions entering a new KV
block, and a graph that holds exactly the plan's kernels, one params upload of
PARAMS_BYTES_PER_TOKEN per token and one 4-byte token per row back.  The host's
Python work per step is counted too (calls into kestrel_stream/ and scheduler/, a
deterministic count, not a time): the step's host time adds to the GPU's in series
(one sync per step), so new per-row work shows up in batch-8 decode throughput.
"""
from __future__ import annotations

import collections
import sys

import pytest

import fake_cuda
import fake_streams
from kestrel_stream.cuda import driver
from bench.synthetic import random_q8_weights
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.run.engine import Engine
from scheduler.ops import PARAMS_BYTES_PER_TOKEN

CONFIG = ModelConfig(arch="qwen3", hidden_size=256, intermediate_size=256, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=256,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                     max_position_embeddings=128)
BATCH, PROMPT, STEPS = 8, 16, 32          # 16 positions a KV block: the steps cross two block boundaries
# Per replayed batch-8 step, Python calls into kestrel_stream/ and scheduler/: 129.5 at b8e5c5d (before the
# step program), 134.5 at 60cd39e, 127 once a session's block-table row is compared only when its blocks
# change; numpy's Python-level functions called from there: 32, 32, 17 (the row compare was 15 of them).
# A new per-row helper, per-layer loop or per-row numpy call on the replay path goes past these.
MAX_CALLS_PER_STEP = 130
MAX_NUMPY_CALLS_PER_STEP = 20


class DriverLog:
    """Every copy, kernel enqueue, graph launch and host sync, split by inside/outside a capture."""

    def __init__(self, monkeypatch):
        self.calls = collections.Counter()
        self.captured_bytes = collections.Counter()
        for name in ("h2d_async", "d2h_async", "h2d_sync", "d2d_async", "memset_async"):
            monkeypatch.setattr(driver, name, self._copy(name, getattr(driver, name)))
        enqueue, launch, synchronize = fake_cuda.FakeLaunch.enqueue, fake_streams.Graph.launch, fake_streams.Stream.synchronize
        event_sync = fake_streams.Event.synchronize
        log = self

        def kernel(launch_self, stream):
            log.calls["captured kernel" if stream.capturing else "kernel"] += 1
            enqueue(launch_self, stream)

        def graph(graph_self, stream):
            log.calls["graph launch"] += 1
            launch(graph_self, stream)

        def sync(stream_self):
            log.calls["sync"] += 1
            synchronize(stream_self)

        def wait_event(event_self):      # a host wait for an event is a sync too
            log.calls["sync"] += 1
            event_sync(event_self)

        monkeypatch.setattr(fake_cuda.FakeLaunch, "enqueue", kernel)
        monkeypatch.setattr(fake_cuda.FakeLaunch, "submit", kernel)
        monkeypatch.setattr(fake_streams.Graph, "launch", graph)
        monkeypatch.setattr(fake_streams.Stream, "synchronize", sync)
        monkeypatch.setattr(fake_streams.Event, "synchronize", wait_event)

    def _copy(self, name, real):
        def copy(*args, **kw):
            if fake_streams.capturing():
                self.calls[f"captured {name}"] += 1
                self.captured_bytes[name] += args[2]
            else:
                self.calls[name] += 1
            return real(*args, **kw)
        return copy

    def take(self) -> collections.Counter:
        calls, self.calls = self.calls, collections.Counter()
        return calls


def python_calls(fn) -> collections.Counter:
    """Python function calls while fn() runs: "own", into kestrel_stream/ and scheduler/; "numpy", numpy's
    Python-level functions (np.flatnonzero, np.atleast_1d, ...) called from there (not the emulated kernels')."""
    counts = collections.Counter()
    ours = lambda path: "kestrel_stream" in path or "/scheduler/" in path

    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            if ours(path):
                counts["own"] += 1
            elif "/numpy/" in path and frame.f_back is not None and ours(frame.f_back.f_code.co_filename):
                counts["numpy"] += 1
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts


@pytest.fixture
def engine_and_log(monkeypatch):
    fake_cuda.install(monkeypatch, mode="deferred")
    engine = Engine(random_q8_weights(CONFIG, seed=2), device="cuda", mode="gpu", max_seq_len=96, max_batch=32)
    log = DriverLog(monkeypatch)
    yield engine, log
    engine.close()


def test_a_replayed_batch8_step_is_one_graph_launch_one_sync_and_no_other_device_work(engine_and_log):
    engine, log = engine_and_log
    x = engine.executor
    sessions = [engine.new_session() for _ in range(BATCH)]
    for s in sessions:
        s.prefill(list(range(1, PROMPT + 1)))
    pairs = [(s, 5 + i) for i, s in enumerate(sessions)]
    log.take()
    log.captured_bytes.clear()                          # the prompts' graph (run/device/step_graphs.py)
    engine.decode_batch(pairs, greedy=True)             # captures the bucket's graph, then replays it
    capture = log.take()
    plan = x.plan(BATCH)
    assert capture["captured kernel"] == plan.launches_per_step + 1, "the plan's kernels + the argmax"
    assert capture["captured h2d_async"] == 1 and log.captured_bytes["h2d_async"] == PARAMS_BYTES_PER_TOKEN * BATCH
    assert capture["captured d2h_async"] == 1 and log.captured_bytes["d2h_async"] == 4 * BATCH
    assert x.steps._graph_kernels[(BATCH, True)] == plan.launches_per_step + 1

    before = x.counters.as_dict()
    for _ in range(STEPS - 1):
        engine.decode_batch(pairs, greedy=True)
    ran = log.take()
    steps = STEPS - 1
    # positions PROMPT+1 .. PROMPT+STEPS-1: each session enters one new block (at 32), one table row up each
    assert ran == {"graph launch": steps, "sync": steps, "h2d_async": BATCH}, ran
    after = x.counters.as_dict()
    assert after["syncs"] - before["syncs"] == steps == plan.syncs_per_step * steps
    assert after["graph_replays"] - before["graph_replays"] == steps
    assert after["kernels"] - before["kernels"] == steps * (plan.launches_per_step + 1)


def test_a_replayed_batch8_step_does_no_more_host_work_than_before_the_step_program(engine_and_log):
    engine, log = engine_and_log
    sessions = [engine.new_session() for _ in range(BATCH)]
    for s in sessions:
        s.prefill(list(range(1, PROMPT + 1)))
    pairs = [(s, 5 + i) for i, s in enumerate(sessions)]
    for _ in range(2):
        engine.decode_batch(pairs, greedy=True)          # graph captured, blocks for the next positions
    log.take()

    def steps():
        for _ in range(STEPS):
            engine.decode_batch(pairs, greedy=True)
    calls = python_calls(steps)
    own, numpy_calls = calls["own"] / STEPS, calls["numpy"] / STEPS
    assert own <= MAX_CALLS_PER_STEP, f"{own:.1f} Python calls per batch-8 decode step"
    assert numpy_calls <= MAX_NUMPY_CALLS_PER_STEP, f"{numpy_calls:.1f} numpy calls per batch-8 decode step"
    assert log.take()["graph launch"] == STEPS
