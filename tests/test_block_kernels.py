"""The 4/6-bit block-format kernels (q4_gemv.cu, q4_mma.cu, embed_<fmt>) against numpy on awkward shapes.

Each case runs on the emulated device (fake_block_kernels' twins: CI) and, marked `gpu`, on a real
one with the NVRTC-built kernels.  Reference: float32 x @ dequant(W).T with gguf-py's values
(test_quant4), then the epilogues; the GEMV within 1e-5 relative (fp32 sums in another order), the
tensor-core GEMM within 2e-3 (its int8 activations, the Q8_0 GEMM's tolerance).
"""
from __future__ import annotations

import numpy as np
import pytest

import fake_cuda
from kestrel_stream.cuda import driver, q4_gemv_variants
from kestrel_stream.cuda.block_kernels import embed_kernel, qweight_rows
from kestrel_stream.cuda.kernels import GEMV_COUNTER_BYTES, gemv_launch
from kestrel_stream.model.quant4 import BlockTensor, fuse_rows
from bench.synthetic import random_blocks
from kestrel_stream.run.device.block_weights import block_image, device_qweight

DEVICES = ["emulated", pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not driver.gpu_available(), reason="no GPU")])]
# (format(s), rows per part, K): odd row counts, K of a few blocks (Q4_0: not a multiple of 128)
WEIGHTS = {"Q4_0": (("Q4_0",), (37,), 160), "Q4_K": (("Q4_K",), (70,), 768), "Q6_K": (("Q6_K",), (9,), 512),
           "Q4_K+Q6_K": (("Q4_K", "Q6_K"), (24, 10), 256), "Q4_K-big": (("Q4_K",), (258,), 2048)}
TOKENS = (1, 2, 3, 8, 9, 70)


class Harness:
    def __init__(self, kind: str, monkeypatch, arena_bytes: int = 64 << 20):
        if kind == "emulated":
            fake_cuda.install(monkeypatch)
        from kestrel_stream.cuda import kernels
        self.device = driver.Device(0)
        self.kernels = kernels.KernelSet(self.device)
        self.arena = driver.Arena(arena_bytes)
        self.stream = driver.Stream()

    def put(self, array: np.ndarray) -> int:
        array = np.ascontiguousarray(array)
        ptr = self.arena.alloc(max(array.nbytes, 16))
        driver.h2d_sync(ptr, array)
        return ptr

    def get(self, ptr: int, shape) -> np.ndarray:
        out = np.empty(shape, np.float32)
        driver.d2h_async(out, ptr, out.nbytes, self.stream)
        self.stream.synchronize()
        return out

    def run(self, launch) -> None:
        launch.enqueue(self.stream)
        self.stream.synchronize()


@pytest.fixture(params=DEVICES)
def dev(request, monkeypatch):
    h = Harness(request.param, monkeypatch)
    yield h
    h.arena.release()


def weight(name: str, seed: int):
    formats, rows, cols = WEIGHTS[name]
    rng = np.random.default_rng(seed)
    parts = [BlockTensor(f, random_blocks(rng, f, n, cols, 1 / np.sqrt(cols)), cols) for f, n in zip(formats, rows)]
    return fuse_rows(parts)


def upload(dev: Harness, w, interleave: bool = False):
    return device_qweight(dev.put(block_image(w, interleave)), w)


@pytest.mark.parametrize("name", sorted(WEIGHTS))
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("epilogue", ["rmsnorm", "residual_xn_rms", "silu_pairs"])
def test_block_gemv_and_gemm_match_numpy(dev, name, tokens, epilogue):
    if epilogue == "silu_pairs" and not silu_pairs_apply(name):
        pytest.skip("gate/up pairs: an even row count of one format")
    check_product(dev, name, tokens, epilogue)


def silu_pairs_apply(name: str) -> bool:
    formats, rows, _ = WEIGHTS[name]
    return len(formats) == 1 and rows[0] % 2 == 0


def check_tolerance(tokens: int, kernel: str) -> float:
    """Of the largest output: fp32 GEMVs and the fp16 tensor-core GEMV (x as hi + lo, ~2^-22) 1e-5; the dp4a
    layouts 3e-4 (x to 2^-15 of each 32-block's amax: up to ~1e-4 of the largest output on these weights); the
    int8 GEMMs 2e-3."""
    if "_hmma_" in kernel:
        return 1e-5
    if "_gemv_m" not in kernel:   # the GEMM (from block_kernels.MMA_MIN_TOKENS tokens)
        return 2e-3
    return 3e-4 if q4_gemv_variants.is_dp4a(q4_gemv_variants.parse(kernel)[2]) else 1e-5


