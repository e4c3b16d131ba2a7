"""The fp16 tensor-core GEMVs of a few tokens (kernels_ptx/q8_gemv_hmma.cu for Q8_0 from 3 tokens, q4k_ / q6k_gemv_hmma.cu
for Q4_K / Q6_K by shape, any layout from 2 by name) through gemv_launch: which steps take them, every layout's launch on awkward shapes (rows past a block's 16 or 32, K of a few blocks) with each epilogue,
against fp32 activations to 1e-5 (x goes in as hi + lo fp16 parts: one fp16 rounding would be ~1e-4), on the
emulated device and (marked gpu) on a real one (2..16 tokens: the layouts asked for by name at 2 as well); the
ticket and the 16 per-token sums are zero after each launch."""
from __future__ import annotations

import numpy as np
import pytest

from kestrel_stream.cuda import gemv_variants
from kestrel_stream.cuda.kernels import GEMV_COUNTER_BYTES, QWeight, gemv_launch
from kestrel_stream.model.quant import quantize
from kestrel_stream.options import Options
from test_block_kernels import DEVICES, Harness


@pytest.fixture(params=DEVICES)
def dev(request, monkeypatch):
    h = Harness(request.param, monkeypatch)
    yield h
    h.arena.release()


def test_which_steps_take_it(monkeypatch):
    import fake_cuda
    fake_cuda.install(monkeypatch)
    from kestrel_stream.cuda.kernels import KernelSet
    w = QWeight(0, 0, 2048, 64)
    names = {t: gemv_launch(KernelSet(), w, 0, 64, 0, 2048, t).name for t in (1, 2, 3, 8, 9, 16, 17)}
    assert names[1].startswith("q8_gemv_m1") and names[2].startswith("q8_gemv_m2_")
    assert [names[t] for t in (3, 8, 9, 16)] == ["q8_hmma_t8_k16u4"] * 2 + ["q8_hmma_t16_k16u4"] * 2
    assert names[17].startswith("q8_mma_")
    fp32 = KernelSet(options=Options.from_env({"KESTREL_GEMV_MN": "o64r4u2"}))
    assert gemv_launch(fp32, w, 0, 64, 0, 2048, 8).name == "q8_gemv_m8_o64r4u2"
    assert gemv_launch(fp32, w, 0, 64, 0, 2048, 12).name.startswith("q8_mma_"), "the fp32 layouts keep q8_mma"
    assert gemv_launch(KernelSet(), QWeight(0, 0, 151936, 64), 0, 64, 0, 151936, 5).name == "q8_hmma_t8_k4u4r2"


def test_which_q4k_steps_take_it(monkeypatch):
    """A Q4_K or Q6_K weight of one format, by shape (gemv_variants.hmma_q4k_takes); not with a Q6_K tail, not
    when the older choices are asked for."""
    import fake_cuda
    fake_cuda.install(monkeypatch)
    from kestrel_stream.cuda import driver, kernels
    device = driver.Device(0)
    KernelSet = lambda options=None: kernels.KernelSet(device, options)   # noqa: E731

    def name(rows, cols, tokens, ks=None, **kw):
        return gemv_launch(ks or KernelSet(), QWeight(0, 0, rows, cols, "Q4_K", **kw), 0, cols, 0, rows, tokens).name
    names = {t: name(2048, 2048, t) for t in (1, 2, 3, 4, 8, 9, 16, 17)}
    assert all(names[t].startswith("q4_k_gemv_m") for t in (1, 2, 3, 4)) and names[17].startswith("q4_k_mma")
    assert [names[t] for t in (8, 9, 16)] == ["q4k_hmma_t8_k8", "q4k_hmma_t16_k8", "q4k_hmma_t16_k8"]
    assert name(12288, 2048, 3) == "q4k_hmma_t8_k4r2" and name(6144, 4096, 16) == "q4k_hmma_t16_k4"
    assert name(4096, 4096, 3).startswith("q4_k_gemv_m") and name(4096, 4096, 4) == "q4k_hmma_t8_k8"
    assert name(2048, 6144, 8).startswith("q4_k_mma"), "few rows, long K: the GEMM"
    q6k = {(rows, t): gemv_launch(KernelSet(), QWeight(0, 0, rows, 12288, "Q6_K"), 0, 12288, 0, rows, t).name
           for rows in (4096, 151936) for t in (4, 8, 16)}
    assert q6k[4096, 4].startswith("q6_k_gemv_m") and q6k[4096, 8] == "q6k_hmma_t8_k8", q6k
    assert [q6k[151936, t] for t in (4, 8, 16)] == ["q6k_hmma_t8_k4", "q6k_hmma_t8_k4", "q6k_hmma_t16_k4r2"], q6k
    assert "hmma" not in name(2304, 2048, 8, tail=QWeight(0, 0, 256, 2048, "Q6_K"))
    older = KernelSet(Options.from_env({"KESTREL_BLOCK_MMA_MIN_TOKENS": "6"}))
    assert [name(2048, 2048, t, older)[:9] for t in (4, 8)] == ["q4_k_gemv", "q4_k_mma1"]


