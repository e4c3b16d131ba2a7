"""gpu mode's library GEMM path (cuBLAS on fp16, scheduler/dense.py) on the emulated device: logits
against the CPU engine, which ops take it, the plan's launch counts, graphs and the residency window
with it, and the path off -- no library, or Options.cublas_min_tokens=0 -- without an error."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fake_cuda
import scheduler
from hf_oracle import relative_error
from kestrel_stream.cuda import cublas
from kestrel_stream.cuda.dense_gemm import DenseGemm
from kestrel_stream.loading.presets import PRESETS
from bench.synthetic import random_q8_weights
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.options import Options
from kestrel_stream.run.device.budget import budget_for_weight_fraction, gpu_mode_needs
from kestrel_stream.run.engine import Engine
from scheduler.dense import DENSE_MIN_TOKENS, scratch_shape, takes_dense
from test_plan_is_what_runs import assert_the_plans_ran, ran_one_step

QWEN3 = ModelConfig(arch="qwen3", hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=256,
                    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                    max_position_embeddings=512)
# untied lm_head too large for the scratch (1000 x 128 > gate_up's 384 x 128): it keeps the built-in kernels
LLAMA = dataclasses.replace(QWEN3, arch="llama", num_key_value_heads=1, vocab_size=1000, rope_theta=10000.0,
                            tie_word_embeddings=False)
MIN_TOKENS = 16


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 250, n)]


def engines(cfg: ModelConfig, min_tokens: int | None = MIN_TOKENS, **gpu_args):
    weights = random_q8_weights(cfg, seed=11)
    gpu = Engine(weights, device="cuda", mode="gpu", max_seq_len=256, max_batch=4,
                 options=Options().with_(cublas_min_tokens=min_tokens), **gpu_args)
    return Engine(weights, device="cpu", max_seq_len=256), gpu


def lm_head_fits(cfg: ModelConfig) -> bool:
    return cfg.vocab_size * cfg.hidden_size <= scratch_shape(cfg).weight_elements


def gemms_per_step(cfg: ModelConfig) -> int:
    return 4 * cfg.num_hidden_layers + lm_head_fits(cfg)


@pytest.mark.parametrize("cfg", [QWEN3, LLAMA], ids=["qwen3", "llama"])
def test_prefill_on_cublas_tracks_the_cpu_engine(monkeypatch, cfg):
    """40 tokens with every row's logits (one step), 100 more with the last row's (one step: lm_head on
    one row keeps its kernel), then decodes on the GEMV kernels: within 2e-3 of the CPU engine, the
    same argmax."""
    fake_cuda.install(monkeypatch, mode="deferred", cublas=True)
    cpu, gpu = engines(cfg)
    blas = gpu.executor.backend.blas
    with cpu.new_session() as ref, gpu.new_session() as s:
        want, got = ref.prefill(prompt(40, 1)), s.prefill(prompt(40, 1))
        assert relative_error(got, want) < 2e-3
        np.testing.assert_array_equal(got.argmax(axis=1), want.argmax(axis=1))
        assert blas.gemms == gemms_per_step(cfg)
        want, got = ref.prefill(prompt(100, 2))[-1], s.prefill(prompt(100, 2), logits="last")
        assert relative_error(got, want) < 2e-3 and int(np.argmax(got)) == int(np.argmax(want))
        assert blas.gemms == gemms_per_step(cfg) + 4 * cfg.num_hidden_layers
        token = int(np.argmax(want))
        for _ in range(3):
            want, got = ref.decode(token), s.decode(token)
            assert relative_error(got, want) < 2e-3 and int(np.argmax(got)) == int(np.argmax(want))
            token = int(np.argmax(want))
    assert blas.gemms == gemms_per_step(cfg) + 4 * cfg.num_hidden_layers, "decode steps stay on the GEMV"
    gpu.close()


def test_which_ops_take_the_path(monkeypatch):
    fake_cuda.install(monkeypatch, mode="deferred", cublas=True)
    _, gpu = engines(LLAMA)
    x = gpu.executor
    names = {launch.labels["op"]: type(launch) for launch in x.steps.step_launches(MIN_TOKENS) if "op" in launch.labels}
    assert all(names[op] is DenseGemm for op in ("qkv", "o", "gate_up", "down")), names
    assert names["lm_head"] is not DenseGemm and names["attention"] is not DenseGemm
    assert not any(isinstance(launch, DenseGemm) for launch in x.steps.step_launches(MIN_TOKENS - 1))
    gpu.close()
    real = PRESETS["qwen3-1.7b"]
    ops = {op.group: op for op in scheduler.step_ops(real, 512) if op.is_projection}
    assert all(takes_dense(ops[g], 512, real, DENSE_MIN_TOKENS) for g in ("qkv", "o", "gate_up", "down"))
    assert not takes_dense(ops["lm_head"], 512, real, DENSE_MIN_TOKENS), "151936 x 2048 does not fit the scratch"
    assert not takes_dense(ops["qkv"], DENSE_MIN_TOKENS - 1, real, DENSE_MIN_TOKENS)
    q4 = dataclasses.replace(real, weight_formats=(("model.layers.0.mlp.down_proj.weight", "Q4_K"),))
    layer0 = {op.group: op for op in scheduler.step_ops(q4, 512) if op.is_projection and op.layer == 0}
    assert takes_dense(layer0["down"], 512, q4, DENSE_MIN_TOKENS), "cuBLAS expands the block formats too"
    assert not takes_dense(layer0["down"], 512, q4, DENSE_MIN_TOKENS, fused=True), "the built-in GEMM: Q8_0 only"
    assert scratch_shape(real).weight_elements == 2 * 6144 * 2048


@pytest.mark.parametrize("batch", (3, 12))
def test_the_plan_counts_the_library_launches(monkeypatch, batch):
    """A prefill of 14 tokens (its bucket's graph: 16 rows, run/device/step_graphs.py) and a decode batch (12:
    one captured graph bucket of 12 rows), cuBLAS from 9 tokens: the plan's launches, syncs and bytes equal the
    executor's (the prefill's logits: its own 14 rows); each layer adds 11 launches."""
    fake_cuda.install(monkeypatch, mode="deferred", cublas=True)
    weights = random_q8_weights(QWEN3, seed=5)
    engine = Engine(weights, device="cuda", mode="gpu", max_seq_len=32, max_batch=12,
                    options=Options().with_(cublas_min_tokens=9))
    x = engine.executor
    ran = ran_one_step(engine, lambda: engine.new_session().prefill(prompt(14, 3)))
    plan = x.plan(14)
    assert_the_plans_ran(engine, "gpu", ran, [x.plan(16)], "prefill 14", d2h_bytes=plan.d2h_bytes_per_step)
    plain = scheduler.build_plan(QWEN3, 14, "gpu", gpu_available=True)
    assert plan.launches_per_step == plain.launches_per_step + 11 * QWEN3.num_hidden_layers + 2 * lm_head_fits(QWEN3)
    assert any("cuBLAS" in note for note in plan.notes) and not any("cuBLAS" in n for n in x.plan(8).notes)
    sessions = [engine.new_session() for _ in range(batch)]
    first_tokens = iter((3, 7))

    def step():
        first = next(first_tokens)
        engine.decode_batch([(s, first + i) for i, s in enumerate(sessions)])

    ran = ran_one_step(engine, step)
    bucket = next(b for b in x.steps.buckets if b >= batch)
    assert_the_plans_ran(engine, "gpu", ran, [x.plan(bucket)], f"decode {batch}")
    assert ran["graph_replays"] == 1
    engine.close()


def test_graph_replays_on_cublas_match_the_cpu_engine(monkeypatch):
    """12 sessions decoding together (a captured bucket of 12 >= 9 tokens) with the library GEMM."""
    fake_cuda.install(monkeypatch, mode="deferred", cublas=True)
    weights = random_q8_weights(QWEN3, seed=5)
    cpu = Engine(weights, device="cpu", max_seq_len=32, max_batch=12)
    gpu = Engine(weights, device="cuda", mode="gpu", max_seq_len=32, max_batch=12,
                 options=Options().with_(cublas_min_tokens=9))
    refs, ours = [cpu.new_session() for _ in range(12)], [gpu.new_session() for _ in range(12)]
    tokens = [3 + i for i in range(12)]
    for _ in range(2):
        want = cpu.decode_batch(list(zip(refs, tokens)))
        got = gpu.decode_batch(list(zip(ours, tokens)))
        for w, g in zip(want, got):
            assert relative_error(g, w) < 2e-3 and int(np.argmax(g)) == int(np.argmax(w))
        tokens = [int(np.argmax(w)) for w in want]
    assert gpu.executor.counters.graphs_captured == 1 and gpu.executor.backend.blas.gemms == gemms_per_step(QWEN3)
    gpu.close()


def test_streamed_weights_on_cublas(monkeypatch):
    """Half the weights streamed through the residency window's slots: each expansion reads its slot."""
    fake_cuda.install(monkeypatch, mode="deferred", cublas=True)
    cfg = dataclasses.replace(QWEN3, hidden_size=256, intermediate_size=256)      # weights above 64 KiB stream
    needs = gpu_mode_needs(cfg, 4, 256)
    budget = budget_for_weight_fraction(cfg, needs, 0.5)        # needs count the GEMM scratch (cuBLAS loads)
    cpu, gpu = engines(cfg, vram_budget=budget)
    assert gpu.executor.backend.window.streamed, "the budget should stream some weights"
    want, got = cpu.new_session().prefill(prompt(40, 4)), gpu.new_session().prefill(prompt(40, 4))
    assert relative_error(got, want) < 2e-3
    np.testing.assert_array_equal(got.argmax(axis=1), want.argmax(axis=1))
    assert gpu.executor.backend.blas.gemms == gemms_per_step(cfg)
    gpu.close()


