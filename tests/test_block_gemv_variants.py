"""Every block-format GEMV layout (cuda/q4_gemv_variants.py) against numpy, and the layouts' bookkeeping.

Each layout runs test_block_kernels' awkward weights (row counts that are no multiple of any layout's
rows, K of one to eight super-blocks, a Q4_K + Q6_K stack) with every epilogue, on the emulated
device (the twin checks the launch's threads and blocks against the layout named in the kernel) and,
marked `gpu`, on a real one.
"""
from __future__ import annotations

import re

import pytest

from kernels_ptx.build import source_dir
from kestrel_stream.cuda import q4_gemv_variants as qv
from test_block_kernels import DEVICES, WEIGHTS, Harness, check_product, silu_pairs_apply

EPILOGUES = ("rmsnorm", "residual_xn_rms", "silu_pairs")
# (layout, tokens): each one-token layout at 1; each 2..8-token layout at M = 2 and 8 full and M = 4 with a
# token left out (3); the original kernel at 1 and 5
CASES = ([(v, 1) for v in qv.M1_VARIANTS] + [(v, t) for v in qv.MN_VARIANTS for t in (2, 3, 8)]
         + [(qv.LEGACY, 1), (qv.LEGACY, 5)])


@pytest.fixture(params=DEVICES)
def dev(request, monkeypatch):
    h = Harness(request.param, monkeypatch)
    yield h
    h.arena.release()


@pytest.mark.parametrize("name", sorted(WEIGHTS))
@pytest.mark.parametrize("variant,tokens", CASES, ids=[f"{v or 'legacy'}-{t}" for v, t in CASES])
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_every_layout_matches_numpy(dev, name, variant, tokens, epilogue):
    if epilogue == "silu_pairs" and not silu_pairs_apply(name):
        pytest.skip("gate/up pairs: an even row count of one format")
    check_product(dev, name, tokens, epilogue, variant=variant)


@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_prefetching_layouts_give_the_plain_layouts_floats(dev, name):
    """A p layout sums in its t twin's order and its subnormal Q4_K levels are exact: the same floats
    bit for bit, x spanning six decades (what the scaling by 2^96 must survive)."""
    import numpy as np

    from kestrel_stream.cuda.kernels import gemv_launch
    from test_block_kernels import upload, weight
    w = weight(name, seed=3)
    n, k = w.shape
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(k) * 10.0 ** rng.uniform(-3, 3, k)).astype(np.float32)[None, :]
    qw, xp = upload(dev, w), dev.put(x)

    def product(variant: str) -> np.ndarray:
        y = dev.put(np.zeros((1, n), np.float32))
        dev.run(gemv_launch(dev.kernels, qw, xp, k, y, n, 1, variant=variant))
        return dev.get(y, (1, n))

    twins = [v for v in qv.M1_VARIANTS if v[0] == "p" and "t" + v[1:] in qv.M1_VARIANTS]
    assert len(twins) >= 3
    out = {v: product(v) for v in twins}
    for v in twins:
        np.testing.assert_array_equal(out[v], product("t" + v[1:]), err_msg=f"{name} {v}")
    s = x @ w.dequantize().T
    assert np.abs(out[twins[0]] - s).max() <= 1e-5 * np.abs(s).max()


