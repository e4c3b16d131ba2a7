"""One session's steps of k = 1..70 tokens in gpu mode (run/device/step_graphs.py): up to 64 tokens each replays
the graph of its bucket (1..8 exactly, then 16, 32, 48, 64, padded up), captured once and replayed at every
context; beyond, the eager launches.  Every k, with logits "all", "last" and "argmax": the graph's against
the same step launched eagerly (KESTREL_STEP_GRAPHS=0's path, nearly bit for bit) and against the CPU
engine's numpy reference arithmetic (2e-3, the same argmax where the reference's is decided), for Q8_0,
Q4_K_M (Q4_K with Q6_K rows) and Q6_K weights.  The k cover every kernel's switch point: the GEMV kernels
per count up to 8, the 16-token tensor-core tiles from 9 (a bucket's padded rows), the flash attention
kernel from 16, the largest bucket's edge at 64/65.

On the emulated device (fake_cuda) in CI, and marked `gpu` on a real one (`pytest -m gpu
tests/test_step_graphs.py`).
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np
import pytest

import fake_cuda
from bench.make_gguf import write as write_gguf
from bench.synthetic import random_q8_weights
from hf_oracle import relative_error
from kestrel_stream.cuda import driver
from kestrel_stream.loading.loader import load_weights
from kestrel_stream.loading.presets import PRESETS
from kestrel_stream.options import Options
from kestrel_stream.run.device.step_graphs import EXACT_TOKENS, PADDED_TOKENS
from kestrel_stream.run.engine import Engine
from test_quant4 import CFG

CONFIG = dataclasses.replace(CFG, num_hidden_layers=2)
MODELS = ("q8_0", "q4_k_m", "q6_k")
STEP_TOKENS = {"q8_0": tuple(range(1, 71)), "q4_k_m": tuple(range(1, 71)),
               # Q6_K alone (Q4_K_M has Q6_K rows too): each switch point and its neighbours
               "q6_k": (1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 47, 48, 49, 63, 64, 65, 70)}
CONTEXTS = (3, 18, 37)          # tokens the session holds before a step: within, at and past KV blocks of 16
MAX_SEQ_LEN = 128
EAGER_TOLERANCE = 1e-4          # the graph's step against the eager one: the same kernels but for attention's splits
# against the CPU engine's float32 arithmetic: the oracle tests' 2e-3 for Q8_0; the 4/6-bit formats' int8
# tensor-core GEMMs (k > 8) are each within 2e-3 (test_block_kernels.check_tolerance), and two layers of them
# on these random weights reach ~2e-3 of the largest logit, eager or graph alike (on the H200: 3.09e-3 once, Q4_K_M
# at k=48 on a 3-token context, the graph equal to the eager step within 1e-4)
CPU_TOLERANCE = {"q8_0": 2e-3, "q4_k_m": 4e-3, "q6_k": 4e-3}
DEVICES = ["emulated", pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not driver.gpu_available(), reason="no GPU")])]


@pytest.fixture(scope="module", params=MODELS)
def weights(request, tmp_path_factory):
    if request.param == "q8_0":
        return random_q8_weights(CONFIG, seed=7), request.param
    path = tmp_path_factory.mktemp(request.param) / "m.gguf"
    write_gguf(CONFIG, None, str(path), seed=7, mix=request.param)
    return load_weights(path), request.param


@pytest.fixture(scope="module")
def cpu(weights):
    return Engine(weights[0], device="cpu", max_seq_len=MAX_SEQ_LEN, options=Options(host_kernels="numpy"))


def gpu_engine(weights, request, device: str, step_graphs: bool = True) -> Engine:
    if device == "emulated":
        fake_cuda.install(request.getfixturevalue("monkeypatch"), mode="deferred")
    return Engine(weights, device="cuda", mode="gpu", max_seq_len=MAX_SEQ_LEN, max_batch=4,
                  options=Options(step_graphs=step_graphs))


def bucket_of(tokens: int) -> int | None:
    return next((b for b in EXACT_TOKENS + PADDED_TOKENS if b >= tokens), None)


def decided_rows_agree(got, want, tolerance: float = 2e-3) -> float:
    """The same argmax on every row whose reference top two differ by more than twice the error bound
    (tolerance x max |logit|); returns the share of rows so decided (a random model has near-ties, which
    arithmetic `tolerance` away may order either way: test_f16mma_emulated's rule, over a whole run)."""
    top2 = np.sort(want, axis=1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] > 2 * tolerance * np.abs(want).max()
    np.testing.assert_array_equal(got.argmax(axis=1)[decided], want.argmax(axis=1)[decided])
    return float(decided.mean())


def hold(session, prompt: list[int], context: int) -> None:
    """The session holding the first `context` tokens of `prompt`: truncated, or prefilled up to there."""
    if session.position > context:
        session.truncate(context)
    elif session.position < context:
        session.prefill(prompt[session.position:context], logits="last")


def stepped(session, ids, logits: str, context: int):
    """The step's output, the session truncated back to `context` after it."""
    out = session.prefill(ids, logits=logits)
    session.truncate(context)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_every_step_size_through_its_graph(weights, cpu, device, request):
    weights, mix = weights
    tolerance = CPU_TOLERANCE[mix]
    gpu = gpu_engine(weights, request, device)
    graphs = gpu.executor.steps.step_graphs
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(0, CONFIG.vocab_size, max(CONTEXTS))]
    contexts_of = defaultdict(set)      # bucket -> the contexts its graphs were replayed at
    decided = defaultdict(list)         # against what -> each step's share of decided rows
    with cpu.new_session() as ref, gpu.new_session() as s:
        for k in STEP_TOKENS[mix]:
            for context in (CONTEXTS[k % 3], CONTEXTS[(k + 1) % 3]) if k <= 8 else (CONTEXTS[k % 3],):
                hold(ref, prompt, context)
                hold(s, prompt, context)
                ids = [int(t) for t in rng.integers(0, CONFIG.vocab_size, k)]
                want = stepped(ref, ids, "all", context)
                before = dict(gpu.executor.stats)
                got = stepped(s, ids, "all", context)
                last = stepped(s, ids, "last", context)
                argmax = stepped(s, ids, "argmax", context)
                replays = gpu.executor.stats["graph_replays"] - before["graph_replays"]
                assert replays == (3 if k <= 64 else 0), f"k={k}: {replays} graph replays"
                graphs.enabled = False
                eager = stepped(s, ids, "all", context)
                graphs.enabled = True
                label = f"k={k} at {context}: "
                assert relative_error(got, eager) < EAGER_TOLERANCE, label + "graph against eager"
                decided["eager"].append(decided_rows_agree(got, eager, EAGER_TOLERANCE))
                assert relative_error(got, want) < tolerance, label + "graph against the CPU engine"
                decided["cpu"].append(decided_rows_agree(got, want, tolerance))
                assert relative_error(last, want[-1]) < tolerance, label + "last row"
                decided_rows_agree(last[None], want[-1:], tolerance)
                np.testing.assert_array_equal(argmax, got.argmax(axis=1), err_msg=label + "argmax on the device")
                if k <= 64:
                    contexts_of[bucket_of(k)].add(context)
    assert min(np.mean(shares) for shares in decided.values()) > 0.9, "nearly every row decided"
    captured = graphs.captured()
    assert gpu.executor.stats["graphs_captured"] == len(captured) + 1, "once per key (+ one-token decode's)"
    assert {bucket_of(k) for k in STEP_TOKENS[mix] if k <= 64} <= {key[0] for key in captured}
    assert {(16, kind, True) for kind in ("all", "last", "argmax")} <= set(captured), "k=16: flash attention"
    assert all(len(contexts) >= 2 for contexts in contexts_of.values()), contexts_of
    gpu.close()