@pytest.mark.parametrize("library", [False, True])
@pytest.mark.parametrize("cfg", [QWEN3, LLAMA], ids=["qwen3", "llama"])
def test_without_cublas_the_built_in_gemm_runs(monkeypatch, library, cfg):
    """No cuBLAS (library False), or cublas_min_tokens=0: the dense path on q8_gemm_f16.cu from
    DENSE_MIN_TOKENS tokens -- no weight expansion, no weight scratch --, q8_mma below it; logits
    within 2e-3 of the CPU engine with the same argmax."""
    fake_cuda.install(monkeypatch, mode="deferred", cublas=library)
    cpu, gpu = engines(cfg, min_tokens=0 if library else MIN_TOKENS)
    x = gpu.executor
    assert x.backend.blas is None and x.backend.dense_min_tokens == DENSE_MIN_TOKENS
    assert x.backend.state.dense.fused and x.backend.state.dense.weights == 0
    long = DENSE_MIN_TOKENS + 9
    dense = [launch for launch in x.steps.step_launches(long) if isinstance(launch, DenseGemm)]
    assert len(dense) == 4 * cfg.num_hidden_layers + 1          # lm_head too: no weight scratch to fit
    assert all(launch.dequant is None and launch.builtin.name.startswith("q8_gemm_f16_") for launch in dense)
    assert sorted({launch.launch_count for launch in dense}) == [2, 3]     # qkv, lm_head: 2; o, gate_up, down: 3
    assert all(launch.launch_count == 1 for launch in x.steps.step_launches(40))
    assert any(launch.name.startswith("q8_mma") for launch in x.steps.step_launches(40))
    for n, seed in ((40, 1), (long, 2)):
        want, got = cpu.new_session().prefill(prompt(n, seed)), gpu.new_session().prefill(prompt(n, seed))
        assert relative_error(got, want) < 2e-3, n
        np.testing.assert_array_equal(got.argmax(axis=1), want.argmax(axis=1))
    assert any("built-in" in note for note in x.plan(long).notes)
    assert not any("dense GEMM" in note for note in x.plan(40).notes)
    gpu.close()


