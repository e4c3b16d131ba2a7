"""The one-token dp4a GEMV layouts (dTrRuU, kernels_ptx/q4_gemv_dp4a.cuh) beside the float ones.

Every d layout (Q4_0, Q4_K, Q6_K and the Q4_K + Q6_K stack on dp4a) also runs test_block_gemv_variants'
awkward weights and epilogues against numpy (within
test_block_kernels.check_tolerance).  Here: the twin's x quantisation and integer path, the d layouts
against the plain p/t layouts and against the twin's arithmetic (marked `gpu` on a real device: there
the integer path is checked to fp32 rounding, not to the quantisation's tolerance), blocks that run many
row tiles (the grid capped with a one-SM device) with the ticketed epilogues, and the kernels in the cubin.
"""
from __future__ import annotations

import numpy as np
import pytest

import fake_dp4a
from kestrel_stream.cuda import q4_gemv_variants as qv
from kestrel_stream.cuda.kernels import GEMV_COUNTER_BYTES, gemv_launch
from quant4_reference import group_form
from test_block_kernels import DEVICES, WEIGHTS, Harness, upload, weight

D_LAYOUTS = [name for name in qv.M1_VARIANTS if qv.is_dp4a(name)]
PLAIN = "t64r8u1"


@pytest.fixture(params=DEVICES)
def dev(request, monkeypatch):
    h = Harness(request.param, monkeypatch)
    yield h
    h.arena.release()


