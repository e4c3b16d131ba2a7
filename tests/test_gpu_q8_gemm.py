"""The built-in dense GEMM (kernels_ptx/q8_gemm_f16.cu, q8_wgmma.cu) on a GPU: every tile against numpy on awkward shapes
(tokens 9..511, N and K multiples of 32 but not of 128, K / 32 odd, scales 2 mod 4 bytes), with and without
accumulation; through gemv_launch with every epilogue; in a captured graph; and gpu-mode prefill logits
on it against the CPU engine (Qwen3 and Llama).  Skipped without a GPU."""
import numpy as np
import pytest

from kestrel_stream.cuda import driver
from kestrel_stream.cuda.dense_gemm import ALL_GEMM_TILES, GEMM_SIGNATURE, DenseGemm, DenseScratch
from kestrel_stream.model.quant import quantize
from kestrel_stream.run.compat import CpuExecutor
from test_gpu_dense_gemm import check_dense_projection, check_graph_replay
from test_gpu_kernels import Gpu, rel_err
from test_gpu_model import random_weights, relative

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not driver.gpu_available(), reason=f"{driver.detect()}")]

TOKENS = (9, 17, 63, 64, 65, 200, 511)
SHAPES = [(96, 160), (1056, 544), (288, 96)]        # N, K: multiples of 32, not of 128; 96 / 32 and 544 / 32 odd
MAX_TOKENS = 512


@pytest.fixture(scope="module")
def gpu():
    return Gpu()


def case(n: int, k: int, tokens: int):
    rng = np.random.default_rng(n * 3 + k + tokens)
    w = quantize(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k))
    a = rng.standard_normal((tokens, k)).astype(np.float16)
    return w, a, rng


def want(w, a, c0=None):
    """float64 products of the fp16 operands the kernel multiplies: fp16(q * d) and A."""
    n, k = w.qs.shape
    w16 = (w.qs.reshape(n, -1, 32).astype(np.float32) * w.scales.astype(np.float32)[:, :, None]).reshape(n, k)
    out = a.astype(np.float64) @ w16.astype(np.float16).astype(np.float64).T
    return out if c0 is None else out + c0


@pytest.mark.parametrize("tile", ALL_GEMM_TILES, ids=[t.name for t in ALL_GEMM_TILES])
@pytest.mark.parametrize("n,k", SHAPES)
def test_every_tile_matches_numpy(gpu, tile, n, k):
    """Every token count of TOKENS, C written with ldc wider than N, then added into (accumulate); the
    scales at an address 2 mod 4 (a row range of a fused weight starts there when K / 32 is odd).
    q8_wgmma.cu's tiles on sm_90 only."""
    if tile.wgmma and gpu.device.arch != "sm_90":
        pytest.skip(f"wgmma needs sm_90, this GPU is {gpu.device.arch}")
    for tokens in TOKENS:
        w, a, rng = case(n, k, tokens)
        scales = np.concatenate([np.zeros(1, np.float16), w.scales.reshape(-1)])
        scale_base = gpu.put(scales) + 2
        qs, a_ptr = gpu.put(w.qs), gpu.put(a)
        ldc = n + 32
        c0 = rng.standard_normal((tokens, ldc)).astype(np.float32)
        c = gpu.put(c0)
        grid = (-(-tokens // tile.tokens), -(-n // tile.rows))
        for accumulate in (0, 1):
            launch = gpu.kernels.launch(tile.name, grid, (tile.threads,), GEMM_SIGNATURE,
                                        [qs, scale_base, a_ptr, k, c, ldc, tokens, n, k, accumulate],
                                        tile.shared_bytes)
            before = gpu.get(c, (tokens, ldc))
            gpu.run([launch])
            got = gpu.get(c, (tokens, ldc))
            expected = want(w, a, before[:, :n] if accumulate else None)
            assert rel_err(got[:, :n], expected) < 1e-5, (tile.name, tokens, accumulate)
            np.testing.assert_array_equal(got[:, n:], c0[:, n:], err_msg="nothing written past N")


@pytest.mark.parametrize("tokens", (128, 200, 511))
@pytest.mark.parametrize("n,k", SHAPES[:2])
@pytest.mark.parametrize("epilogue", ["plain", "rmsnorm", "silu_pairs", "residual_xn_rms"])
def test_the_dense_path_on_the_built_in_gemm(gpu, n, k, tokens, epilogue):
    """test_gpu_dense_gemm's checks with a built-in DenseScratch: no weight expansion, 2 launches, 3 with an
    epilogue."""
    scratch = DenseScratch.allocate(gpu.arena, None, min_tokens=1, max_tokens=MAX_TOKENS, weight_elements=n * k,
                                    max_cols=k, output_floats=n, workspace_bytes=0)
    launch = check_dense_projection(gpu, scratch, n, k, tokens, epilogue)
    assert launch.dequant is None and launch.launch_count == (2 if epilogue in ("plain", "rmsnorm") else 3)


def test_a_captured_graph_replays_the_built_in_gemm(gpu):
    scratch = DenseScratch.allocate(gpu.arena, None, min_tokens=1, max_tokens=MAX_TOKENS, weight_elements=1056 * 544,
                                    max_cols=544, output_floats=1056, workspace_bytes=0)
    check_graph_replay(gpu, scratch)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_prefill_on_the_built_in_gemm_matches_cpu(arch):
    """cuBLAS off (cublas_min_tokens=0): a 300-token prompt with its last row's logits and 150 tokens with
    every row's, through the built-in GEMM from 128 tokens: 2e-3 of the numpy engine, the same argmax."""
    from kestrel_stream.options import Options
    from kestrel_stream.run.compat import GpuExecutor
    weights = random_weights(arch, seed=2)
    cpu = CpuExecutor(weights)
    gpu = GpuExecutor(weights, max_seq_len=480, max_batch=16, max_sessions=18, prefill_chunk=300,
                      options=Options.from_env().with_(cublas_min_tokens=0))
    assert gpu.backend.blas is None and gpu.backend.state.dense.fused
    assert any(isinstance(launch, DenseGemm) for launch in gpu.steps.step_launches(300, (299, 1)))
    rng = np.random.default_rng(4)
    first, second = (rng.integers(0, weights.config.vocab_size, n) for n in (300, 150))
    cpu_kv, gpu_kv = cpu.alloc_kv(480), gpu.alloc_kv(480)
    [want_logits] = cpu.forward([(cpu_kv, first, 0)], logits="last")
    [got] = gpu.forward([(gpu_kv, first, 0)], logits="last")
    assert relative(got, want_logits) < 2e-3 and int(got.argmax()) == int(want_logits.argmax())
    [want_logits] = cpu.forward([(cpu_kv, second, 300)])
    [got] = gpu.forward([(gpu_kv, second, 300)])
    assert relative(got, want_logits) < 2e-3
    np.testing.assert_array_equal(got.argmax(axis=1), want_logits.argmax(axis=1))
    gpu.close()