@pytest.mark.parametrize("device", DEVICES)
def test_eager_where_no_graph_serves(weights, cpu, device, request):
    """Several sessions in one step, a token tree, KESTREL_STEP_GRAPHS=0: the eager launches, same logits."""
    weights, mix = weights
    if mix == "q6_k":
        pytest.skip("Q4_K_M's blocks cover the choice")
    gpu = gpu_engine(weights, request, device)
    off = gpu_engine(weights, request, device, step_graphs=False)
    ids = [[5, 3, 200, 17, 42, 8, 1, 99, 250, 7], [9, 8, 7]]
    for engine in (gpu, off):
        before = engine.executor.stats.get("graph_replays", 0)
        a, b = engine.new_session(), engine.new_session()
        rows = engine.step([(a, ids[0]), (b, ids[1])])
        with cpu.new_session() as ref_a, cpu.new_session() as ref_b:
            for got, ref, prompt in zip(rows, (ref_a, ref_b), ids):
                want = ref.prefill(prompt)
                assert relative_error(got, want) < CPU_TOLERANCE[mix]
                decided_rows_agree(got, want, CPU_TOLERANCE[mix])
        tree = a.prefill_tree([4, 6, 8], parents=[-1, 0, 0])
        assert tree.shape == (3, CONFIG.vocab_size)
        assert engine.executor.stats.get("graph_replays", 0) == before, "two sessions and a tree: eager"
        single = a.prefill([11, 12, 13])
        assert single.shape == (3, CONFIG.vocab_size)
        replays = engine.executor.stats.get("graph_replays", 0) - before
        assert replays == (1 if engine is gpu else 0)
        a.close()
        b.close()
    gpu.close()
    off.close()


