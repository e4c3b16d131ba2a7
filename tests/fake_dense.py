"""numpy twins of the library GEMM path: kernels_ptx/dense_gemm.cu's kernels and cuBLAS (cuda/cublas.py).

The twins round where the device rounds (fp16 weights and inputs, products in float32) and check what
the device would fault on: alignment of the vector loads, grids that miss part of the work, a GEMM
issued before its workspace is set (a graph capture would allocate), operands outside the arena.
"""
from __future__ import annotations

import re

import numpy as np

from fake_cuda import dev
from kestrel_stream.model.quant4 import dequantize_blocks
from scheduler.ops import BLOCK_FORMATS


def strided(ptr: int, count: int, stride: int, width: int, dtype) -> np.ndarray:
    """[count, width] of `dtype` rows `stride` elements apart (a view of device memory)."""
    size = np.dtype(dtype).itemsize
    span = dev(ptr, size * ((count - 1) * stride + width), dtype)
    return np.lib.stride_tricks.as_strided(span, (count, width), (size * stride, size))


def silu_mul(gate, up):
    return gate / (np.float32(1) + np.exp(-gate)) * up


def q8_dequant_f16(launch, qs, scales, out, N, K) -> None:
    assert launch.block == (256, 1, 1) and K % 32 == 0, launch.block
    assert qs % 16 == 0 and out % 16 == 0 and scales % 2 == 0, f"16-byte loads/stores misaligned ({qs:#x}, {out:#x})"
    w = dev(qs, N * K, np.int8).reshape(N, K // 32, 32).astype(np.float32)
    s = dev(scales, 2 * N * (K // 32), np.float16).reshape(N, K // 32, 1).astype(np.float32)
    dev(out, 2 * N * K, np.float16)[:] = (w * s).reshape(-1).astype(np.float16)


def block_dequant_f16(launch, qs, meta, out, N, K, qs_b, meta_b, head_rows) -> None:
    """<fmt>[_<tail fmt>]_dequant_f16: rows [0, head_rows) from the head format's image parts, the rest from the
    tail's, each model/quant4.py's float32 value rounded once to fp16."""
    from fake_block_kernels import part_blocks
    from kestrel_stream.cuda.dense_gemm import BLOCK_UNITS, MAX_DEQUANT_BLOCKS
    head, tail = re.fullmatch(r"(q4_0|q4_k|q6_k)(?:_(q6_k))?_dequant_f16", launch.name).groups()
    head, tail = head.upper(), (tail or head).upper()
    if head == tail:
        assert head_rows == N and (qs_b, meta_b) == (qs, meta), f"{launch.name}: one format, rows_a {head_rows} != N {N}"
    else:
        assert 0 < head_rows < N, (launch.name, head_rows, N)
    units = head_rows * (K // BLOCK_UNITS[head]) + (N - head_rows) * (K // BLOCK_UNITS[tail])
    assert launch.block == (256, 1, 1) and launch.grid[1:] == (1, 1), launch.name
    assert launch.grid[0] == min(-(-units // 256), MAX_DEQUANT_BLOCKS), f"{launch.name}: grid {launch.grid}, {units} units"
    assert out % 16 == 0, f"16-byte stores misaligned ({out:#x})"
    runs = [(head, head_rows, qs, meta)] + ([(tail, N - head_rows, qs_b, meta_b)] if head_rows < N else [])
    values = [dequantize_blocks(part_blocks(q, m, fmt, rows, K).reshape(-1, BLOCK_FORMATS[fmt][1]), fmt).reshape(rows, K)
              for fmt, rows, q, m in runs]
    dev(out, 2 * N * K, np.float16)[:] = np.concatenate(values).reshape(-1).astype(np.float16)


def gemm_input_f16(launch, x, ldx, inv_rms_in, a, K) -> None:
    T = launch.grid[1]
    assert launch.block == (256, 1, 1) and launch.grid[0] * 1024 >= K and K % 4 == 0, (launch.grid, K)
    assert x % 16 == 0 and ldx % 4 == 0 and a % 8 == 0, f"float4 loads of x misaligned (x {x:#x}, ldx {ldx})"
    v = strided(x, T, ldx, K, np.float32)
    if inv_rms_in:
        v = v * dev(inv_rms_in, 4 * T, np.float32)[:, None]
    dev(a, 2 * T * K, np.float16)[:] = v.reshape(-1).astype(np.float16)


def gemm_epilogue(launch, c, ldc, y, ldy, res, normw_out, xn_out, inv_rms_out, eps, N) -> None:
    T, silu = launch.grid[0], launch.name.endswith("_silu")
    assert launch.block == (256, 1, 1) and launch.grid[1:] == (1, 1), launch.name
    s = strided(c, T, ldc, 2 * N if silu else N, np.float32)
    out = silu_mul(s[:, 0::2], s[:, 1::2]) if silu else s.copy()
    if res:
        out = out + strided(res, T, ldy, N, np.float32)
    if y != c or res:
        strided(y, T, ldy, N, np.float32)[:] = out
    if xn_out:
        strided(xn_out, T, ldy, N, np.float32)[:] = out * dev(normw_out, 4 * N, np.float32)
    if inv_rms_out:
        dev(inv_rms_out, 4 * T, np.float32)[:] = 1.0 / np.sqrt(np.mean(np.square(out), axis=1) + np.float32(eps))


def q8_gemm_f16(launch, qs, scales, a, lda, c, ldc, T, N, K, accumulate) -> None:
    """kernels_ptx/q8_gemm_f16.cu and q8_wgmma.cu: C (+)= A @ fp16(q * d)^T, float32 sums."""
    from kestrel_stream.cuda.dense_gemm import ALL_GEMM_TILES
    tile = next(t for t in ALL_GEMM_TILES if t.name == launch.name)
    assert launch.block == (tile.threads, 1, 1) and launch.shared_bytes >= tile.shared_bytes, launch.name
    assert launch.grid[0] * tile.tokens >= T and launch.grid[1] * tile.rows >= N, (launch.grid, T, N)
    assert K % 32 == 0 and K >= 32 and N % 2 == 0, (N, K)
    assert qs % 16 == 0 and a % 16 == 0 and lda % 8 == 0 and scales % 2 == 0, "16-byte cp.async misaligned"
    assert c % 8 == 0 and ldc % 2 == 0, f"float2 stores misaligned (c {c:#x}, ldc {ldc})"
    w = dev(qs, N * K, np.int8).reshape(N, K // 32, 32).astype(np.float32)
    d = dev(scales, 2 * N * (K // 32), np.float16).reshape(N, K // 32, 1).astype(np.float32)
    product = (strided(a, T, lda, K, np.float16).astype(np.float32)
               @ (w * d).reshape(N, K).astype(np.float16).astype(np.float32).T)
    out = strided(c, T, ldc, N, np.float32)
    out[:] = out + product if accumulate else product


class FakeCublas:
    """cuda/cublas.Cublas on the emulated device: fp16 operands, float32 products and sums."""
    path, version_text = "emulated", "emulated"

    def __init__(self):
        self.workspace, self.workspace_bytes, self.gemms = 0, 0, 0

    def use_workspace(self, address: int, nbytes: int) -> None:
        dev(address, nbytes)
        self.workspace, self.workspace_bytes = address, nbytes

    def gemm_nt(self, stream, rows, cols, depth, a, lda, b, ldb, c, ldc, accumulate=False) -> None:
        assert self.workspace, "cuBLAS without a workspace of ours allocates inside a graph capture"
        strided(a, rows, lda, depth, np.float16), strided(b, cols, ldb, depth, np.float16)
        strided(c, rows, ldc, cols, np.float32)
        self.gemms += 1

        def run():
            product = (strided(a, rows, lda, depth, np.float16).astype(np.float32)
                       @ strided(b, cols, ldb, depth, np.float16).astype(np.float32).T)
            out = strided(c, rows, ldc, cols, np.float32)
            out[:] = out + product if accumulate else product
        stream.enqueue("run", run)

    def destroy(self) -> None:
        self.workspace = 0


DENSE_KERNELS = [
    (r"q8_dequant_f16", q8_dequant_f16),
    (r"(q4_0|q4_k|q6_k)(_q6_k)?_dequant_f16", block_dequant_f16),
    (r"gemm_input_f16", gemm_input_f16),
    (r"q8_gemm_f16_\d+x\d+_w\dx\d_s\d|q8_wgmma_\d+x\d+_s\d", q8_gemm_f16),
    (r"gemm_epilogue(_silu)?", gemm_epilogue),
]
