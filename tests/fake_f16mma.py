"""numpy twin of kernels_ptx/q8_mma_f16_ws.cu (the fp16 tensor-core GEMM of prefill-sized steps without the dense path).

Weights dequantised to fp16 as fp16(q * d), activations (times inv_rms_in, when given) rounded to fp16,
products summed in float32, then the epilogues every GEMV/GEMM kernel shares (fake_kernels.gemv_epilogues).
"""
from __future__ import annotations

import numpy as np

from fake_cuda import dev
from kestrel_stream.cuda import mma_variants


def f16_weights(wq: np.ndarray, w_scales: np.ndarray) -> np.ndarray:
    """int8 [N, K] and fp16 scales [N, K/32] -> fp16 [N, K]: each q * d (exact in float32) rounded once."""
    n, k = wq.shape
    products = wq.reshape(n, k // 32, 32).astype(np.float32) * w_scales.astype(np.float32)[:, :, None]
    return products.reshape(n, k).astype(np.float16)


def f16mma_product(x: np.ndarray, wq: np.ndarray, w_scales: np.ndarray, inv_rms=None) -> np.ndarray:
    """x [T, K] float32 (times inv_rms [T] per token, before the rounding) against a Q8_0 weight as
    q8_mma_f16_ws.cu computes it: [T, N] float32."""
    if inv_rms is not None:
        x = x * inv_rms.astype(np.float32)[:, None]
    x16 = x.astype(np.float16).astype(np.float32)
    return x16 @ f16_weights(wq, w_scales).astype(np.float32).T   # fp16 x fp16 products are exact in fp32


def q8_f16mma(launch, *args) -> None:
    from fake_kernels import gemv_epilogues, rows
    qs, scales, x, ldx, inv_rms_in, y, ldy, res, normw_out, xn_out, inv_rms_out, counter, eps, N, K, ntok = args
    tile, silu = mma_variants.f16_parse(launch.name)
    assert launch.block == (tile.threads, 1, 1), f"{launch.name}: block {launch.block}"
    assert launch.shared_bytes == tile.shared_bytes, f"{launch.name}: {launch.shared_bytes} bytes of dynamic shared"
    assert launch.grid[0] * tile.rows >= N and launch.grid[1] * tile.tokens >= ntok and launch.grid[2] == 1, \
        f"{launch.name}: grid {launch.grid} misses part of {ntok} tokens x {N} rows"
    assert ldx % 4 == 0 and x % 16 == 0, f"{launch.name}: float4 loads of x misaligned (x {x:#x}, ldx {ldx})"
    assert K % 32 == 0 and qs % 16 == 0 and scales % 2 == 0, f"{launch.name}: 16-byte cp.async of weights misaligned"
    s = f16mma_product(rows(x, ntok, ldx, K), dev(qs, N * K, np.int8).reshape(N, K),
                       dev(scales, 2 * N * (K // 32), np.float16).reshape(N, K // 32),
                       dev(inv_rms_in, 4 * ntok, np.float32) if inv_rms_in else None)
    gemv_epilogues(launch, s, 0, y, ldy, res, normw_out, xn_out, inv_rms_out, counter, eps, N, ntok,   # inv_rms_in: in x
                   ntok, silu, sums=False, tickets=launch.grid[1] if launch.grid[1] <= 8 else 1)
