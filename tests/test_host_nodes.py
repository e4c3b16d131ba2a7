"""A mixed step as one graph with host nodes (run/host_nodes.py, run/mixed.py): mode offload's routed layers,
attention on the device and the experts on the host, from the third step of a size on; the same logits as the
step run segment by segment (bit for bit on the emulated device, where the nodes are the same C calls; within
the GPU tolerance and the same argmax on the H200), one sync a step, the same copies and weight bytes; segment
by segment where a step cannot be one graph (a host segment over the sessions' caches, a trace,
KESTREL_HOST_NODES=0)."""
from __future__ import annotations

import numpy as np
import pytest

import fake_cuda
from bench.synthetic import random_q8_weights
from hf_oracle import relative_error
from kestrel_stream.cuda import driver
from kestrel_stream.obs import trace
from kestrel_stream.options import Options
from kestrel_stream.run.host_nodes import ITEM_NORM, ITEM_PROGRAM, HostNodes
from test_moe_offload_emulated import MODELS, PROMPTS, offload_engine
from test_executors_emulated import CONFIGS, make_split_engine

DECODE = 6
GPU_TOLERANCE = 1e-3
DEVICES = ["emulated", pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not driver.gpu_available(), reason="no GPU")])]


@pytest.fixture(scope="module", params=sorted(MODELS))
def weights(request):
    return random_q8_weights(MODELS[request.param], seed=7)


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    if request.param == "emulated":
        fake_cuda.install(monkeypatch, mode="deferred")
    return monkeypatch, request.param


def decode(engine, prompt=PROMPTS[0], steps: int = DECODE) -> tuple[np.ndarray, list[dict]]:
    """Greedy decode after a prefill: the rows, and the counters each decode step added."""
    x = engine.executor
    rows, added = [], []
    with engine.new_session() as s:
        rows.append(s.prefill(list(prompt))[-1])
        for _ in range(steps):
            before = dict(x.stats)
            rows.append(s.decode(int(np.argmax(rows[-1]))))
            added.append({k: v - before.get(k, 0) for k, v in x.stats.items() if isinstance(v, (int, float))})
    return np.stack(rows), added


def test_a_routed_offload_decode_is_one_graph_with_host_nodes(weights, device):
    monkeypatch, kind = device
    monkeypatch.setenv("KESTREL_HOST_NODES", "0")
    eager = offload_engine(weights)
    want, eager_steps = decode(eager)
    assert not eager.executor.steps.item_graphs._graphs
    eager.close()
    monkeypatch.setenv("KESTREL_HOST_NODES", "1")
    engine = offload_engine(weights)
    got, steps = decode(engine)
    x = engine.executor
    if kind == "emulated":
        np.testing.assert_array_equal(got, want)
    else:
        assert relative_error(got, want) < GPU_TOLERANCE
        np.testing.assert_array_equal(got.argmax(axis=-1), want.argmax(axis=-1))
    first = x.steps.item_graphs._starts[1]
    assert first is not None and x.plan(1).segments[first].side == "gpu"
    host_segments = sum(1 for segment in x.plan(1).segments[first:] if segment.side == "cpu")
    assert host_segments >= 1
    # the first one-token step segment by segment, the second captured, every later one replayed
    assert steps[0]["syncs"] == eager_steps[0]["syncs"] == x.plan(1).syncs_per_step
    assert all(step["syncs"] == 1 for step in steps[1:]), [step["syncs"] for step in steps]
    assert [step.get("graphs_captured", 0) for step in steps[:3]] == [0, 1, 0]
    assert all(step["graph_replays"] == 1 for step in steps[1:])
    for counted in ("h2d_bytes", "d2h_bytes", "launches", "gpu_weight_read_bytes", "cpu_weight_read_bytes"):
        assert [step[counted] for step in steps] == [step[counted] for step in eager_steps], counted
    # a routed layer's experts item takes the next layer's norm input along: one hand-off each, where the
    # norm items alone (the first, over the embedding's x) keep their own
    (graph,) = x.steps.item_graphs._graphs.values()
    kinds = [kind for kind, _ in graph[3][2]]
    alone = sum(1 for i, kind in enumerate(kinds) if kind == ITEM_NORM and (i == 0 or kinds[i - 1] != ITEM_PROGRAM))
    assert kinds.count(ITEM_PROGRAM) == host_segments and alone < kinds.count(ITEM_NORM)
    assert x.steps.nodes.handoffs == host_segments + alone
    engine.close()


def test_host_segments_over_the_caches_run_segment_by_segment(device):
    """layers=1: the host layers' attention reads the sessions' caches (their rows change every step)."""
    monkeypatch, _ = device
    engine = make_split_engine(random_q8_weights(CONFIGS["qwen3"], seed=5), "layers=1", monkeypatch)
    _, steps = decode(engine, steps=4)
    assert engine.executor.steps.item_graphs._starts[1] is None and not engine.executor.steps.item_graphs._graphs
    assert all(step["syncs"] == engine.executor.plan(1).syncs_per_step for step in steps)
    engine.close()


def test_a_traced_step_runs_segment_by_segment(weights, device, tmp_path):
    monkeypatch, _ = device
    engine = offload_engine(weights)
    decode(engine, steps=3)
    replays = engine.executor.stats["graph_replays"]
    trace.start(tmp_path / "t.json")
    try:
        _, steps = decode(engine, steps=3)
    finally:
        trace.stop()
    assert engine.executor.stats["graph_replays"] == replays
    assert all(step["syncs"] == engine.executor.plan(1).syncs_per_step > 1 for step in steps)
    engine.close()


def test_the_host_norm_node_makes_what_numpy_makes(emulated_kernels):
    kernels, pinned = emulated_kernels
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 64)).astype(np.float32) * 4
    norm = rng.uniform(0.5, 1.5, 64).astype(np.float32)
    pinned.views["x"][:3] = x
    nodes = HostNodes(kernels, pinned)
    node = nodes.norm(norm, 1e-6, 3)
    assert nodes.norm(norm, 1e-6, 3) is node, "one node a norm and step size"
    nodes.run_norm(node)
    np.testing.assert_allclose(pinned.xn[:3], x * norm, rtol=1e-7)
    want = 1.0 / np.sqrt(np.mean(np.square(x.astype(np.float64)), axis=-1) + 1e-6)
    np.testing.assert_allclose(pinned.inv_rms[:3], want, rtol=1e-6)


@pytest.fixture
def emulated_kernels(monkeypatch):
    from kestrel_stream import native
    from kestrel_stream.model.config import ModelConfig
    from kestrel_stream.run.device.backend import PinnedState
    fake_cuda.install(monkeypatch)
    kernels = native.load(Options.from_env({}))
    if kernels is None:
        pytest.skip("no native host kernels (no C compiler)")
    config = ModelConfig(arch="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=32,
                         rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=64)
    pinned = PinnedState(config, 4)
    yield kernels, pinned
    pinned.free()


def test_the_switch_is_an_option():
    assert Options.from_env({}).host_nodes and not Options.from_env({"KESTREL_HOST_NODES": "0"}).host_nodes
    with pytest.raises(ValueError, match="KESTREL_HOST_NODES"):
        Options.from_env({"KESTREL_HOST_NODES": "yes"})
    assert Options.from_env({}).ring_graphs and not Options.from_env({"KESTREL_RING_GRAPHS": "0"}).ring_graphs
    with pytest.raises(ValueError, match="KESTREL_RING_GRAPHS='2'"):
        Options.from_env({"KESTREL_RING_GRAPHS": "2"})