def test_x_quantisation_keeps_fifteen_bits():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(160) * 10.0 ** rng.uniform(-3, 3, 160)).astype(np.float32)
    x[64:96] = 0.0                                            # an all-zero block: d = 0, no division
    hi, lo, unit, sums, sums16 = fake_dp4a.quantize_x(x)
    assert hi.shape == (6, 32) and np.abs(hi).max() <= 127 and np.abs(lo).max() <= 64
    assert not hi[2:3].any() and not lo[2:3].any() and unit[2] == 0 and sums[2] == 0
    assert not hi[5].any() and unit[5] == 0                   # the padding of Q4_0's half D-unit
    blocks = np.zeros(192, np.float32)
    blocks[:160] = x
    blocks = blocks.reshape(-1, 32)
    back = (128 * hi + lo) * unit[:, None].astype(np.float64)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    assert (np.abs(back - blocks) <= amax / 32512 + 1e-30).all()           # d / 256, d = amax / 127
    np.testing.assert_allclose(sums, back.sum(axis=1), rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(sums16, back.reshape(-1, 16).sum(axis=1), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K", "Q4_K-big", "Q6_K"])
def test_twin_is_the_weight_times_quantised_x(name):
    """The integer path is W times the quantised x to fp32 rounding, and x's quantisation alone is what
    separates it from the float product."""
    w = weight(name, seed=2)
    n, k = w.shape
    x = np.random.default_rng(3).standard_normal(k).astype(np.float32)
    hi, lo, unit, _sums, _sums16 = fake_dp4a.quantize_x(x)
    xq = ((128 * hi + lo) * unit[:, None].astype(np.float64)).reshape(-1)[:k]
    dense = w.dequantize().astype(np.float64)
    got = fake_dp4a.dp4a_products(w.fmt, w.blocks, x, k)
    scale = np.abs(dense @ x).max()
    assert np.abs(got - dense @ xq).max() <= 1e-6 * scale
    error = np.abs(got - dense @ x).max()
    assert 1e-7 * scale < error <= 3e-4 * scale


@pytest.mark.parametrize("layout", D_LAYOUTS)
@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_dp4a_layouts_match_the_plain_layouts(dev, layout, name):
    """A d layout's product beside t64r8u1's (fp32) within the quantisation's tolerance, and beside the
    twin's arithmetic on the same x to fp32 rounding (1e-5: sums in another order, the mins cancelling)."""
    w = weight(name, seed=7)
    n, k = w.shape
    x = np.random.default_rng(8).standard_normal((1, k)).astype(np.float32)
    qw, xp = upload(dev, w), dev.put(x)

    def product(variant: str) -> np.ndarray:
        y = dev.put(np.zeros((1, n), np.float32))
        dev.run(gemv_launch(dev.kernels, qw, xp, k, y, n, 1, variant=variant))
        return dev.get(y, (1, n))[0]

    plain, got = product(PLAIN), product(layout)
    scale = np.abs(plain).max()
    assert np.abs(got - plain).max() <= 3e-4 * scale, (name, layout)
    twin = np.concatenate([fake_dp4a.dp4a_products(p.fmt, p.blocks, x[0], k) for p in _parts(w)])
    assert np.abs(got - twin).max() <= 1e-5 * scale, (name, layout)   # fp32 sums in another order


def _parts(w) -> tuple:
    """The one-format BlockTensors of a weight (a RowStack's head and tail), rows in order."""
    return w.parts if len(w.formats) > 1 else (w,)


@pytest.mark.parametrize("layout", D_LAYOUTS)
@pytest.mark.parametrize("epilogue", ["residual_xn_rms", "silu_pairs"])
def test_blocks_of_many_tiles_keep_the_epilogues(dev, layout, epilogue):
    """One SM: the grid is blocks_per_sm blocks, each running every gridDim-th tile of 258 rows (17 to 65
    tiles), each tile's epilogue taking a ticket for the last one's 1/rms."""
    w = weight("Q4_K-big", seed=4)
    n, k = w.shape
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, k)).astype(np.float32)
    s = (x.astype(np.float64) @ w.dequantize().T.astype(np.float64)).astype(np.float32)
    dev.kernels.device.sm_count = 1
    layout_shape = qv.M1_VARIANTS[layout]
    counter = dev.put(np.zeros(GEMV_COUNTER_BYTES // 4, np.uint32))
    if epilogue == "silu_pairs":
        qw = upload(dev, w, interleave=True)
        y = dev.put(np.zeros((1, n // 2), np.float32))
        launch = gemv_launch(dev.kernels, qw, dev.put(x), k, y, n // 2, 1, silu_pairs=True, variant=layout)
        dev.run(launch)
        gate, up = s[:, :n // 2], s[:, n // 2:]
        want, got = gate / (1 + np.exp(-gate)) * up, dev.get(y, (1, n // 2))
    else:
        qw = upload(dev, w)
        res = rng.standard_normal((1, n)).astype(np.float32)
        normw = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        xn, inv_rms = dev.put(np.zeros((1, n), np.float32)), dev.put(np.zeros(1, np.float32))
        for _ in range(2):             # twice: the first launch leaves tickets and sums reset for the second
            y = dev.put(res)
            launch = gemv_launch(dev.kernels, qw, dev.put(x), k, y, n, 1, res=y, normw_out=dev.put(normw),
                                 xn_out=xn, inv_rms_out=inv_rms, counter=counter, variant=layout)
            dev.run(launch)
        want, got = s + res, dev.get(y, (1, n))
        np.testing.assert_allclose(dev.get(xn, (1, n)), got * normw, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(dev.get(inv_rms, (1,)), 1 / np.sqrt(np.mean(want * want) + 1e-6), rtol=3e-3)
        assert not dev.get(counter, (GEMV_COUNTER_BYTES // 4,)).any()
    tiles = -(-n // layout_shape.rows)
    assert launch.grid[0] == min(tiles, layout_shape.blocks_per_sm) < tiles
    assert np.abs(got - want).max() <= 3e-4 * np.abs(want).max(), (layout, epilogue)


def test_the_d_kernels_are_in_the_cubin():
    """Every kernel name the table and choose can give a d layout is a symbol of q4_gemv_m1d.cu's CUBIN
    (sm_90; the disk cache serves it when the kernel set was built before)."""
    from kernels_ptx.build import compile_cubin
    cubin, _log = compile_cubin("q4_gemv_m1d.cu", "sm_90")
    for layout in D_LAYOUTS:
        for code, silu in qv.TILED_CODES:
            name = qv.kernel_name(code, 1, layout, silu)
            assert name.encode() + b"\0" in cubin, name
            assert qv.parse(name) == (code, 1, layout, silu)


def test_shared_bytes_and_grid_of_the_d_layouts():
    v = qv.M1_VARIANTS["d64r4u1"]
    assert qv.dp4a_shared_bytes("q4_k", 4096) == 64 * 160 and qv.dp4a_shared_bytes("q4_0", 160) == 3 * 160
    assert qv.dp4a_shared_bytes("q4_k", 12288) < 48 * 1024          # every model shape without the opt-in
    assert qv.grid_blocks(v, 151936, 0, 132) == 8 * 132 and qv.grid_blocks(v, 37, 0, 132) == 10
    assert qv.grid_blocks(qv.M1_VARIANTS["p64r8u1"], 151936, 0, 132) == 151936 // 8   # one tile a block
    levels, s, o = group_form(weight("Q4_K", seed=0).blocks, "Q4_K", 768)
    assert levels.min() >= 0 and levels.max() <= 15 and (s[:, 0::2] == s[:, 1::2]).all()   # a scale per 32


def test_bench_sweep_restricted_to_the_d_layouts(monkeypatch):
    """bench/block_gemv.py --tokens 1 --layouts d: the d layouts, the original kernel and the default."""
    import fake_cuda
    from bench import block_gemv
    fake_cuda.install(monkeypatch)
    from kestrel_stream.cuda import driver, kernels
    tiny = {"tiny": {"qkv": (40, 256), "o": (24, 256), "gate_up": (48, 256), "down": (24, 512),
                     "lm_head": (70, 256), "qkv_v": 16}}
    arena, stream = driver.Arena(64 << 20), driver.Stream()
    rows = block_gemv.run(kernels.KernelSet(driver.Device(0)), arena, stream, tiny, ("Q4_K", "Q4_K+Q6_K"), [1],
                          np.random.default_rng(0), repeats=2, layouts=["d"])
    arena.release()
    for projection in block_gemv.EPILOGUES:
        timed = {r["variant"] for r in rows if r["projection"] == projection and r["format"] == "Q4_K"}
        chosen = qv.choose("q4_k", "Q4_K", *tiny["tiny"][projection], 1, projection == "gate_up")
        assert timed == {"legacy", chosen, *D_LAYOUTS}, (projection, timed)
    assert {r["variant"] for r in rows if r["format"] == "Q4_K+Q6_K"} >= set(D_LAYOUTS)
    _lines, measured = block_gemv.winners(rows)
    assert {key[1] for key in measured} == {1}