def test_the_layouts_are_the_kernels_that_exist():
    """Each Python layout is instantiated in the .cu with the same threads, rows and unroll (the emulated
    device cannot tell a missing kernel from a present one)."""
    m1 = (source_dir() / "q4_gemv_m1.cu").read_text()
    m1d = (source_dir() / "q4_gemv_m1d.cu").read_text()
    mn = {"o": (source_dir() / "q4_gemv_mn.cu").read_text(), "g": (source_dir() / "q4_gemv_mg.cu").read_text()}
    for name, v in qv.M1_VARIANTS.items():       # t: plain, p: prefetching (DEFINE_Q4_PREFETCH_SET), d: dp4a
        if name[0] == "p":
            assert f"DEFINE_Q4_PREFETCH_SET(1, {v.threads}, {v.rows}, {v.unroll}, {name})" in m1, name
        elif name[0] == "d":
            assert (f"DEFINE_Q4_DP4A_SET({v.threads}, {v.rows}, {v.unroll}, {v.groups}, {v.blocks_per_sm}, {name})"
                    in m1d), name            # the grid's cap: the blocks the kernel's registers allow per SM
            assert v.blocks_per_sm > 0 and (v.groups > 1) == name.endswith(f"g{v.groups}"), name
            assert v.threads % (32 * v.groups) == 0 and v.rows % (2 * v.groups) == 0, name   # warps, pairs per group
        else:
            assert f"DEFINE_Q4_TILED_SET(1, {v.threads}, {v.rows}, {v.unroll}, false, {name})" in m1, name
    for name, v in qv.MN_VARIANTS.items():       # o: row-outer (true), g: x shared by the rows (false)
        row_outer = "true" if name[0] == "o" else "false"
        assert f"DEFINE_Q4_TILED_SET(M, {v.threads}, {v.rows}, {v.unroll}, {row_outer}, {name})" in mn[name[0]], name
    assert len(re.findall(r"^\s*DEFINE_Q4_(?:TILED|PREFETCH)_SET\(1,", m1, re.M)) + \
        len(re.findall(r"^DEFINE_Q4_DP4A_SET\(", m1d, re.M)) == len(qv.M1_VARIANTS)
    dp4a = (source_dir() / "q4_gemv_dp4a.cuh").read_text()
    built_d = set(re.findall(r"(q4_0|q4_k_q6_k|q4_k|q6_k)_gemv_m1_##SUFFIX(##_silu)?\)", dp4a))
    assert {(code, bool(silu)) for code, silu in built_d} == qv.TILED_CODES
    assert {name[0] for name in qv.M1_VARIANTS} == {"t", "p", "d"} and {name[0] for name in qv.MN_VARIANTS} == {"g", "o"}
    assert sum(len(re.findall(r"DEFINE_Q4_TILED_SET\(M,", text)) for text in mn.values()) == len(qv.MN_VARIANTS)
    assert re.findall(r"^DEFINE_Q4_TILED_MN\((\d)\)", mn["o"], re.M) == ["2", "4", "8"]
    assert re.findall(r"^DEFINE_Q4_TILED_MG\((\d)\)", mn["g"], re.M) == ["2", "4", "8"]
    tiled = (source_dir() / "q4_gemv_tiled.cuh").read_text()
    built = set(re.findall(r"(q4_0|q4_k_q6_k|q4_k|q6_k)_gemv_m##M##_##SUFFIX(##_silu)?\)", tiled))
    assert {(code, bool(silu)) for code, silu in built} == qv.TILED_CODES
    for v in [*qv.M1_VARIANTS.values(), *qv.MN_VARIANTS.values()]:
        assert v.rows % 2 == 0 and v.threads % 32 == 0, v    # (gate, up) pairs stay in one block; whole warps


@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 8])
def test_choose_names_a_kernel_for_every_model_shape(tokens):
    shapes = [(4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144), (151936, 2048), (6144, 4096),
              (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)]
    for code, fmt in (("q4_0", "Q4_0"), ("q4_k", "Q4_K"), ("q6_k", "Q6_K"), ("q4_k_q6_k", "Q4_K")):
        for silu in (False, True):
            for rows, cols in shapes:
                name = qv.choose(code, fmt, rows, cols, tokens, silu)
                m = qv.gemv_m(tokens)
                assert name in qv.variants(m)
                assert qv.parse(qv.kernel_name(code, m, name, silu)) == (code, m, name, silu)
                assert name != qv.LEGACY or not qv.has_tiled(code, silu)


def test_one_token_rule_covers_rows_in_whole_passes(monkeypatch):
    monkeypatch.setattr(qv, "MEASURED", {})                 # the rule alone, not the measured table
    # K = 2048 of Q4_K: 64 units a row, one pass of 32 x 2; K = 6144: 192 units, 64 x 3; K = 12288: 128 x 3
    assert qv.choose("q4_k", "Q4_K", 4096, 2048, 1) == "t32r4u2"
    assert qv.choose("q4_k", "Q4_K", 2048, 6144, 1) == "t64r4u3"
    assert qv.choose("q4_k", "Q4_K", 4096, 12288, 1) == "t128r4u3"
    assert qv.choose("q4_k", "Q4_K", 151936, 2048, 1) == "t32r4u2"
    assert qv.choose("q6_k", "Q6_K", 4096, 2048, 1, silu=True) == qv.LEGACY     # no tiled Q6_K pairs
    assert qv.choose("q4_k", "Q4_K", 4096, 2048, 1, forced="t64r8u1") == "t64r8u1"
    assert qv.choose("q6_k", "Q6_K", 4096, 2048, 1, silu=True, forced="t64r8u1") == qv.LEGACY
    with pytest.raises(AssertionError, match="no block-format GEMV layout"):
        qv.choose("q4_k", "Q4_K", 4096, 2048, 2, forced="t64r8u1")