def run_product(dev, w, tokens: int, epilogue: str, residual_kw: dict | None = None, **launch_kw):
    """gemv_launch of weight `w` (uploaded here) over random tokens with `epilogue` (rmsnorm, silu_pairs or
    residual_xn_rms), launch_kw passed on (variant=, dense=) -> (its weight on the device, the launch, numpy's
    result, the device's, and for the residual epilogue (xn, 1/rms, the norm weight) read back, else None)."""
    n, k = w.shape
    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    s = x @ w.dequantize().T
    qw = upload(dev, w, interleave=epilogue == "silu_pairs")
    xp = dev.put(x)
    if epilogue == "rmsnorm":
        inv_rms_in = (0.5 + rng.random(tokens)).astype(np.float32)
        y = dev.put(np.zeros((tokens, n), np.float32))
        launch = gemv_launch(dev.kernels, qw, xp, k, y, n, tokens, inv_rms_in=dev.put(inv_rms_in), **launch_kw)
        dev.run(launch)
        return qw, launch, s * inv_rms_in[:, None], dev.get(y, (tokens, n)), None
    if epilogue == "silu_pairs":
        half = n // 2
        y = dev.put(np.zeros((tokens, half), np.float32))
        launch = gemv_launch(dev.kernels, qw, xp, k, y, half, tokens, silu_pairs=True, **launch_kw)
        dev.run(launch)
        gate, up = s[:, :half], s[:, half:]
        return qw, launch, gate / (1 + np.exp(-gate)) * up, dev.get(y, (tokens, half)), None
    res = rng.standard_normal((tokens, n)).astype(np.float32)
    normw = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    y, xn, inv_rms = dev.put(res), dev.put(np.zeros((tokens, n), np.float32)), dev.put(np.zeros(tokens, np.float32))
    launch = gemv_launch(dev.kernels, qw, xp, k, y, n, tokens, res=y, normw_out=dev.put(normw), xn_out=xn,
                         inv_rms_out=inv_rms, eps=1e-6, **(residual_kw or {}), **launch_kw)
    dev.run(launch)
    return qw, launch, s + res, dev.get(y, (tokens, n)), (dev.get(xn, (tokens, n)), dev.get(inv_rms, (tokens,)), normw)


def check_product(dev, name: str, tokens: int, epilogue: str, variant: str | None = None) -> None:
    """gemv_launch (layout `variant`, default the chosen one) of weight `name` against numpy, with `epilogue`."""
    counter = dev.put(np.zeros(GEMV_COUNTER_BYTES // 4, np.uint32))
    _, launch, want, got, norms = run_product(dev, weight(name, seed=len(name) + tokens), tokens, epilogue,
                                              residual_kw={"counter": counter}, variant=variant)
    tol = check_tolerance(tokens, launch.name)
    if norms is not None:
        xn, inv_rms, normw = norms
        np.testing.assert_allclose(xn, got * normw, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(inv_rms, 1 / np.sqrt(np.mean(want * want, axis=1) + 1e-6), rtol=10 * tol)
        assert not dev.get(counter, (GEMV_COUNTER_BYTES // 4,)).any(), "tickets and sums reset for the next launch"
    assert np.abs(got - want).max() <= tol * np.abs(want).max(), (name, tokens, epilogue, variant)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K", "Q6_K"])
def test_block_embedding_rows_are_the_dequantized_rows(dev, fmt):
    cols = 256
    rng = np.random.default_rng(4)
    table = BlockTensor(fmt, random_blocks(rng, fmt, 50, cols, 0.02), cols)
    ids = np.array([49, 0, 7, 7], np.int32)
    normw = (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
    out, xn, inv_rms = (dev.put(np.zeros(n, np.float32)) for n in (4 * cols, 4 * cols, 4))
    qw = upload(dev, table)
    dev.run(dev.kernels.launch(embed_kernel(qw), (4,), (256,), "pppppppfi",
                               [qw.qs, qw.scales, dev.put(ids), out, xn, dev.put(normw), inv_rms, 1e-6, cols]))
    rows = table.dequantize_rows(ids)
    assert np.array_equal(dev.get(out, (4, cols)), rows)              # the values the CPU engine embeds
    np.testing.assert_allclose(dev.get(xn, (4, cols)), rows * normw, rtol=1e-6)
    np.testing.assert_allclose(dev.get(inv_rms, (4,)), 1 / np.sqrt(np.mean(rows * rows, axis=1) + 1e-6), rtol=1e-5)


def test_row_slices_of_a_two_format_weight(dev):
    """The split modes run runs of a fused QKV's rows (hybrid.py): a slice across the formats' boundary."""
    w = weight("Q4_K+Q6_K", seed=1)
    qw = upload(dev, w)
    x = np.random.default_rng(2).standard_normal((1, 256)).astype(np.float32)
    dense = w.dequantize()
    for lo, hi in ((0, 24), (24, 34), (20, 30), (5, 12)):
        part = qweight_rows(qw, lo, hi)
        y = dev.put(np.zeros(hi - lo, np.float32))
        dev.run(gemv_launch(dev.kernels, part, dev.put(x), 256, y, hi - lo, 1))
        want = x @ dense[lo:hi].T
        assert np.abs(dev.get(y, (1, hi - lo)) - want).max() <= 1e-5 * np.abs(want).max(), (lo, hi)


def test_the_block_launches_share_the_q8_contract():
    from kestrel_stream.cuda import block_kernels, kernels
    assert block_kernels.BLOCK_GEMV_SIGNATURE == kernels.GEMV_SIGNATURE + "ppi"
    assert block_kernels.GEMV_MAX_TOKENS == kernels.GEMV_MAX_TOKENS
