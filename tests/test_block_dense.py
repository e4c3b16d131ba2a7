"""The 4/6-bit block formats on the library GEMM path (cuBLAS on fp16, scheduler/dense.py): each format's
expansion (dense_gemm.cu's <fmt>[_<tail fmt>]_dequant_f16) against model/quant4.py's dequantization, a
projection through gemv_launch against numpy, and gpu-mode steps of a random Q4_K_M model against the CPU
engine with the plan counting what ran.

The kernel cases run on the emulated device (fake_dense's twins: CI) and, marked `gpu`, on a real one with
the NVRTC-built kernels and cuBLAS (`pytest -m gpu tests/test_block_dense.py`; the `cublas` extra).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fake_cuda
import scheduler
from bench.make_gguf import write as write_gguf
from bench.synthetic import random_blocks
from hf_oracle import relative_error
from kestrel_stream.cuda import cublas, driver
from kestrel_stream.cuda.block_kernels import qweight_rows
from kestrel_stream.cuda.dense_gemm import DenseGemm, DenseScratch, dequant_launch
from kestrel_stream.cuda.kernels import gemv_launch
from kestrel_stream.loading.loader import load_weights
from kestrel_stream.model.quant4 import BlockTensor, RowStack, fuse_rows
from kestrel_stream.options import Options
from kestrel_stream.run.device.step_graphs import EXACT_TOKENS, PADDED_TOKENS
from kestrel_stream.run.engine import Engine
from scheduler.dense import (BLOCK_DENSE_MIN_TOKENS, DENSE_MIN_TOKENS, WORKSPACE_BYTES, default_min_tokens,
                             scratch_shape, takes_dense)
from test_block_kernels import DEVICES, Harness, run_product, upload
from test_block_models_emulated import QWEN3 as Q4_QWEN3
from test_plan_is_what_runs import ran_one_step

# (format(s), rows per part, K): odd row counts, K of one or several 256-blocks (Q4_0: 32-blocks, not of 256),
# two-format weights as a Q4_K_M file's fused QKV (Q6_K v rows after Q4_K q and k rows)
# (and gate/up pairs: an even row count of one format)
WEIGHTS = {"Q4_0": (("Q4_0",), (37,), 160), "Q4_K": (("Q4_K",), (71,), 768), "Q6_K": (("Q6_K",), (9,), 512),
           "Q4_K-pairs": (("Q4_K",), (70,), 512), "Q6_K-pairs": (("Q6_K",), (18,), 256),
           "Q4_K+Q6_K": (("Q4_K", "Q6_K"), (24, 10), 256), "Q4_K+Q6_K-odd": (("Q4_K", "Q6_K"), (33, 7), 1280)}
MAX_TOKENS = 256
BLOCK_TOLERANCE = 4e-3      # a 4/6-bit model's engine against the CPU engine (test_step_graphs.CPU_TOLERANCE)


def weight(name: str, seed: int):
    formats, rows, cols = WEIGHTS[name]
    rng = np.random.default_rng(seed)
    return fuse_rows([BlockTensor(f, random_blocks(rng, f, n, cols, 1 / np.sqrt(cols)), cols)
                      for f, n in zip(formats, rows)])


@pytest.fixture(params=DEVICES)
def dev(request, monkeypatch):
    h = Harness(request.param, monkeypatch)
    if request.param == "emulated":
        from fake_dense import FakeCublas
        blas = FakeCublas()
    else:
        blas = cublas.load()
        if blas is None:
            h.arena.release()
            pytest.skip("cuBLAS is not installed (pip install 'kestrel-stream[cublas]')")
    rows, cols = max(sum(r) for _, r, _ in WEIGHTS.values()), max(k for *_, k in WEIGHTS.values())
    h.scratch = DenseScratch.allocate(h.arena, blas, min_tokens=1, max_tokens=MAX_TOKENS,
                                      weight_elements=rows * cols, max_cols=cols, output_floats=rows,
                                      workspace_bytes=WORKSPACE_BYTES)
    yield h
    blas.destroy()
    h.arena.release()


def expanded(dev, qw) -> np.ndarray:
    """fp16 [rows, cols]: the weight's expansion into the scratch, read back."""
    dev.run(dequant_launch(dev.kernels, qw, dev.scratch.weights))
    out = np.empty((qw.rows, qw.cols), np.float16)
    driver.d2h_async(out, dev.scratch.weights, out.nbytes, dev.stream)
    dev.stream.synchronize()
    return out


@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_the_expansion_is_the_reference_dequantization_in_fp16(dev, name):
    """Bit for bit: the kernel rounds quant4's float32 value once, as numpy's astype(float16) does."""
    w = weight(name, seed=len(name))
    np.testing.assert_array_equal(expanded(dev, upload(dev, w)), w.dequantize().astype(np.float16))


