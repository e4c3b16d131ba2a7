"""Steps of 1..70 tokens on every block format: the kernel each token count gets (GEMV layouts up to 8,
the 16-token GEMM tile with K split up to 64, the 64-token tile beyond; a Q4_K or Q6_K weight of one format the fp16
tensor-core GEMV of 2..16 tokens) against numpy.

Each case runs on the emulated device (fake_block_kernels' twins: CI) and, marked `gpu`, on a real one
with the NVRTC-built kernels (`pytest -m gpu tests/test_block_steps.py`).  Reference: float32
x @ dequant(W).T then the epilogues, within check_tolerance of test_block_kernels.  K is a few dozen
stages, so the GEMM launches split K (the scratch is gpu mode's: mma_variants.scratch_bound), and the
row counts leave partial row tiles.
"""
from __future__ import annotations

import numpy as np
import pytest

from bench.synthetic import random_blocks
from kestrel_stream.cuda import block_kernels, mma_variants
from kestrel_stream.cuda.device_weight import QWeight
from kestrel_stream.cuda.hmma_launch import q4k_hmma_serves
from kestrel_stream.cuda.kernels import GEMV_COUNTER_BYTES, gemv_launch
from kestrel_stream.model.quant4 import BlockTensor, fuse_rows
from test_block_kernels import DEVICES, Harness, check_tolerance, upload

# (format(s), rows per part, K): K of several 128-wide stages (Q4_0's not a multiple of 128)
STEP_WEIGHTS = {"Q4_0": (("Q4_0",), (38,), 1056), "Q4_K": (("Q4_K",), (70,), 2048),
                "Q6_K": (("Q6_K",), (9,), 1536), "Q4_K+Q6_K": (("Q4_K", "Q6_K"), (24, 10), 1280)}
STEP_TOKENS = tuple(range(1, 71))
MAX_TOKENS = 512      # the scratch of an executor for steps of this many tokens


@pytest.fixture(scope="module", params=DEVICES)
def dev(request):
    mp = pytest.MonkeyPatch()
    h = Harness(request.param, mp, arena_bytes=256 << 20)     # the model-shaped weights stay for the module
    partial_floats, ticket_count = mma_variants.scratch_bound(MAX_TOKENS)
    partials = h.arena.alloc(4 * partial_floats)
    tickets = h.put(np.zeros(ticket_count, np.uint32))
    h.scratch = mma_variants.SplitScratch(partials, partial_floats, tickets, ticket_count)
    h.ticket_count = ticket_count
    h.weights = {}
    yield h
    h.arena.release()
    mp.undo()


@pytest.fixture(autouse=True)
def _free_per_test(request):
    """A test's buffers go back to the module's arena after it (the weights and scratch stay)."""
    if "dev" not in request.fixturenames:
        yield
        return
    h = request.getfixturevalue("dev")
    put = h.put
    taken = []

    def tracked(array):
        ptr = put(array)
        taken.append(ptr)
        return ptr
    h.put = tracked
    yield
    h.put = put
    for ptr in taken:
        h.arena.free(ptr)


def step_weight(dev, name: str, interleave: bool):
    key = (name, interleave)
    if key not in dev.weights:
        formats, rows, cols = STEP_WEIGHTS[name]
        rng = np.random.default_rng(len(name))
        parts = [BlockTensor(f, random_blocks(rng, f, n, cols, 1 / np.sqrt(cols)), cols) for f, n in zip(formats, rows)]
        w = fuse_rows(parts)
        put, dev.put = dev.put, Harness.put.__get__(dev)      # kept for the module
        try:
            dev.weights[key] = (w, w.dequantize(), upload(dev, w, interleave))
        finally:
            dev.put = put
    return dev.weights[key]