def test_the_plan_counts_the_built_in_gemm_launches(monkeypatch):
    """A prefill past DENSE_MIN_TOKENS on the built-in GEMM, every row's logits: the plan's launches, syncs and
    bytes equal the executor's; each layer adds 7 launches (o, gate_up, down: 3 each, qkv 2, for 1 each),
    lm_head 1."""
    fake_cuda.install(monkeypatch, mode="deferred", cublas=False)
    weights = random_q8_weights(QWEN3, seed=5)
    engine = Engine(weights, device="cuda", mode="gpu", max_seq_len=256, max_batch=160)   # 160 rows of logits
    n = DENSE_MIN_TOKENS + 3
    ran = ran_one_step(engine, lambda: engine.new_session().prefill(prompt(n, 3)))
    plan = engine.executor.plan(n)
    assert_the_plans_ran(engine, "gpu", ran, [plan], f"prefill {n}")
    plain = scheduler.build_plan(QWEN3, n, "gpu", gpu_available=True)
    assert plan.launches_per_step == plain.launches_per_step + 7 * QWEN3.num_hidden_layers + 1
    engine.close()


def test_the_scratch_is_in_the_arena_budget(monkeypatch):
    fake_cuda.install(monkeypatch, mode="deferred", cublas=True)
    _, on = engines(QWEN3)
    fake_cuda.install(monkeypatch, mode="deferred", cublas=False)
    _, off = engines(QWEN3)
    shape = scratch_shape(QWEN3)
    assert on.executor.backend.memory.arena_bytes - off.executor.backend.memory.arena_bytes == shape.nbytes(512) - shape.nbytes(512, fused=True)
    assert shape.nbytes(512, fused=True) < shape.nbytes(512) - 2 * shape.weight_elements
    on.close(), off.close()


