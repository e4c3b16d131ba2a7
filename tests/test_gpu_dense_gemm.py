"""The library GEMM path on a GPU: kernels_ptx/dense_gemm.cu's kernels against numpy, cuBLAS through
cuda/cublas.py with every epilogue on awkward shapes, a graph capture of it, and gpu-mode prefill
logits against the CPU engine (Qwen3 and Llama).  Skipped without a GPU; needs the `cublas` extra."""
import numpy as np
import pytest

from kestrel_stream.cuda import cublas, driver
from kestrel_stream.cuda.dense_gemm import DenseGemm, DenseScratch
from kestrel_stream.cuda.kernels import QWeight
from kestrel_stream.model.quant import quantize
from kestrel_stream.run.host import silu_mul
from kestrel_stream.run.compat import CpuExecutor
from scheduler.dense import WORKSPACE_BYTES
from test_gpu_kernels import Gpu, rel_err
from test_gpu_model import random_weights, relative

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not driver.gpu_available(), reason=f"{driver.detect()}")]

TOKENS = (128, 200, 511, 512)
SHAPES = [(96, 160), (1056, 544)]            # N and K multiples of 32, not of 128
MAX_TOKENS = 512


@pytest.fixture(scope="module")
def harness():
    gpu = Gpu()
    blas = cublas.load()
    if blas is None:
        pytest.skip("cuBLAS is not installed (pip install 'kestrel-stream[cublas]')")
    scratch = DenseScratch.allocate(gpu.arena, blas, min_tokens=1, max_tokens=MAX_TOKENS,
                                    weight_elements=max(n * k for n, k in SHAPES), max_cols=max(k for _, k in SHAPES),
                                    output_floats=max(n for n, _ in SHAPES), workspace_bytes=WORKSPACE_BYTES)
    yield gpu, scratch
    blas.destroy()


def case(n: int, k: int, tokens: int):
    rng = np.random.default_rng(n * 3 + k + tokens)
    w = quantize(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k))
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    return w, x, rng