@pytest.mark.parametrize("name", sorted(STEP_WEIGHTS))
@pytest.mark.parametrize("tokens", STEP_TOKENS)
def test_a_step_of_k_tokens_matches_numpy(dev, name, tokens):
    """o/down's contract: residual, the next norm's xn and 1/rms; the tickets and scratch reset after."""
    w, dense, qw = step_weight(dev, name, interleave=False)
    n, k = w.shape
    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    res = rng.standard_normal((tokens, n)).astype(np.float32)
    normw = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    counter = dev.put(np.zeros(GEMV_COUNTER_BYTES // 4, np.uint32))
    y, xn, inv_rms = dev.put(res), dev.put(np.zeros((tokens, n), np.float32)), dev.put(np.zeros(tokens, np.float32))
    launch = gemv_launch(dev.kernels, qw, dev.put(x), k, y, n, tokens, res=y, normw_out=dev.put(normw), xn_out=xn,
                         inv_rms_out=inv_rms, counter=counter, eps=1e-6, split_scratch=dev.scratch)
    dev.run(launch)
    if q4k_hmma_serves(qw, tokens, None):
        assert launch.name.startswith(("q4k_hmma_t", "q6k_hmma_t")), launch.name
    elif tokens > block_kernels.GEMV_MAX_TOKENS:
        assert launch.name.startswith(f"{qw.fmt.lower()}"), launch.name
        assert ("_mma16" in launch.name) == (tokens <= block_kernels.SMALL_TILE_MAX_TOKENS), launch.name
    want = x @ dense.T + res
    got = dev.get(y, (tokens, n))
    tol = check_tolerance(tokens, launch.name)
    assert np.abs(got - want).max() <= tol * np.abs(want).max(), (name, tokens, launch.name, launch.grid)
    np.testing.assert_allclose(dev.get(xn, (tokens, n)), got * normw, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dev.get(inv_rms, (tokens,)), 1 / np.sqrt(np.mean(want * want, axis=1) + 1e-6),
                               rtol=10 * tol)
    assert not dev.get(counter, (GEMV_COUNTER_BYTES // 4,)).any(), "ticket and sums reset for the next launch"
    assert not dev.get(dev.scratch.tickets, (dev.ticket_count,)).any(), "split tickets reset for the next launch"


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K"])
@pytest.mark.parametrize("tokens", (2, 8, 9, 16, 17, 33, 64, 65, 70))
def test_gate_up_pairs_of_a_step_match_numpy(dev, name, tokens):
    w, dense, qw = step_weight(dev, name, interleave=True)
    n, k = w.shape
    x = np.random.default_rng(tokens).standard_normal((tokens, k)).astype(np.float32)
    inv_rms_in = (0.5 + np.random.default_rng(tokens + 1).random(tokens)).astype(np.float32)
    y = dev.put(np.zeros((tokens, n // 2), np.float32))
    launch = gemv_launch(dev.kernels, qw, dev.put(x), k, y, n // 2, tokens, silu_pairs=True,
                         inv_rms_in=dev.put(inv_rms_in), split_scratch=dev.scratch)
    dev.run(launch)
    s = (x @ dense.T) * inv_rms_in[:, None]
    gate, up = s[:, :n // 2], s[:, n // 2:]
    want, got = gate / (1 + np.exp(-gate)) * up, dev.get(y, (tokens, n // 2))
    assert np.abs(got - want).max() <= check_tolerance(tokens, launch.name) * np.abs(want).max(), (name, tokens)


@pytest.mark.parametrize("variant", ["mma16", "mma16s1", "mma16s2", "mma16s5", "mma", "mmas3"])
@pytest.mark.parametrize("tokens", (1, 5, 16, 17, 70))
def test_every_tile_and_split_serves_any_token_count(dev, variant, tokens):
    """Forced tiles and split counts (what the bench compares) give the same products."""
    w, dense, qw = step_weight(dev, "Q4_K+Q6_K", interleave=False)
    n, k = w.shape
    x = np.random.default_rng(tokens).standard_normal((tokens, k)).astype(np.float32)
    y = dev.put(np.zeros((tokens, n), np.float32))
    launch = gemv_launch(dev.kernels, qw, dev.put(x), k, y, n, tokens, variant=variant, split_scratch=dev.scratch)
    tile, splits = block_kernels.parse_mma_variant(variant)
    assert launch.grid[2] == (splits or launch.grid[2]) and launch.grid[1] == -(-tokens // block_kernels.MMA_TILES[tile].tokens)
    dev.run(launch)
    want = x @ dense.T
    assert np.abs(dev.get(y, (tokens, n)) - want).max() <= 2e-3 * np.abs(want).max(), (variant, tokens)


def test_few_row_tiles_split_k_to_fill_the_gpu():
    """A 1.5B model's down (1,536 rows, K 8,960) at 11 tokens: 24 row tiles become hundreds of blocks,
    each a short run of K; a wide gate_up is left whole where its tiles fill the SMs."""
    scratch = mma_variants.SplitScratch(1 << 40, mma_variants.scratch_bound(MAX_TOKENS)[0], 1 << 40,
                                        mma_variants.scratch_bound(MAX_TOKENS)[1])
    down = QWeight(0, 0, 1536, 8960, "Q4_K")
    splits = block_kernels.mma_splits(down, 11, "mma16", 132, scratch)
    assert splits >= 8 and block_kernels.split_is_valid(8960, splits)
    assert 24 * splits >= 2 * 132
    gate_up = QWeight(0, 0, 2 * 151936, 1536, "Q4_K")
    assert block_kernels.mma_splits(gate_up, 64, "mma16", 132, scratch) == 1
    assert block_kernels.mma_splits(down, 11, "mma16", 132, None) == 1     # no scratch: unsplit
    small = mma_variants.SplitScratch(1 << 40, 1024 * 24 * 3, 1 << 40, 24)
    assert block_kernels.mma_splits(down, 11, "mma16", 132, small) <= 3     # within the scratch it has


def test_the_16_token_tile_serves_up_to_64_tokens():
    assert [block_kernels.mma_tile(t) for t in (9, 16, 17, 64, 65, 512)] == ["mma16"] * 4 + ["mma"] * 2
    with pytest.raises(ValueError):
        block_kernels.parse_mma_variant("mma32")


def test_the_gemm_can_take_over_from_fewer_tokens(monkeypatch):
    """KESTREL_BLOCK_MMA_MIN_TOKENS moves the GEMV/GEMM switch down (the bench compares both sides)."""
    import fake_cuda
    from kestrel_stream.options import Options
    fake_cuda.install(monkeypatch)
    from kestrel_stream.cuda import driver, kernels
    ks = kernels.KernelSet(driver.Device(0), Options.from_env({"KESTREL_BLOCK_MMA_MIN_TOKENS": "4"}))
    w = QWeight(1 << 20, 1 << 21, 640, 1024, "Q4_K")
    names = [gemv_launch(ks, w, 1 << 22, 1024, 1 << 23, 640, t).name for t in (1, 3, 4, 8, 9)]
    assert names[:2] == [n for n in names[:2] if "_gemv_m" in n] and all(n == "q4_k_mma16" for n in names[2:])
    with pytest.raises(ValueError, match="2..9"):
        Options.from_env({"KESTREL_BLOCK_MMA_MIN_TOKENS": "12"})


# a 1.5B model's down (Q4_K or Q6_K in a Q4_K_M file) and QKV (Q4_K with Q6_K v rows): the GEMM's K split many
# ways; its gate (8960 x 1536, six super-blocks a row) on the fp16 tensor-core GEMV
MODEL_SHAPES = [("Q4_K", (1536,), 8960, 11), ("Q4_K", (8960,), 1536, 11), ("Q6_K", (1536,), 8960, 64),
                ("Q4_K+Q6_K", (1792, 256), 1536, 33), ("Q4_0", (896,), 4864, 70)]


@pytest.mark.parametrize("fmt,rows,cols,tokens", MODEL_SHAPES)
def test_model_shaped_steps_match_numpy(dev, fmt, rows, cols, tokens):
    formats = tuple(fmt.split("+"))
    rng = np.random.default_rng(cols + tokens)
    w = fuse_rows([BlockTensor(f, random_blocks(rng, f, n, cols, 1 / np.sqrt(cols)), cols)
                   for f, n in zip(formats, rows)])
    qw = upload(dev, w)
    n, k = w.shape
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    y = dev.put(np.zeros((tokens, n), np.float32))
    launch = gemv_launch(dev.kernels, qw, dev.put(x), k, y, n, tokens, split_scratch=dev.scratch)
    if q4k_hmma_serves(qw, tokens, None):
        assert launch.name.startswith("q4k_hmma_t16_"), launch.name
    else:
        assert launch.grid[2] > 1, "these shapes split K"
    dev.run(launch)
    want = x @ w.dequantize().T
    tol = check_tolerance(tokens, launch.name)
    assert np.abs(dev.get(y, (tokens, n)) - want).max() <= tol * np.abs(want).max(), (fmt, tokens, launch.grid)
