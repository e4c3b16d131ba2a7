"""One op order: in every mode the host backend runs, and the device backend launches, the ops of the plan
(the step program placed) in the plan's order, and nothing else.

What the host ran is read from the trace (each op of a host program is one host slice naming the op);
what the device launched from the launches enqueued on the emulated device (tests/fake_cuda.py), by the
(op kind or group, layer) each launch is labelled with.  An op of several launches (a split group's row
ranges) counts once."""
from __future__ import annotations

import dataclasses
import json

import pytest

import fake_cuda
import scheduler
from bench.synthetic import random_q8_weights
from kestrel_stream.cuda import kernels
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.obs import trace
from kestrel_stream.run.compat import HybridExecutor
from kestrel_stream.run.engine import Engine

CONFIG = ModelConfig(arch="qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=96,
                     rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                     max_position_embeddings=64)
FAST_LINK = dataclasses.replace(scheduler.H200_MEASURED, round_trip_us=1.0, host_weight_GBps=0.5,
                                host_gflops=5.0, gpu_launch_us=0.5)
MODES = ("cpu", "gpu", "gated", "gated-fast-link", "gated-split", "layers=1", "layers=3")
SKIP = ("argmax", "sample", "chain_advance")        # a step's outputs, not ops of the program


@pytest.fixture(scope="module")
def weights():
    return random_q8_weights(CONFIG, seed=3)


def build(weights, mode: str) -> Engine:
    if mode == "cpu":
        return Engine(weights, device="cpu", max_seq_len=32, max_batch=4)
    if mode == "gpu":
        engine = Engine(weights, device="cuda", mode="gpu", max_seq_len=32, max_batch=4)
        engine.executor.use_graphs = False          # every launch enqueued where it can be seen
        return engine
    engine = Engine(weights, device="cpu", max_seq_len=32, max_batch=4)
    profile = FAST_LINK if mode == "gated-fast-link" else scheduler.H200_MEASURED
    options = engine.options.with_(minflop=1e4 if mode == "gated-split" else None)
    mode = mode.removesuffix("-fast-link").removesuffix("-split")
    engine.device, engine.mode = "cuda", mode
    engine.executor = HybridExecutor(weights, mode, profile, max_seq_len=32, max_batch=4, options=options)
    return engine


def expected(plan, side: str) -> list:
    return [(op.group or op.kind, -1 if op.layer is None else op.layer)
            for segment in plan.segments if segment.side == side for op in segment.ops if scheduler.runs_alone(op)]


def collapse(seq: list) -> list:
    return [item for i, item in enumerate(seq) if i == 0 or item != seq[i - 1]]


@pytest.mark.parametrize("device", ["emulated", pytest.param("h200", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("mode", MODES)
def test_the_backends_run_the_plans_ops_in_its_order(monkeypatch, tmp_path, weights, mode, tokens, device):
    launch_class = kernels.Launch
    if device == "emulated":
        fake_cuda.install(monkeypatch)
        launch_class = fake_cuda.FakeLaunch
    engine = build(weights, mode)
    session = engine.new_session()
    session.prefill([3, 1, 4])                      # a first step: weights, programs and launch lists built
    launched = []
    enqueue = launch_class.enqueue

    def recording(launch, stream, *args, **kwargs):
        labels = launch.labels
        if "op" in labels and labels["op"] not in SKIP:
            kind = labels["op"].split(".")[-1].split("[")[0]     # "qkv", or a mixed step's "L0.qkv[gpu]"
            launched.append((kind, -1 if labels.get("layer") is None else labels["layer"]))
        return enqueue(launch, stream, *args, **kwargs)
    monkeypatch.setattr(launch_class, "enqueue", recording)
    path = tmp_path / "step.json"
    trace.start(path)
    try:
        session.prefill(list(range(5, 5 + tokens)))
    finally:
        trace.stop()
    events = json.loads(path.read_text())["traceEvents"]
    host_ran = [(e["name"].removeprefix("cpu "), e["args"]["layer"]) for e in events
                if e.get("ph") == "X" and e.get("args", {}).get("segment", "cpu") == "cpu" and "op" in e.get("args", {})
                and e["cat"] == "host" and not e["name"].startswith(("gpu ", "launch ", "copy "))]
    plan = engine.executor.plan(tokens)
    assert host_ran == expected(plan, "cpu"), mode
    assert collapse(launched) == collapse(expected(plan, "gpu")), mode
    if mode == "cpu":
        assert not launched and len(host_ran) == 2 + 6 * CONFIG.num_hidden_layers
    if mode in ("gpu", "layers=3"):
        assert not host_ran or mode == "layers=3"
    assert host_ran or launched
    engine.close()


def test_a_cpu_plan_has_the_same_ops_at_every_token_count(weights):
    """The host backend binds a cpu step's program once: the plans of every token count list the same ops."""
    engine = Engine(weights, device="cpu", max_seq_len=32)
    names = lambda t: [op.name for op in engine.executor.plan(t).segments[0].ops]     # noqa: E731
    assert names(1) == names(7) == names(64)