@pytest.mark.parametrize("n,k", SHAPES)
def test_dequant_and_input_kernels_round_like_numpy(harness, n, k):
    gpu, scratch = harness
    w, x, rng = case(n, k, 200)
    inv_rms = (0.5 + rng.random(200)).astype(np.float32)
    qw = QWeight(gpu.put(w.qs), gpu.put(w.scales), n, k)
    dequant = gpu.kernels.launch("q8_dequant_f16", (-(-n * k // 16 // 256),), (256,), "pppii",
                                 [qw.qs, qw.scales, scratch.weights, n, k])
    inputs = gpu.kernels.launch("gemm_input_f16", (-(-k // 1024), 200), (256,), "pippi",
                                [gpu.put(x), k, gpu.put(inv_rms), scratch.inputs, k])
    gpu.run([dequant, inputs])
    want_w = (w.qs.reshape(n, -1, 32).astype(np.float32) * w.scales.astype(np.float32)[:, :, None]).reshape(n, k)
    np.testing.assert_array_equal(gpu.get(scratch.weights, (n, k), np.float16), want_w.astype(np.float16))
    np.testing.assert_array_equal(gpu.get(scratch.inputs, (200, k), np.float16),
                                  (x * inv_rms[:, None]).astype(np.float16))


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("epilogue", ["plain", "rmsnorm", "silu_pairs", "residual_xn_rms"])
def test_cublas_gemm_matches_numpy(harness, n, k, tokens, epilogue):
    """Through gemv_launch: within 1e-4 of float64 products of the fp16-rounded operands, within 2e-3
    of the float32 product of the Q8_0 weight; y's rows ldy apart (wider than the output)."""
    gpu, scratch = harness
    launch = check_dense_projection(gpu, scratch, n, k, tokens, epilogue)
    assert launch.launch_count == (3 if epilogue in ("plain", "rmsnorm") else 4)


def check_dense_projection(gpu, scratch, n: int, k: int, tokens: int, epilogue: str) -> DenseGemm:
    """One projection through gemv_launch on `scratch`'s dense path, every output against numpy: within 1e-4
    of float64 products of the fp16-rounded operands, 2e-3 of the float32 product of the Q8_0 weight, nothing
    written past the output's columns, xn and 1/rms of the next norm; returns the launch."""
    w, x, rng = case(n, k, tokens)
    inv_rms_in = (0.5 + rng.random(tokens)).astype(np.float32)
    res = rng.standard_normal((tokens, n)).astype(np.float32)
    normw_out = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    dense_w = w.dequantize()
    scaled = x * inv_rms_in[:, None] if epilogue in ("rmsnorm", "silu_pairs") else x

    def finish(s):
        out = silu_mul(s[:, 0::2], s[:, 1::2]) if epilogue == "silu_pairs" else s
        return out + res if epilogue == "residual_xn_rms" else out

    rounded = finish(scaled.astype(np.float16).astype(np.float64) @ dense_w.astype(np.float16).astype(np.float64).T)
    exact = finish(scaled @ dense_w.T)
    cols, ldy = exact.shape[1], exact.shape[1] + 32
    y0 = np.zeros((tokens, ldy), np.float32)
    if epilogue == "residual_xn_rms":
        y0[:, :n] = res
    y, xn = gpu.put(y0), gpu.put(np.zeros((tokens, ldy), np.float32))
    inv_rms_out = gpu.put(np.zeros(tokens, np.float32))
    extra = {"plain": {}, "rmsnorm": {"inv_rms_in": gpu.put(inv_rms_in)},
             "silu_pairs": {"inv_rms_in": gpu.put(inv_rms_in), "silu_pairs": True},
             "residual_xn_rms": {"res": y, "normw_out": gpu.put(normw_out), "xn_out": xn,
                                 "inv_rms_out": inv_rms_out}}[epilogue]
    qw = QWeight(gpu.put(w.qs), gpu.put(w.scales), n, k)
    launch = gpu.gemv_launch(gpu.kernels, qw, gpu.put(x), k, y, ldy, tokens, dense=scratch, **extra)
    assert isinstance(launch, DenseGemm)
    gpu.run(launch)
    got = gpu.get(y, (tokens, ldy))
    assert rel_err(got[:, :cols], rounded) < 1e-4
    assert rel_err(got[:, :cols], exact) < 2e-3
    assert not got[:, cols:].any(), "nothing written past the output's columns"
    if epilogue == "residual_xn_rms":
        np.testing.assert_allclose(gpu.get(xn, (tokens, ldy))[:, :n], got[:, :n] * normw_out, rtol=1e-6)
        np.testing.assert_allclose(gpu.get(inv_rms_out, (tokens,)),
                                   1 / np.sqrt(np.mean(got[:, :n] ** 2, axis=1) + 1e-6), rtol=1e-5)
    return launch


def test_a_captured_graph_replays_the_library_gemm(harness):
    """The GEMM inside a CUDA graph (our workspace: nothing allocated during capture), replayed with new x."""
    gpu, scratch = harness
    check_graph_replay(gpu, scratch)


def check_graph_replay(gpu, scratch) -> None:
    """A 200 x 1056 x 544 projection on `scratch`'s dense path captured in a CUDA graph, replayed twice with
    new x: within 2e-3 of the float32 product each time."""
    n, k, tokens = 1056, 544, 200
    w, x, rng = case(n, k, tokens)
    qw = QWeight(gpu.put(w.qs), gpu.put(w.scales), n, k)
    x_ptr, y = gpu.put(x), gpu.put(np.zeros((tokens, n), np.float32))
    launch = gpu.gemv_launch(gpu.kernels, qw, x_ptr, k, y, n, tokens, dense=scratch)
    with driver.capture(gpu.stream) as captured:
        launch.enqueue(gpu.stream)
    for trial in range(2):
        x = rng.standard_normal((tokens, k)).astype(np.float32)
        driver.h2d_sync(x_ptr, x)
        captured.graph.launch(gpu.stream)
        gpu.stream.synchronize()
        assert rel_err(gpu.get(y, (tokens, n)), x @ w.dequantize().T) < 2e-3, trial
    captured.graph.destroy()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_prefill_on_cublas_matches_cpu(arch):
    """A 300-token prompt with its last row's logits (one 300-token step on cuBLAS), then 150 tokens with
    every row's (chunks of 64 rows, cuBLAS from 16 tokens), then a 16-session decode bucket captured on
    cuBLAS: 2e-3 of the numpy engine, the same argmax."""
    from kestrel_stream.options import Options
    from kestrel_stream.run.compat import GpuExecutor
    weights = random_weights(arch, seed=2)
    cpu = CpuExecutor(weights)
    gpu = GpuExecutor(weights, max_seq_len=480, max_batch=16, max_sessions=18,
                      options=Options.from_env().with_(cublas_min_tokens=16))
    if gpu.backend.blas is None:
        pytest.skip("cuBLAS is not installed (pip install 'kestrel-stream[cublas]')")
    assert any(isinstance(launch, DenseGemm) for launch in gpu.steps.step_launches(300, (299, 1)))
    rng = np.random.default_rng(4)
    first, second = (rng.integers(0, weights.config.vocab_size, n) for n in (300, 150))
    cpu_kv, gpu_kv = cpu.alloc_kv(480), gpu.alloc_kv(480)
    [want] = cpu.forward([(cpu_kv, first, 0)], logits="last")
    [got] = gpu.forward([(gpu_kv, first, 0)], logits="last")
    assert relative(got, want) < 2e-3 and int(got.argmax()) == int(want.argmax())
    [want] = cpu.forward([(cpu_kv, second, 300)])
    [got] = gpu.forward([(gpu_kv, second, 300)])
    assert relative(got, want) < 2e-3
    np.testing.assert_array_equal(got.argmax(axis=1), want.argmax(axis=1))
    sessions = [(cpu.alloc_kv(8), gpu.alloc_kv(8)) for _ in range(16)]
    tokens = rng.integers(0, weights.config.vocab_size, 16)
    for position in range(2):
        want = cpu.forward([(c, np.array([t]), position) for (c, _), t in zip(sessions, tokens)])
        got = gpu.forward([(g, np.array([t]), position) for (_, g), t in zip(sessions, tokens)])
        for g, w in zip(got, want):
            assert relative(g, w) < 2e-3 and int(g.argmax()) == int(w.argmax())
        tokens = [int(w[-1].argmax()) for w in want]
    assert gpu.stats["graphs_captured"] == 1
    gpu.close()