@pytest.mark.parametrize("mode", ["pipelined", "half"])
def test_bench_layout_modes_launch_defined_pipelined_layouts(monkeypatch, mode):
    """bench/hmma_layouts.py's modes: every shape's launch takes a defined layout, pipelined where one exists
    (the same warps, or half of them), and "default" gives back the defaults."""
    import fake_cuda
    fake_cuda.install(monkeypatch)
    from bench import hmma_layouts
    from kestrel_stream.cuda import driver, hmma_launch, kernels
    for module, name in ((gemv_variants, "hmma_variant"), (gemv_variants, "hmma_q4k_variant"),
                         (kernels, "hmma_variant"), (hmma_launch, "hmma_q4k_variant")):
        monkeypatch.setattr(module, name, getattr(module, name))   # put back after the test
    ks = kernels.KernelSet(driver.Device(0))

    def names(fmt):
        shapes = [(2048, 2048), (4096, 2048), (6144, 4096), (12288, 2048), (2048, 6144), (151936, 2048)]
        return {(rows, cols, t): gemv_launch(ks, QWeight(0, 0, rows, cols, fmt), 0, cols, 0, rows, t).name
                for rows, cols in shapes for t in (4, 8, 16)}
    before = {fmt: names(fmt) for fmt in ("Q8_0", "Q4_K", "Q6_K")}
    hmma_layouts.apply(mode)
    after = {fmt: names(fmt) for fmt in ("Q8_0", "Q4_K", "Q6_K")}
    changed = 0
    for fmt in after:
        for shape, name in after[fmt].items():
            old = before[fmt][shape]
            if "hmma" not in old:
                assert name == old, (fmt, shape)   # the GEMVs and GEMMs stay
                continue
            layout = name.split("_")[-1]
            assert ("h" + layout) in (gemv_variants.HMMA_VARIANTS if fmt == "Q8_0" else
                                      gemv_variants.HMMA_BLOCK_VARIANTS[fmt]), name
            changed += name != old
            if name != old:
                assert layout.endswith("p"), (old, name)
                if mode == "pipelined":
                    assert name == old + "p"
    assert changed >= 6
    if mode == "half":
        assert after["Q8_0"][2048, 2048, 8] == "q8_hmma_t8_k8u4p" and after["Q4_K"][4096, 2048, 8] == "q4k_hmma_t8_k4p"
    hmma_layouts.apply("default")
    assert {fmt: names(fmt) for fmt in ("Q8_0", "Q4_K", "Q6_K")} == before
    with pytest.raises(ValueError, match="pipelined"):
        hmma_layouts.apply("fast")


def device_layouts(layouts) -> list:
    """(device, layout) pairs: every layout on a GPU; on the emulated device, whose twin is the same for a layout
    and its pipelined ("p") form, the layouts without p and one with (its name and grid)."""
    one_p = next(layout for layout in layouts if layout[-1].endswith("p"))
    return [pytest.param(device, *layout, marks=getattr(device, "marks", ()))
            for device in DEVICES for layout in layouts
            if getattr(device, "values", (None,))[0] == "gpu" or not layout[-1].endswith("p") or layout == one_p]


def unwrap(device):
    return device if isinstance(device, str) else device.values[0]


@pytest.fixture
def device(request, monkeypatch):
    """dev's harness on the device a test's parameters name."""
    h = Harness(request.param, monkeypatch)
    yield h
    h.arena.release()


@pytest.mark.parametrize("device,layout", [pytest.param(unwrap(p.values[0]), *p.values[1:], marks=p.marks)
                                        for p in device_layouts([(layout,) for layout in gemv_variants.HMMA_VARIANTS])],
                         indirect=["device"])
@pytest.mark.parametrize("n,k,tokens", [(38, 96, 2), (38, 96, 3), (258, 544, 8), (70, 160, 9), (64, 2080, 13),
                                        (100, 2080, 16), (2048, 6144, 7)])
@pytest.mark.parametrize("epilogue", ["plain", "rmsnorm", "silu_pairs", "residual_xn_rms"])
def test_every_layout_matches_fp32_activations(device, layout, n, k, tokens, epilogue):
    dev = device
    rng = np.random.default_rng(n + k + tokens)
    w = quantize(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k))
    qw = QWeight(dev.put(w.qs), dev.put(w.scales), n, k)
    check_layout(dev, qw, w.dequantize(), layout, tokens, epilogue, rng)