def test_a_mixture_of_experts_model_pads_no_step(monkeypatch):
    """A routed layer counts each row's experts: a step of k tokens replays a graph only where its bucket is k
    itself, so the routing counts are the eager engine's (12 tokens would pad to 16: eager)."""
    fake_cuda.install(monkeypatch, mode="deferred")
    weights = random_q8_weights(PRESETS["qwen3-moe-tiny"], seed=7)
    engines = [Engine(weights, device="cuda", mode="gpu", max_seq_len=32, max_batch=4,
                      options=Options(step_graphs=on)) for on in (True, False)]
    outs = []
    for engine in engines:
        with engine.new_session() as s:
            outs.append([s.prefill([9, 8, 7, 6, 5]), s.prefill([5, 3, 200, 17, 42, 8, 1, 99, 250, 7, 64, 31])])
    graphs, eager = engines
    assert graphs.executor.stats["graph_replays"] == 1 and eager.executor.stats["graph_replays"] == 0
    for got, want in zip(*outs):
        assert relative_error(got, want) < EAGER_TOLERANCE
    np.testing.assert_array_equal(graphs.executor.routing_counts(), eager.executor.routing_counts())
    for engine in engines:
        engine.close()


def test_a_replayed_step_is_one_graph_launch_and_one_sync(monkeypatch):
    """At the driver (test_decode_step_driver_calls' log): after its capture, a 12-token step is one graph
    launch and one host wait, and with logits="all" one copy of its own 12 rows out; nothing else."""
    from test_decode_step_driver_calls import DriverLog
    fake_cuda.install(monkeypatch, mode="deferred")
    engine = Engine(random_q8_weights(CONFIG, seed=7), device="cuda", mode="gpu", max_seq_len=MAX_SEQ_LEN,
                    max_batch=4)
    log = DriverLog(monkeypatch)
    ids = list(range(40, 52))
    with engine.new_session() as s:
        s.prefill(list(range(1, 19)), logits="last")     # positions 18.. stay in the KV block of 16..31
        for logits, copies_out in (("last", 0), ("argmax", 0), ("all", 1)):
            stepped(s, ids, logits, 18)                  # the capture
            log.take()
            log.captured_bytes.clear()
            for _ in range(3):
                stepped(s, ids, logits, 18)
            ran = log.take()
            assert ran == {"graph launch": 3, "sync": 3, **({"d2h_async": 3} if copies_out else {})}, (logits, ran)
    engine.close()


def test_a_capture_the_driver_refuses_turns_step_graphs_off_and_the_step_runs_eagerly(monkeypatch, capsys):
    """A driver that will not capture (an old one, a stream it cannot record) costs the graphs, not the step."""
    from kestrel_stream.cuda.errors import CudaError
    fake_cuda.install(monkeypatch, mode="deferred")
    prompt = list(range(3, 15))
    engines = [Engine(random_q8_weights(CONFIG, seed=7), device="cuda", mode="gpu", max_seq_len=MAX_SEQ_LEN,
                      max_batch=4, options=Options(step_graphs=on)) for on in (False, True)]
    with engines[0].new_session() as s:
        eager = s.prefill(prompt)

    def refused(stream):
        raise CudaError("cuStreamBeginCapture failed: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
    monkeypatch.setattr(driver, "capture", refused)
    with engines[1].new_session() as s:
        np.testing.assert_allclose(s.prefill(prompt), eager, rtol=1e-6, atol=1e-6)
        assert not engines[1].executor.steps.step_graphs.enabled
        more = s.prefill([5, 6, 7])                    # eager from now on: no capture asked for again
    with engines[0].new_session() as s:
        np.testing.assert_allclose(more, s.prefill(prompt + [5, 6, 7])[-3:], rtol=2e-3, atol=2e-3)   # other chunks
    assert "step graphs off" in capsys.readouterr().err
    for engine in engines:
        engine.close()
