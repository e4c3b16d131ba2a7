"""The emulated device's twins of kernels_ptx/q8_gemv_hmma.cu, q4k_gemv_hmma.cu and q6k_gemv_hmma.cu (the fp16
tensor-core GEMVs of 2..16 tokens)."""
import numpy as np

from fake_kernels import f32, gemv_epilogues, q8_dense, rows
from kestrel_stream.cuda import gemv_variants


def split_x(xs: np.ndarray) -> np.ndarray:
    """float32 x -> hi + lo as the kernel feeds them: hi = x with its low 13 mantissa bits cleared (exact in
    fp16), lo = fp16(x - hi)."""
    hi = (xs.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)
    return hi.astype(np.float16).astype(np.float32) + (xs - hi).astype(np.float16).astype(np.float32)


def q8_hmma(launch, *args) -> None:
    """q8_gemv_hmma.cu: x * inv_rms_in as hi + lo fp16 parts against the exact Q8_0 weights, fp32 sums."""
    most, variant, silu = gemv_variants.parse_hmma(launch.name)
    x, ldx, inv_rms_in, N, K, ntok = args[2], args[3], args[4], args[13], args[14], args[15]
    assert launch.block == (variant.threads, 1, 1) and launch.grid[1:] == (1, 1), launch.name
    assert launch.grid[0] * variant.rows >= N, f"{launch.name}: grid {launch.grid} misses rows of {N}"
    assert 1 <= ntok <= most and (most == 8 or ntok > 8), f"{launch.name}: {ntok} tokens"
    assert K % 32 == 0 and args[0] % 8 == 0 and args[1] % 2 == 0, f"{launch.name}: 8-byte weight loads misaligned"
    unroll = variant.unroll      # a row's U scales in one load where its block count is a multiple of U
    assert (K // 32) % unroll or args[1] % (2 * unroll) == 0, f"{launch.name}: scale vector loads misaligned"
    assert all((x + 4 * m * ldx) % 16 == 0 for m in range(ntok)), f"{launch.name}: x rows not 16-byte aligned"
    xs = rows(x, ntok, ldx, K).astype(np.float32)
    if inv_rms_in:
        xs = xs * f32(inv_rms_in, ntok)[:, None]
    s = split_x(xs) @ q8_dense(args[0], args[1], N, K).T
    gemv_epilogues(launch, s, 0, *args[5:13], N, ntok, tokens=ntok, silu=silu, sums=True, tickets=1, sum_floats=16)


def block_hmma(launch, *args) -> None:
    """q4k_ / q6k_gemv_hmma.cu: x * inv_rms_in as hi + lo fp16 parts against the weight (levels exact, each
    sub-block's or group's sums times d sc, for Q4_K less dmin m times its sum of the same x): the dequantized
    weight's product."""
    from fake_block_kernels import part_blocks
    from kestrel_stream.model.quant4 import dequantize_blocks
    fmt, most, variant, silu = gemv_variants.parse_hmma_block(launch.name)
    qs, meta, x, ldx, inv_rms_in, N, K, ntok = args[0], args[1], args[2], args[3], args[4], args[13], args[14], args[15]
    assert launch.block == (variant.threads, 1, 1) and launch.grid[1:] == (1, 1), launch.name
    assert launch.grid[0] * variant.rows >= N, f"{launch.name}: grid {launch.grid} misses rows of {N}"
    assert 1 <= ntok <= most and (most == 8 or ntok > 8), f"{launch.name}: {ntok} tokens"
    assert K % 256 == 0 and qs % 8 == 0 and meta % (16 if fmt == "Q4_K" else 2) == 0, \
        f"{launch.name}: K {K}, qs {qs:#x}, meta {meta:#x}"
    assert all((x + 4 * m * ldx) % 16 == 0 for m in range(ntok)), f"{launch.name}: x rows not 16-byte aligned"
    xs = rows(x, ntok, ldx, K).astype(np.float32)
    if inv_rms_in:
        xs = xs * f32(inv_rms_in, ntok)[:, None]
    w = dequantize_blocks(part_blocks(qs, meta, fmt, N, K).reshape(-1, {"Q4_K": 144, "Q6_K": 210}[fmt]), fmt).reshape(N, K)
    s = split_x(xs) @ w.T
    gemv_epilogues(launch, s, 0, *args[5:13], N, ntok, tokens=ntok, silu=silu, sums=True, tickets=1, sum_floats=16)


HMMA_KERNELS = [(r"q8_hmma_t(8|16)_k\d+u\d+(r\d+)?p?(_silu)?", q8_hmma), (r"q[46]k_hmma_t(8|16)_k\d+(r\d+)?p?(_silu)?", block_hmma)]
