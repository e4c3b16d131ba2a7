"""Native host kernels against their numpy twins and the float reference, with the widest ISA and
with each forced fallback.  The library's build, fallbacks, cache and thread pool: test_native_library.py."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from bench.synthetic import random_blocks
from kestrel_stream import native
from kestrel_stream.model.quant import quantize
from kestrel_stream.model.quant4 import BlockTensor
from kestrel_stream.native import twins
from kestrel_stream.options import HOST_ISAS, Options
from kestrel_stream.run import host

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")

# K not a multiple of 256 where the format allows it; N odd
SHAPES = {"Q8_0": [(67, 800), (5, 96)], "Q4_0": [(67, 800), (5, 96)], "Q4_K": [(67, 768), (3, 256)],
          "Q6_K": [(67, 768), (3, 256)]}
# 1, 2, 5: a dot product per row and token; 6 (the first in lanes), 7, 17, 64: with VNNI, 16 tokens in lanes
# (partial groups too; host_kernels.c, ks_lanes_min_tokens)
TOKENS = (1, 2, 5, 6, 7, 17, 64)
FORMATS_ORDER = ("Q8_0", "Q4_0", "Q4_K", "Q6_K")

@pytest.fixture(scope="module")
def kernels():
    return native.load()


def isas(kernels):
    return [kernels.with_isa(isa) for isa in kernels.supported]


def make_weight(rng, fmt, n, k):
    """(the kernel call, the twin call, the float weight) of a random weight in `fmt`."""
    if fmt == "Q8_0":
        w = quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.02)
        return (lambda kern, x: kern.matmul_q8_0(x, w.qs, w.scales),
                lambda x: twins.matmul_q8_0(x, w.qs, w.scales), w.dequantize())
    blocks = random_blocks(rng, fmt, n, k, 0.02)
    if fmt == "Q6_K":           # every int8 scale, negative ones too
        blocks.reshape(n, k // 256, 210)[:, :, 192:208] = rng.integers(0, 256, (n, k // 256, 16), dtype=np.uint8)
    w = BlockTensor(fmt, blocks, k)
    return (lambda kern, x: kern.matmul_blocks(x, fmt, w.blocks, k),
            lambda x: twins.matmul_blocks(x, fmt, w.blocks, k), w.dequantize())


def assert_formats_match_twin(kerns, rng, shape: int, tokens) -> None:
    """Every format's matmul on each of `kerns` (HostKernels) against the twin, at SHAPES[fmt][shape] and each
    token count (the builds' tests: another -march, the portable C)."""
    for fmt in FORMATS_ORDER:
        n, k = SHAPES[fmt][shape]
        call, twin, _ = make_weight(rng, fmt, n, k)
        for t in tokens:
            x = rng.standard_normal((t, k)).astype(np.float32)
            expect = twin(x)
            for kern in kerns:
                np.testing.assert_allclose(call(kern, x), expect, rtol=0, atol=2e-6 * np.abs(expect).max(),
                                           err_msg=f"{fmt} {kern.isa} T={t}")


def test_options_name_the_same_isas_and_force_one():
    assert HOST_ISAS == native.ISAS
    assert native.load(Options.from_env({"KESTREL_HOST_ISA": "scalar"})).isa == "scalar"
    with pytest.raises(ValueError, match="KESTREL_HOST_ISA"):
        Options.from_env({"KESTREL_HOST_ISA": "sse9"})
    assert Options.from_env({"KESTREL_HOST_SPIN_US": "0"}).host_spin_us == 0
    with pytest.raises(ValueError, match="KESTREL_HOST_SPIN_US='-1': expected a number of microseconds"):
        Options.from_env({"KESTREL_HOST_SPIN_US": "-1"})


def test_this_machine_runs_its_widest_isa(kernels):
    assert kernels.supported[0] == "scalar" and kernels.isa == kernels.supported[-1]
    assert kernels.with_isa("amx").isa == kernels.supported[-1]     # never above what the CPU has
    up_to_vnni = [s for s in kernels.supported if native.ISAS.index(s) <= native.ISAS.index("avx512vnni")]
    assert kernels.with_isa("avx512vnni").isa == up_to_vnni[-1]


@pytest.mark.parametrize("group", [32, 256])
def test_activation_quantization_is_the_twins_bit_for_bit(kernels, group):
    rng = np.random.default_rng(group)
    x = rng.standard_normal(1024).astype(np.float32) * rng.uniform(0.01, 10, 1024).astype(np.float32)
    x[:group] = 0                                   # a zero block: d = 0, q = 0
    x[group:2 * group] = np.float32(0.5) * np.arange(-group // 2, group // 2) / 63.5 * 127   # ties at .5
    expect = twins.quantize_activations(x[None], group)
    for kern in isas(kernels):
        got = kern.quantize_activations(x, group)
        for name, g, e in zip(("hi", "lo", "d", "bsums", "bsums_lo"), got, expect):
            if group == 256 or name in ("hi", "lo", "d"):
                np.testing.assert_array_equal(g, e[0], err_msg=f"{name} {kern.isa}")
            else:
                assert g is None and e is None
    hi, lo, d = got[:3]
    assert np.abs(hi.astype(np.int32)).max() <= 127 and np.abs(lo.astype(np.int32)).max() <= 64
    # the two levels carry x to within half a lo step, d / 256 (and float32 rounding of x / d)
    back = (np.repeat(d, group) * (hi + lo / np.float32(128))).astype(np.float32)
    assert (np.abs(back - x) <= np.repeat(d, group) * (1 / 256 + 1e-5)).all()


# relative RMS error against float32 `x @ dequant(W).T` (over every shape and token count: one small case
# alone varies by a factor of 2), Gaussian activations / 1 % of the channels 20x outliers.  Two int8 levels
# per activation block measure 4-6e-5 / 0.9-2.2e-4 here (the 256-blocks of Q4_K and Q6_K the larger);
# one level measured 5-7e-3 / 1.1-2.8e-2.
FLOAT_RMS = {False: 1e-4, True: 5e-4}


@pytest.mark.parametrize("outliers", [False, True], ids=["gaussian", "outliers"])
@pytest.mark.parametrize("fmt", list(SHAPES))
def test_matmul_matches_twin_and_float_reference_on_every_isa(kernels, fmt, outliers):
    rng = np.random.default_rng(len(fmt) + ord(fmt[1]) + 100 * outliers)
    error_sq = ref_sq = 0.0
    for n, k in SHAPES[fmt]:
        call, twin, dense = make_weight(rng, fmt, n, k)
        channels = rng.choice(k, max(1, k // 100), replace=False)
        for t in TOKENS:
            x = rng.standard_normal((t, k)).astype(np.float32)
            if outliers:
                x[:, channels] *= 20
            expect, ref = twin(x), x @ dense.T
            error_sq += float(np.square(expect - ref).sum())
            ref_sq += float(np.square(ref).sum())
            for kern in isas(kernels):
                got = call(kern, x)
                assert got.shape == (t, n) and got.dtype == np.float32
                np.testing.assert_allclose(got, expect, rtol=0, atol=2e-6 * np.abs(expect).max() + 1e-30,
                                           err_msg=f"{fmt} {kern.isa} N={n} K={k} T={t}")
                kern_err = float(np.sqrt(np.square(got - ref).sum() / np.square(ref).sum()))
                assert kern_err < 2 * FLOAT_RMS[outliers], (fmt, kern.isa, n, k, t, kern_err)
    print(f"{fmt} {'outliers' if outliers else 'gaussian'}: relative RMS {(error_sq / ref_sq) ** 0.5:.2e}")
    assert (error_sq / ref_sq) ** 0.5 < FLOAT_RMS[outliers], fmt


def test_matmul_takes_strided_views_without_copies(kernels):
    rng = np.random.default_rng(7)
    wide = quantize(rng.standard_normal((40, 512)).astype(np.float32))
    qs, scales = wide.qs[3:38:2, 64:448], wide.scales[3:38:2, 2:14]      # every other row, a column range
    x_all = rng.standard_normal((9, 600)).astype(np.float32)
    x = x_all[::2, 100:484]                                             # row stride 1200 floats
    out_all = np.full((5, 50), 7.0, np.float32)
    for kern in isas(kernels):
        got = kern.matmul_q8_0(x, qs, scales, out=out_all[:, 10:28])
        assert got.base is out_all or np.shares_memory(got, out_all)
        np.testing.assert_allclose(got, twins.matmul_q8_0(x, qs, scales), rtol=0, atol=1e-5)
        assert (out_all[:, :10] == 7).all() and (out_all[:, 28:] == 7).all()
    blocks = random_blocks(rng, "Q4_K", 21, 1024, 0.02)
    for kern in isas(kernels):
        np.testing.assert_allclose(kern.matmul_blocks(x_all[:3, :256], "Q4_K", blocks[1::2, 144:288], 256),
                                   twins.matmul_blocks(x_all[:3, :256], "Q4_K", blocks[1::2, 144:288], 256),
                                   rtol=0, atol=1e-5)


def test_a_prepared_weight_serves_every_call(kernels):
    rng = np.random.default_rng(8)
    w = quantize(rng.standard_normal((33, 256)).astype(np.float32))
    prepared = kernels.prepare_q8_0(w.qs, w.scales)
    assert (prepared.rows, prepared.cols, prepared.nbytes) == (33, 256, w.nbytes)
    wide = rng.standard_normal((6, 512)).astype(np.float32)
    for x in (wide[:1, :256], wide[2:3, ::2], wide[:, 256:], wide[::3, :256].astype(np.float64)):
        np.testing.assert_allclose(kernels.matmul(x, prepared), twins.matmul_q8_0(x.astype(np.float32), w.qs, w.scales),
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS_ORDER)
def test_extreme_values_do_not_overflow_the_joined_integer_sums(kernels, fmt):
    """The largest weights (and Q4_K/Q6_K scales and mins) of each format against activations whose
    levels are 127 and -64 everywhere (128 * hi + lo at its largest): every path matches the twin."""
    k = 512
    x = np.full((20, k), 126.5, np.float32)
    x[:, ::32] = 127                                # d = 1: v = 126.5 → hi 127, lo -64
    x[10:] *= -1
    if fmt == "Q8_0":
        qs = np.full((3, k), 127, np.int8)
        qs[1] = -127
        scales = np.full((3, k // 32), 1.0, np.float16)
        call, twin = (lambda kern, x: kern.matmul_q8_0(x, qs, scales)), (lambda x: twins.matmul_q8_0(x, qs, scales))
    else:
        size = native.FORMATS[fmt][2]
        blocks = np.full((3, k // native.FORMATS[fmt][1], size), 0xFF, np.uint8)
        if fmt == "Q4_0":
            blocks[1, :, 2:] = 0x00                                             # every value -8
            blocks[:, :, 0:2] = np.array([1.0], np.float16).view(np.uint8)
        elif fmt == "Q4_K":
            blocks[:, :, 0:4] = np.array([1.0, 0.5], np.float16).view(np.uint8)  # d, dmin; scales, mins 63
        else:
            blocks[1, :, 192:208] = 0x80                                        # scales -128
            blocks[:, :, 208:210] = np.array([1.0], np.float16).view(np.uint8)
        blocks = blocks.reshape(3, -1)
        call = lambda kern, x: kern.matmul_blocks(x, fmt, blocks, k)
        twin = lambda x: twins.matmul_blocks(x, fmt, blocks, k)
    for rows in (x[:1], x[9:12], x):              # a dot product per row and token; 16 tokens in lanes
        expect = twin(rows)
        assert np.abs(expect).max() > 1e5
        for kern in isas(kernels):
            np.testing.assert_allclose(call(kern, rows), expect, rtol=0, atol=2e-6 * np.abs(expect).max(),
                                       err_msg=f"{fmt} {kern.isa} T={len(rows)}")


def test_rmsnorm_as_the_host_backend(kernels):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 1000)).astype(np.float32) * 3
    w = rng.standard_normal(1000).astype(np.float32)
    np.testing.assert_allclose(kernels.rmsnorm(x, w, 1e-6), host.rmsnorm(x, w, 1e-6), rtol=2e-6, atol=1e-6)
    qk = rng.standard_normal((3, 6, 64)).astype(np.float32)          # q/k heads normed per head
    per_head = rng.standard_normal((6, 64)).astype(np.float32)
    np.testing.assert_allclose(kernels.rmsnorm(qk, per_head, 1e-6), host.rmsnorm(qk, per_head, 1e-6),
                               rtol=2e-6, atol=1e-6)


def test_silu_mul_on_the_halves_of_a_fused_output(kernels):
    rng = np.random.default_rng(2)
    gu = rng.standard_normal((7, 2 * 300)).astype(np.float32) * 4
    gu[0, :6] = [-100, -88.5, -30, 30, 88.5, 100]          # the exp's clamps and its overflow
    got = kernels.silu_mul(gu[:, :300], gu[:, 300:])
    with np.errstate(over="ignore"):                         # numpy's exp(100) is inf, as the kernel's
        expect = host.silu_mul(gu[:, :300], gu[:, 300:])
    np.testing.assert_allclose(got, expect, rtol=2e-6, atol=1e-7)


def test_rope_in_place_as_apply_rope(kernels):
    rng = np.random.default_rng(3)
    cos, sin = host.rope_tables(np.arange(11, 16), 128, 1e6)
    qkv = rng.standard_normal((5, 12 * 128)).astype(np.float32)
    qk = qkv[:, :10 * 128].reshape(5, 10, 128)                       # a view of the projection's output
    expect = host.apply_rope(qk.copy(), cos, sin)
    kernels.rope(qk, cos, sin)
    np.testing.assert_allclose(qk, expect, rtol=0, atol=1e-6)


# rows: not a multiple of the 16 a repacked group holds, one row, one group and one over; tokens: every
# remainder of the 4-token chunks the repacked kernels read, one chunk and more, 64
REPACKED_ROWS = (1, 15, 16, 17, 67)
REPACKED_TOKENS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 31, 33, 64)


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K"])
def test_repacked_k_quants_match_the_twin_on_every_isa(kernels, fmt):
    """With AVX-512 VNNI a Q4_K / Q6_K weight is repacked 16 rows together; its kernels, and the scalar C
    that runs a repacked weight below VNNI, against the twin: N odd and not a multiple of 16, 1..64
    tokens, K of one block and of several; the other ISAs on the blocks as stored."""
    rng = np.random.default_rng(31 + len(fmt))
    widest = isas(kernels)[-1]
    for n in REPACKED_ROWS:
        for k in (256, 768):
            weight = random_blocks(rng, fmt, n, k, 0.02)
            if fmt == "Q6_K":
                weight.reshape(n, k // 256, 210)[:, :, 192:208] = rng.integers(0, 256, (n, k // 256, 16), dtype=np.uint8)
            prepared = widest.prepare_blocks(fmt, weight, k)
            for t in REPACKED_TOKENS:
                x = rng.standard_normal((t, k)).astype(np.float32)
                expect = twins.matmul_blocks(x, fmt, weight, k)
                atol = 2e-6 * np.abs(expect).max()
                for kern in isas(kernels):
                    np.testing.assert_allclose(kern.matmul_blocks(x, fmt, weight, k), expect, rtol=0, atol=atol,
                                               err_msg=f"{fmt} {kern.isa} N={n} K={k} T={t}")
                    np.testing.assert_allclose(kern.matmul(x, prepared), expect, rtol=0, atol=atol,
                                               err_msg=f"{fmt} prepared with {widest.isa}, run with {kern.isa} N={n} K={k} T={t}")


def test_vnni_repacks_k_quants_and_keeps_no_blocks(kernels):
    if "avx512vnni" not in kernels.supported:
        pytest.skip("no AVX-512 VNNI here: nothing is repacked")
    rng = np.random.default_rng(5)
    vnni = kernels.with_isa("avx512vnni")
    for fmt, bytes_per_block in (("Q4_K", 144), ("Q6_K", 210)):
        blocks = random_blocks(rng, fmt, 33, 512, 0.02)
        prepared = vnni.prepare_blocks(fmt, blocks, 512)
        assert prepared.fmt_id == native.kernels.REPACKED[fmt] and prepared.w_ptr != blocks.ctypes.data
        assert prepared.nbytes >= 48 * 2 * bytes_per_block                     # 33 rows: 3 groups of 16
        assert not any(np.shares_memory(a, blocks) for a in prepared.arrays)
        assert kernels.with_isa("avx2").prepare_blocks(fmt, blocks, 512).w_ptr == blocks.ctypes.data
    q4 = random_blocks(rng, "Q4_0", 33, 512, 0.02)
    assert vnni.prepare_blocks("Q4_0", q4, 512).w_ptr == q4.ctypes.data


@pytest.mark.parametrize("threads", [2, 3])
def test_repacked_results_do_not_depend_on_threads(kernels, threads):
    rng = np.random.default_rng(threads + 40)
    for fmt in ("Q4_K", "Q6_K"):
        weight = random_blocks(rng, fmt, 301, 512, 0.02)
        x = rng.standard_normal((6, 512)).astype(np.float32)
        one = native.HostKernels(kernels.path, threads=1)
        many = native.HostKernels(kernels.path, threads=threads)
        for t in (1, 6):
            np.testing.assert_array_equal(many.matmul(x[:t], many.prepare_blocks(fmt, weight, 512)),
                                          one.matmul(x[:t], one.prepare_blocks(fmt, weight, 512)))


@pytest.mark.parametrize("fmt", FORMATS_ORDER)
@pytest.mark.parametrize("tokens", [1, 5, 17])
def test_a_bound_linear_is_its_ops_one_by_one_bit_for_bit(kernels, fmt, tokens):
    """The prologue's rmsnorm and gate_up's SiLU·mul inside one call give the numbers of the separate calls,
    on every ISA and token count (the fused path changes where the work runs, not the arithmetic)."""
    rng = np.random.default_rng(tokens)
    n, k = SHAPES[fmt][0]
    n += n % 2                                                   # gate | up: two equal halves
    x = rng.standard_normal((tokens, k)).astype(np.float32) * 2
    norm = rng.standard_normal(k).astype(np.float32)
    for kern in isas(kernels):
        if fmt == "Q8_0":
            w = quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.02)
            prepared = kern.prepare_q8_0(w.qs, w.scales)
        else:
            prepared = kern.prepare_blocks(fmt, random_blocks(rng, fmt, n, k, 0.02), k)
        plain = kern.matmul(x, prepared)
        normed = kern.matmul(kern.rmsnorm(x, norm, 1e-6), prepared)
        assert np.array_equal(kern.linear(prepared)(x), plain), kern.isa
        assert np.array_equal(kern.linear(prepared, norm, 1e-6)(x), normed), kern.isa
        glu = kern.linear(prepared, norm, 1e-6, glu=True)
        expect = kern.silu_mul(normed[:, :n // 2], normed[:, n // 2:])
        assert np.array_equal(glu(x), expect), kern.isa
        out = np.full((tokens, n), np.nan, np.float32)            # into a column slice, other columns untouched
        glu(x, out=out[:, :n // 2])
        assert np.array_equal(out[:, :n // 2], expect) and np.isnan(out[:, n // 2:]).all()


@pytest.mark.parametrize("qk_norm, bias", [(True, False), (False, True), (False, False)])
def test_qkv_rope_is_the_host_programs_numpy(kernels, qk_norm, bias):
    """Bias, per-head q/k norm, rotation and the cache write of one run of rows, against the numpy
    program's arithmetic (program._rope): within float32 rounding of the norm's sum."""
    rng = np.random.default_rng(7)
    t, heads, kv_heads, d, start = 5, 6, 2, 64, 9
    cos, sin = host.rope_rotation(*host.rope_tables(np.arange(start, start + t), d, 1e6))[:2]
    qkv = rng.standard_normal((t, (heads + 2 * kv_heads) * d)).astype(np.float32) * 3
    b = rng.standard_normal((heads + 2 * kv_heads) * d).astype(np.float32) if bias else None
    w = rng.standard_normal((heads + kv_heads, d)).astype(np.float32) if qk_norm else None
    cache_k, cache_v = np.zeros((2, 32, kv_heads, d), np.float32), np.zeros((2, 32, kv_heads, d), np.float32)
    q = np.empty((t, heads, d), np.float32)
    kernels.qkv_rope(qkv, heads, kv_heads, b, w, 1e-6, cos, sin, q, cache_k[1, start:start + t],
                     cache_v[1, start:start + t])
    full = qkv + b if bias else qkv
    qk = full[:, :(heads + kv_heads) * d].reshape(t, heads + kv_heads, d)
    if qk_norm:
        qk = host.rmsnorm(qk, w, 1e-6)
    half = d // 2
    swap = np.concatenate([np.arange(half, d), np.arange(half)])
    qk = host.rotate(qk, cos, sin, swap)
    np.testing.assert_allclose(q, qk[:, :heads], rtol=0, atol=2e-6)
    np.testing.assert_allclose(cache_k[1, start:start + t], qk[:, heads:], rtol=0, atol=2e-6)
    assert np.array_equal(cache_v[1, start:start + t], full[:, (heads + kv_heads) * d:].reshape(t, kv_heads, d))
    assert not cache_k[0].any() and not cache_k[1, :start].any() and not cache_k[1, start + t:].any()


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n, start, window", [(1, 0, None), (1, 40, None), (3, 37, None), (7, 20, 5), (1, 40, 8)])
def test_attention_as_the_host_backend(kernels, kv_dtype, n, start, window):
    rng = np.random.default_rng(n * 100 + start)
    heads, n_kv, d, capacity = 8, 2, 64, 64
    q = rng.standard_normal((n, heads, d)).astype(np.float32)
    k = rng.standard_normal((capacity, n_kv, d)).astype(kv_dtype)
    v = rng.standard_normal((capacity, n_kv, d)).astype(kv_dtype)
    s = start + n
    expect = host.attention(q, k[:s].astype(np.float32), v[:s].astype(np.float32), start, window)
    got = kernels.attention(q, k, v, start, window)
    np.testing.assert_allclose(got, expect, rtol=0, atol=2e-5)


@pytest.mark.parametrize("tokens", [1, 5, 17])
def test_a_glu_weight_read_with_its_halves_interleaved_is_the_contiguous_ones_bit_for_bit(kernels, tokens):
    """prepare_q8_0_halves: gate and up rows interleaved in one buffer (the device's expert pool layout,
    read in place by the host) give the numbers of the same weight with its halves one after the other, on
    every ISA (a dot product per row, tokens in lanes), with the prologue's norm and into a column slice."""
    rng = np.random.default_rng(40 + tokens)
    half, k = 35, 800
    w = quantize(rng.standard_normal((2 * half, k)).astype(np.float32) * 0.02)
    qs, scales = np.empty((2 * half, k), np.int8), np.empty((2 * half, k // 32), np.float16)
    qs[0::2], qs[1::2], scales[0::2], scales[1::2] = w.qs[:half], w.qs[half:], w.scales[:half], w.scales[half:]
    x = rng.standard_normal((tokens, k)).astype(np.float32) * 2
    norm = rng.standard_normal(k).astype(np.float32)
    for kern in isas(kernels):
        apart = kern.prepare_q8_0_halves((qs[0::2], scales[0::2]), (qs[1::2], scales[1::2]))
        assert apart.rows == 2 * half and apart.up_w == k and apart.up_meta == k // 32 * 2
        contiguous = kern.prepare_q8_0(w.qs, w.scales)
        expect = kern.linear(contiguous, norm, 1e-6, glu=True)(x)
        assert np.array_equal(kern.linear(apart, norm, 1e-6, glu=True)(x), expect), kern.isa
        out = np.full((tokens, 2 * half), np.nan, np.float32)
        kern.linear(apart, glu=True)(x, out=out[:, :half])
        assert np.array_equal(out[:, :half], kern.linear(contiguous, glu=True)(x)) and np.isnan(out[:, half:]).all()
    apart = kernels.prepare_q8_0_halves((qs[0::2], scales[0::2]), (qs[1::2], scales[1::2]))
    with pytest.raises(AssertionError, match="glu"):        # its rows are not [0, N) at one stride: never plain
        kernels.linear(apart)
    with pytest.raises(AssertionError, match="glu Linear"):
        kernels.matmul(x, apart)