def test_measured_table_wins(monkeypatch):
    monkeypatch.setitem(qv.MEASURED, ("q4_k", 1, 4096, 2048), "t128r4u3")
    assert qv.choose("q4_k", "Q4_K", 4096, 2048, 1) == "t128r4u3"
    assert qv.choose("q4_k", "Q4_K", 4096, 2048, 1, forced="") == ""


def test_bench_times_every_layout_and_names_the_winners(monkeypatch):
    """bench/block_gemv.py end to end on the emulated device, at shapes of a few blocks."""
    import numpy as np

    import fake_cuda
    from bench import block_gemv
    fake_cuda.install(monkeypatch)
    from kestrel_stream.cuda import driver, kernels
    tiny = {"tiny": {"qkv": (40, 256), "o": (24, 256), "gate_up": (48, 256), "down": (24, 512),
                     "lm_head": (70, 256), "qkv_v": 16}}
    arena, stream = driver.Arena(64 << 20), driver.Stream()
    rows = block_gemv.run(kernels.KernelSet(driver.Device(0)), arena, stream, tiny, block_gemv.FORMATS, [1, 3],
                          np.random.default_rng(0), repeats=2)
    arena.release()
    timed = {(r["projection"], r["format"], r["M"], r["variant"]) for r in rows}
    for projection in block_gemv.EPILOGUES:
        for fmt in ("Q4_K", "Q6_K", "Q4_0", "Q8_0"):
            assert (projection, fmt, 1, "legacy" if fmt != "Q8_0" else "default") in timed
        for variant in qv.M1_VARIANTS:
            assert (projection, "Q4_K", 1, variant) in timed
        for variant in qv.MN_VARIANTS:
            assert (projection, "Q4_0", 3, variant) in timed
    assert ("qkv", "Q4_K+Q6_K", 1, "t32r4u2") in timed and ("o", "Q4_K+Q6_K", 1, "legacy") not in timed
    assert {r["epilogue"] for r in rows if r["projection"] == "gate_up" and r["format"] == "Q4_K"} == {"silu_pairs"}
    lines, measured = block_gemv.winners(rows)
    assert len(lines) == len({(r["projection"], r["format"], r["M"]) for r in rows if r["format"] != "Q8_0"})
    assert {key[1] for key in measured} == {1}                    # 3 tokens run M = 4: not a table entry
    for (code, m, n, k), variant in measured.items():
        assert qv.parse(qv.kernel_name(code, m, variant, False))[2] == variant
    estimates = block_gemv.mix_estimates(rows)       # a Q4_K_M step's GEMVs per M: legacy, default, fastest
    assert [line.split(" M=")[1].split(":")[0] for line in estimates] == ["1", "3"]


def test_kestrel_gemv_block_forces_a_layout_where_it_fits(monkeypatch):
    """KESTREL_GEMV_BLOCK="" runs the first kernel everywhere (the A/B switch); a one-token layout
    leaves 2..8 tokens to the rule; a bad name fails naming the variable."""
    import numpy as np

    from kestrel_stream.options import Options
    from test_block_kernels import upload, weight
    h = Harness("emulated", monkeypatch)
    from kestrel_stream.cuda import kernels
    qw = upload(h, weight("Q4_K", seed=0))
    x, y = h.put(np.zeros((8, 768), np.float32)), h.put(np.zeros((8, 70), np.float32))
    names = {}
    for value in ("", "t64r8u1"):
        kernel_set = kernels.KernelSet(h.device, Options.from_env({"KESTREL_GEMV_BLOCK": value}))
        names[value] = [kernels.gemv_launch(kernel_set, qw, x, 768, y, 70, t).name for t in (1, 4)]
    h.arena.release()
    assert names[""] == ["q4_k_gemv_m1", "q4_k_gemv_m4"]
    assert names["t64r8u1"] == ["q4_k_gemv_m1_t64r8u1", "q4_k_gemv_m4_g64r4u1"]
    with pytest.raises(ValueError, match="KESTREL_GEMV_BLOCK='w7'"):
        Options.from_env({"KESTREL_GEMV_BLOCK": "w7"})