# Q4_K and Q6_K (q4k_ / q6k_gemv_hmma.cu): one super-block, a few, a count no warp split divides evenly, a model's K
@pytest.mark.parametrize("device,fmt,layout",
                         [pytest.param(unwrap(p.values[0]), *p.values[1:], marks=p.marks) for fmt, layouts in
                          gemv_variants.HMMA_BLOCK_VARIANTS.items()
                          for p in device_layouts([(fmt, layout) for layout in layouts])], indirect=["device"])
@pytest.mark.parametrize("n,k,tokens", [(38, 256, 2), (38, 512, 3), (258, 2048, 8), (70, 2304, 9), (64, 1280, 13),
                                        (100, 2560, 16), (1536, 8960, 7)])
@pytest.mark.parametrize("epilogue", ["plain", "rmsnorm", "silu_pairs", "residual_xn_rms"])
def test_every_kquant_layout_matches_fp32_activations(device, fmt, layout, n, k, tokens, epilogue):
    dev = device
    from bench.synthetic import random_blocks
    from kestrel_stream.model.quant4 import BlockTensor
    from test_block_kernels import upload
    rng = np.random.default_rng(n + k + tokens)
    w = BlockTensor(fmt, random_blocks(rng, fmt, n, k, 1 / np.sqrt(k)), k)
    check_layout(dev, upload(dev, w), w.dequantize(), layout, tokens, epilogue, rng)


def check_layout(dev, qw: QWeight, dense: np.ndarray, layout: str, tokens: int, epilogue: str, rng) -> None:
    """`layout` (of HMMA_VARIANTS for Q8_0, HMMA_BLOCK_VARIANTS[fmt] for the K-quants) over `tokens` rows of x spanning three
    decades with `epilogue`, launched twice (the second launch finds the ticket and 16 sums the first reset),
    against fp64 products of the dequantized weight to 1e-5 of each token's largest output."""
    n, k = qw.rows, qw.cols
    x = (rng.standard_normal((tokens, k)) * 10.0 ** rng.uniform(-2, 1, (tokens, 1))).astype(np.float32)
    inv_rms_in = (0.5 + rng.random(tokens)).astype(np.float32)
    s = (x.astype(np.float64) @ dense.T.astype(np.float64)).astype(np.float32)
    counter = dev.put(np.zeros(GEMV_COUNTER_BYTES // 4, np.uint32))
    if epilogue == "silu_pairs":
        s = s * inv_rms_in[:, None]
        want = s[:, 0::2] / (1 + np.exp(-s[:, 0::2])) * s[:, 1::2]
        y = dev.put(np.zeros((tokens, n // 2), np.float32))
        launch = gemv_launch(dev.kernels, qw, dev.put(x), k, y, n // 2, tokens, silu_pairs=True,
                             inv_rms_in=dev.put(inv_rms_in), variant=layout)
        dev.run(launch)
        got = dev.get(y, (tokens, n // 2))
    else:
        res = rng.standard_normal((tokens, n)).astype(np.float32) if epilogue == "residual_xn_rms" else None
        y = dev.put(res if res is not None else np.zeros((tokens, n), np.float32))
        extra = {}
        if epilogue == "rmsnorm":
            s = s * inv_rms_in[:, None]
            extra = dict(inv_rms_in=dev.put(inv_rms_in))
        if res is not None:
            normw = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
            xn, inv_rms = dev.put(np.zeros((tokens, n), np.float32)), dev.put(np.zeros(tokens, np.float32))
            extra = dict(res=y, normw_out=dev.put(normw), xn_out=xn, inv_rms_out=inv_rms, counter=counter)
        launch = gemv_launch(dev.kernels, qw, dev.put(x), k, y, n, tokens, variant=layout, **extra)
        for _ in range(2):   # the second launch finds the ticket and the 16 sums the first reset
            dev.run(launch)
        # y aliases res: each launch adds the products once more
        want, got = (res + 2 * s if res is not None else s), dev.get(y, (tokens, n))
        if res is not None:
            np.testing.assert_allclose(dev.get(xn, (tokens, n)), got * normw, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(dev.get(inv_rms, (tokens,)), 1 / np.sqrt(np.mean(got * got, axis=1) + 1e-6),
                                       rtol=1e-5)
            assert not dev.get(counter, (GEMV_COUNTER_BYTES // 4,)).any(), "ticket and sums zeroed for the next launch"
    silu = epilogue == "silu_pairs"
    if qw.fmt == "Q8_0":
        name, shape = gemv_variants.hmma_kernel_name(tokens, layout, silu), gemv_variants.HMMA_VARIANTS[layout]
    else:
        name = gemv_variants.hmma_block_kernel_name(qw.fmt, tokens, layout, silu)
        shape = gemv_variants.HMMA_BLOCK_VARIANTS[qw.fmt][layout]
    assert launch.name == name and launch.grid[0] == -(-n // shape.rows)
    # per token: x spans three decades across tokens, so each row is held to its own scale
    err = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
    assert err.max() < 1e-5, (layout, err)