@pytest.mark.parametrize("lo,hi", [(3, 20), (20, 30), (26, 34), (0, 34)])
def test_row_ranges_of_a_two_format_weight(dev, lo, hi):
    """A split QKV's row range (block_kernels.qweight_rows): the head's rows, the tail's, or across both."""
    w = weight("Q4_K+Q6_K", seed=3)
    qw = qweight_rows(upload(dev, w), lo, hi)
    np.testing.assert_array_equal(expanded(dev, qw), w.dequantize()[lo:hi].astype(np.float16))


@pytest.mark.parametrize("name,epilogue", [(name, epilogue) for name in ("Q4_0", "Q4_K", "Q6_K", "Q4_K+Q6_K-odd")
                                           for epilogue in ("rmsnorm", "residual_xn_rms")]
                         + [("Q4_K-pairs", "silu_pairs"), ("Q6_K-pairs", "silu_pairs")])
@pytest.mark.parametrize("tokens", [128, 201])
def test_a_block_projection_on_cublas_matches_numpy(dev, name, tokens, epilogue):
    """gemv_launch with the scratch: a DenseGemm of 3 or 4 launches, within 2e-3 of the largest output of
    float32 x @ dequant(W).T (the fp16 operands; the int8 GEMM's tolerance, test_block_kernels)."""
    qw, launch, want, got, norms = run_product(dev, weight(name, seed=tokens + len(epilogue)), tokens, epilogue,
                                               dense=dev.scratch)
    assert dev.scratch.serves(qw, tokens, epilogue == "silu_pairs")
    if norms is not None:
        xn, inv_rms, normw = norms
        np.testing.assert_allclose(xn, got * normw, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(inv_rms, 1 / np.sqrt(np.mean(want * want, axis=1) + 1e-6), rtol=2e-2)
    assert isinstance(launch, DenseGemm) and launch.dequant.name.endswith("_dequant_f16")
    assert launch.launch_count == (3 if epilogue == "rmsnorm" else 4)
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max(), (name, tokens, epilogue)


def test_the_built_in_gemm_keeps_block_formats_off_the_path(dev):
    """q8_gemm_f16.cu expands Q8_0 in registers only: without cuBLAS a block weight keeps its int8 kernels."""
    built_in = dataclasses.replace(dev.scratch, blas=None, weights=0)
    qw = upload(dev, weight("Q4_K", seed=1))
    assert dev.scratch.serves(qw, 128, False) and not built_in.serves(qw, 128, False)
    assert not isinstance(gemv_launch(dev.kernels, qw, 0, qw.cols, 0, qw.rows, 128, dense=built_in), DenseGemm)


# the random Q4_K_M model of test_block_models_emulated: Q4_K with Q6_K attn_v (a two-format QKV) and
# ffn_down in some layers, Q6_K token_embd (tied: lm_head, too large for the scratch)
Q4_K_M = dataclasses.replace(Q4_QWEN3, max_position_embeddings=512)
Q4_K_M_PROMPT = [int(t) for t in np.random.default_rng(8).integers(1, 250, 140)]
PROJECTIONS = ("qkv", "o", "gate_up", "down")


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    path = tmp_path_factory.mktemp("q4_k_m") / "m.gguf"
    write_gguf(Q4_K_M, None, str(path), seed=11, mix="q4_k_m")
    return load_weights(path)


def lm_head_fits(c) -> bool:
    return c.vocab_size * c.hidden_size <= scratch_shape(c).weight_elements


def test_the_q4_k_m_mix_takes_the_path_from_its_own_threshold(q4_k_m):
    c = q4_k_m.config
    assert default_min_tokens(c) == BLOCK_DENSE_MIN_TOKENS < DENSE_MIN_TOKENS
    assert any(isinstance(lw.wqkv, RowStack) for lw in q4_k_m.layers), "a two-format QKV"
    ops = [op for op in scheduler.step_ops(c, 512) if op.is_projection and op.layer is not None]
    assert all(takes_dense(op, 512, c, BLOCK_DENSE_MIN_TOKENS) for op in ops)
    assert not any(takes_dense(op, 512, c, BLOCK_DENSE_MIN_TOKENS, fused=True) for op in ops), "built-in: Q8_0 only"
    assert not any(takes_dense(op, BLOCK_DENSE_MIN_TOKENS - 1, c, BLOCK_DENSE_MIN_TOKENS) for op in ops)


def test_no_step_graph_bucket_straddles_a_switch_point():
    """A graph runs the kernels of its bucket's size for every step it pads up to it, so each switch point
    to the dense path is the first size of a bucket (or past the largest): with graphs on and off a step
    takes the same kernels."""
    buckets = sorted(set(EXACT_TOKENS + PADDED_TOKENS))
    for switch in (DENSE_MIN_TOKENS, BLOCK_DENSE_MIN_TOKENS):
        assert switch - 1 in buckets or switch > buckets[-1], switch


@pytest.mark.parametrize("device", DEVICES)
def test_a_q4_k_m_prefill_on_cublas_tracks_the_cpu_engine(q4_k_m, monkeypatch, device):
    """140 tokens in one step, every row's logits, at the default threshold: every layer projection on
    cuBLAS (its expansion from the blocks), within the 4/6-bit engines' 4e-3 of the CPU engine (the H200:
    2.09e-3 over this model's three layers; test_step_graphs' CPU_TOLERANCE), the same argmax wherever the
    reference's top two are further apart than twice that; steps of fewer than BLOCK_DENSE_MIN_TOKENS
    tokens keep q4_mma.cu."""
    if device == "emulated":
        fake_cuda.install(monkeypatch, mode="deferred", cublas=True)
    elif not cublas.available():
        pytest.skip("cuBLAS is not installed (pip install 'kestrel-stream[cublas]')")
    c = q4_k_m.config
    cpu = Engine(q4_k_m, device="cpu", max_seq_len=256)
    gpu = Engine(q4_k_m, device="cuda", mode="gpu", max_seq_len=256, max_batch=4)
    x = gpu.executor
    assert x.backend.dense_min_tokens == BLOCK_DENSE_MIN_TOKENS and not x.backend.state.dense.fused
    dense = [launch for launch in x.steps.step_launches(len(Q4_K_M_PROMPT))
             if isinstance(launch, DenseGemm) and launch.labels["op"] in PROJECTIONS]
    assert len(dense) == 4 * c.num_hidden_layers
    assert {launch.dequant.name for launch in dense} >= {"q4_k_dequant_f16", "q4_k_q6_k_dequant_f16",
                                                         "q6_k_dequant_f16"}
    short = x.steps.step_launches(BLOCK_DENSE_MIN_TOKENS - 1)
    assert not any(isinstance(launch, DenseGemm) for launch in short)
    assert any("_mma" in launch.name for launch in short)
    want = cpu.new_session().prefill(Q4_K_M_PROMPT)
    got = gpu.new_session().prefill(Q4_K_M_PROMPT)
    assert relative_error(got, want) < BLOCK_TOLERANCE
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * BLOCK_TOLERANCE * np.abs(want).max()
    np.testing.assert_array_equal(got.argmax(axis=1)[clear], want.argmax(axis=1)[clear])
    if device == "emulated":
        # the tied Q6_K table as lm_head: on the path too, per piece of logits rows that reaches the threshold
        rows, n = x.backend.logits_rows, len(Q4_K_M_PROMPT)
        lm_heads = sum(min(rows, n - first) >= BLOCK_DENSE_MIN_TOKENS for first in range(0, n, rows))
        assert x.backend.blas.gemms == 4 * c.num_hidden_layers + lm_head_fits(c) * lm_heads
    gpu.close()


def test_the_plan_counts_the_block_expansions(q4_k_m, monkeypatch):
    """A Q4_K_M prefill past the threshold, every row's logits: the plan's launches and syncs equal the
    executor's, and its weight bytes the step's launches' (the Q6_K embedding's gathered rows in Q6_K's
    bytes); each layer adds 11 launches (expansion, input, GEMM, and an epilogue for o, gate_up and down: 3 or
    4 kernels for 1), lm_head 2."""
    fake_cuda.install(monkeypatch, mode="deferred", cublas=True)
    c = q4_k_m.config
    engine = Engine(q4_k_m, device="cuda", mode="gpu", max_seq_len=256, max_batch=160)
    n = BLOCK_DENSE_MIN_TOKENS + 5
    ran = ran_one_step(engine, lambda: engine.new_session().prefill(Q4_K_M_PROMPT[:n]))
    plan = engine.executor.plan(n)
    assert (ran["kernels"], ran["syncs"]) == (plan.launches_per_step, plan.syncs_per_step)
    launched = sum(launch.labels.get("bytes", 0) for launch in engine.executor.steps.step_launches(n))
    assert launched == plan.counters()["gpu_weight_read_bytes"]
    plain = scheduler.build_plan(c, n, "gpu", gpu_available=True)
    assert plan.launches_per_step == plain.launches_per_step + 11 * c.num_hidden_layers + 2 * lm_head_fits(c)
    engine.close()


def test_options_move_the_threshold_for_every_format(q4_k_m, monkeypatch):
    """KESTREL_CUBLAS_MIN_TOKENS (Options.cublas_min_tokens) sets it for block formats too; 0 leaves them on
    their int8 kernels (the built-in GEMM reads Q8_0 only)."""
    fake_cuda.install(monkeypatch, mode="deferred", cublas=True)
    for min_tokens, want in ((32, 32), (0, DENSE_MIN_TOKENS)):
        engine = Engine(q4_k_m, device="cuda", mode="gpu", max_seq_len=256, max_batch=4,
                        options=Options().with_(cublas_min_tokens=min_tokens))
        x = engine.executor
        assert x.backend.dense_min_tokens == want
        launches = x.steps.step_launches(140)
        assert any(isinstance(launch, DenseGemm) for launch in launches) == (min_tokens != 0)
        engine.close()
