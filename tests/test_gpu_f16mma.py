"""The fp16 tensor-core GEMM of prefill-sized steps without the dense path (kernels_ptx/q8_mma_f16_ws.cu's
tiles, dynamic shared memory) against its numpy twin (fake_f16mma.f16mma_product) on awkward
shapes, every tile and every epilogue (run on a GPU; skipped without one)."""
import numpy as np
import pytest

from fake_f16mma import f16mma_product
from kestrel_stream.cuda import driver, mma_variants
from kestrel_stream.cuda.kernels import QWeight
from kestrel_stream.model.quant import quantize
from kestrel_stream.run.host import silu_mul
from test_gpu_kernels import gpu, gpu_harness, rel_err   # noqa: F401  (the harness fixtures)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not driver.gpu_available(), reason=f"{driver.detect()}")]

F16_TOKENS = (128, 200, 511, 512, 513)
F16_SHAPES = [(96, 160), (1056, 544), (288, 2080)]      # N and K multiples of 32, not of 128
EPILOGUES = ["plain", "rmsnorm", "rmsnorm_large", "silu_pairs", "residual_xn_rms", "strided"]


@pytest.mark.parametrize("tokens", F16_TOKENS)
@pytest.mark.parametrize("n,k", F16_SHAPES)
@pytest.mark.parametrize("tile", list(mma_variants.F16_TILES) + [None])
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_q8_f16mma_matches_numpy(gpu, n, k, tokens, tile, epilogue):
    """To 1e-4 of the twin (fp16 weights and activations, fp32 sums) and 2e-3 of fp32 activations;
    "strided": x and y rows wider than K and N, as qkv's row parts and lm_head's row ranges run;
    "rmsnorm_large": x past fp16's range, brought back by inv_rms_in before the rounding."""
    rng = np.random.default_rng(n + k + tokens)
    w = quantize(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k))
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    x[0, :32] = 0.0                                             # an all-zero block
    inv_rms_in = (0.5 + rng.random(tokens)).astype(np.float32)
    res = rng.standard_normal((tokens, n)).astype(np.float32)
    normw_out = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    if epilogue == "rmsnorm_large":         # a raw residual stream past fp16's range, normed by inv_rms_in
        x, inv_rms_in = x * np.float32(3e5), inv_rms_in / np.float32(3e5)
    scaled = epilogue in ("rmsnorm", "rmsnorm_large", "silu_pairs")

    def finish(s):
        out = silu_mul(s[:, 0::2], s[:, 1::2]) if epilogue == "silu_pairs" else s
        return out + res if epilogue == "residual_xn_rms" else out

    twin = finish(f16mma_product(x, w.qs, w.scales, inv_rms_in if scaled else None))
    exact = finish((x @ w.dequantize().T) * (inv_rms_in[:, None] if scaled else 1))
    cols = twin.shape[1]
    ldx, ldy = (k + 32, cols + 64) if epilogue == "strided" else (k, cols)
    x_rows = np.zeros((tokens, ldx), np.float32)
    x_rows[:, :k] = x
    qw = QWeight(gpu.put(w.qs), gpu.put(w.scales), n, k)
    y_init = np.full((tokens, ldy), 7.0, np.float32)
    if epilogue == "residual_xn_rms":
        y_init = res
    y = gpu.put(y_init)
    xn, inv_rms_out = gpu.put(np.zeros((tokens, n), np.float32)), gpu.put(np.zeros(tokens, np.float32))
    counter = gpu.put(np.zeros(16, np.uint32))
    extra = {"plain": {}, "strided": {}, "rmsnorm": {"inv_rms_in": gpu.put(inv_rms_in)},
             "rmsnorm_large": {"inv_rms_in": gpu.put(inv_rms_in)},
             "silu_pairs": {"inv_rms_in": gpu.put(inv_rms_in), "silu_pairs": True},
             "residual_xn_rms": {"res": y, "normw_out": gpu.put(normw_out), "xn_out": xn,
                                 "inv_rms_out": inv_rms_out, "counter": counter}}[epilogue]
    launch = gpu.gemv_launch(gpu.kernels, qw, gpu.put(x_rows), ldx, y, ldy, tokens, variant=tile, **extra)
    assert launch.name.startswith("q8_f16mma_")
    gpu.run(launch)
    got_rows = gpu.get(y, (tokens, ldy))
    got = got_rows[:, :cols]
    assert rel_err(got, twin) < 1e-4
    assert rel_err(got, exact) < 2e-3
    if epilogue == "strided":
        assert (got_rows[:, cols:] == 7.0).all(), "nothing written past N in a wider row"
    if epilogue == "residual_xn_rms":
        np.testing.assert_allclose(gpu.get(xn, (tokens, n)), got * normw_out, rtol=1e-6)
        np.testing.assert_allclose(gpu.get(inv_rms_out, (tokens,)),
                                   1 / np.sqrt(np.mean(got * got, axis=1) + 1e-6), rtol=1e-5)
        assert not gpu.get(counter, (16,), np.uint32)[:8].any(), "the tickets are zeroed for the next launch"


@pytest.mark.parametrize("tile", ["f16_64x128k64_ws_s4_b2", "f16_128x128k64_ws_s3", "f16_128x128_ws_xa_s3_b2"])
def test_programmatic_chain_of_f16_gemms_keeps_dependencies(gpu, tile):
    """Dependent 256-token GEMMs with programmatic stream serialization in one graph: each reads the
    xn and 1/rms the previous one's epilogue wrote, x_{i+1} = x_i + W_i (x_i / rms(x_i))."""
    rng = np.random.default_rng(5)
    n, tokens, steps = 1024, 256, 6
    weights = [quantize(rng.standard_normal((n, n)).astype(np.float32) / np.sqrt(n)) for _ in range(steps)]
    x0 = rng.standard_normal((tokens, n)).astype(np.float32)
    inv0 = (1 / np.sqrt(np.mean(x0 * x0, axis=1) + 1e-6)).astype(np.float32)
    want, inv = x0.copy(), inv0
    for w in weights:
        want = want + f16mma_product(want, w.qs, w.scales, inv)
        inv = 1 / np.sqrt(np.mean(want * want, axis=1) + 1e-6)
    ones = gpu.put(np.ones(n, np.float32))
    x, xn = gpu.put(x0), [gpu.put(x0), gpu.put(x0)]
    rms = [gpu.put(inv0), gpu.put(np.zeros(tokens, np.float32))]
    counter = gpu.put(np.zeros(16, np.uint32))
    launches = [gpu.gemv_launch(gpu.kernels, QWeight(gpu.put(w.qs), gpu.put(w.scales), n, n), xn[i % 2], n, x, n,
                                tokens, inv_rms_in=rms[i % 2], res=x, normw_out=ones, xn_out=xn[1 - i % 2],
                                inv_rms_out=rms[1 - i % 2], counter=counter, variant=tile)
                for i, w in enumerate(weights)]
    for launch in launches[1:]:
        launch.programmatic = True
    for ptr, value in [(x, x0), (xn[0], x0), (rms[0], inv0)]:
        driver.h2d_sync(ptr, value)
    with driver.capture(gpu.stream) as captured:
        for launch in launches:
            launch.enqueue(gpu.stream)
    captured.graph.launch(gpu.stream)
    gpu.stream.synchronize()
    captured.graph.destroy()
    assert rel_err(gpu.get(x, (tokens, n)), want) < 1e-3
    assert not gpu.get(counter, (16,), np.uint32)[:8].any()