def test_a_missing_library_is_one_line_and_no_error(monkeypatch):
    lines: list[str] = []
    monkeypatch.setitem(cublas._loaded, "lib", "DynamicLibNotFoundError: no libcublas.so.13")
    assert cublas.load(log=lines.append) is None
    assert len(lines) == 1 and "cuBLAS not available" in lines[0] and "built-in GEMM" in lines[0]

    class Broken:
        def __init__(self, lib, path):
            raise cublas.CublasError("cublasCreate failed: CUBLAS_STATUS_NOT_INITIALIZED")
    monkeypatch.setitem(cublas._loaded, "lib", (object(), "/lib/libcublas.so.13"))
    monkeypatch.setattr(cublas, "Cublas", Broken)
    assert cublas.load(log=lines.append) is None
    assert len(lines) == 2 and "did not initialise" in lines[1]


class RecordingLib:
    """The cuBLAS functions the binding calls, recording their arguments."""

    def __init__(self):
        self.calls: list = []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            return 0
        return call


def test_the_binding_maps_row_major_onto_cublas_and_resets_the_workspace_per_stream():
    lib = RecordingLib()
    blas = cublas.Cublas(lib, "recorded")
    blas.use_workspace(0x1000, 1 << 20)
    stream = type("S", (), {"handle": 0xABC})()
    blas.gemm_nt(stream, 7, 96, 160, a=0x20, lda=160, b=0x30, ldb=160, c=0x40, ldc=100, accumulate=True)
    blas.gemm_nt(stream, 7, 96, 160, a=0x20, lda=160, b=0x30, ldb=160, c=0x40, ldc=100)
    names = [name for name, _ in lib.calls]
    assert names.count("cublasSetStream_v2") == 1 and names.count("cublasSetWorkspace_v2") == 1
    assert names.index("cublasSetWorkspace_v2") > names.index("cublasSetStream_v2"), "the stream resets it"
    gemm = [args for name, args in lib.calls if name == "cublasGemmEx"][0]
    # C^T[cols, rows] = B[cols, depth] (op T) x A^T (op N): m = cols, n = rows, k = depth
    assert gemm[1:6] == (cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, 96, 7, 160)
    assert (gemm[7].value, gemm[8], gemm[9], gemm[10].value, gemm[11], gemm[12]) == \
        (0x30, cublas.CUDA_R_16F, 160, 0x20, cublas.CUDA_R_16F, 160)
    assert (gemm[14].value, gemm[15], gemm[16], gemm[17]) == (0x40, cublas.CUDA_R_32F, 100, cublas.CUBLAS_COMPUTE_32F)
    blas.gemm_nt(type("S", (), {"handle": 0xDEF})(), 7, 96, 160, 0x20, 160, 0x30, 160, 0x40, 100)
    assert [name for name, _ in lib.calls].count("cublasSetWorkspace_v2") == 2


def test_cublas_is_an_optional_linux_extra():
    from pathlib import Path

    from packaging.requirements import Requirement
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert not any(Requirement(d).name == "nvidia-cublas" for d in project["dependencies"])
    [extra] = [Requirement(d) for d in project["optional-dependencies"]["cublas"]]
    assert extra.name == "nvidia-cublas" and extra.marker.evaluate({"sys_platform": "linux"})
    assert not extra.marker.evaluate({"sys_platform": "darwin"})


def test_a_trace_shows_each_library_gemm(monkeypatch, tmp_path):
    """Each GEMM is a launch of its own on the compute stream's row (its kernels trace as theirs do): a
    prompt of 70 tokens, past the largest bucket of one session's step graphs, launches eagerly."""
    import json

    from kestrel_stream.cuda import driver
    from kestrel_stream.obs import trace
    fake_cuda.install(monkeypatch, mode="deferred", cublas=True)
    # the trace's GPU clock and reference stream outlive it in the driver module: put them back afterwards
    monkeypatch.setattr(driver, "_gpu_times", None)
    monkeypatch.setattr(driver, "_reference_stream", None)
    _, gpu = engines(QWEN3)
    trace.start(tmp_path / "trace.json")
    try:
        gpu.new_session().prefill(prompt(70, 1))
    finally:
        path = trace.stop()
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("name") == "launch cublas_gemm_f16"]
    assert len(events) == gemms_per_step(QWEN3) and {e["args"]["stream"] for e in events} == {"compute"}
    gpu.close()
