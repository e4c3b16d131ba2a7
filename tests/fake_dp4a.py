"""numpy twin of the one-token dp4a GEMV layouts (kernels_ptx/q4_gemv_dp4a.cuh, the d variants of
cuda/q4_gemv_variants.py), for fake_block_kernels.

What the kernel computes: x quantised per 32-block in two int8 levels (d = amax / 127, t = x / d as
x * (1/d), hi = rn(t), lo = rn(128 (t - hi)), the block's sum of those quantised x), then per row and
32-block (Q6_K: 16) the exact integer G = sum level (128 hi + lo) and the float math
  Q4_K: s d/128 G - o sum,   Q4_0: d_w (d/128 G - 8 sum),   Q6_K: s (d/128 G - 32 sum16).  The launch is checked
against the layout: threads, the grid (a block per tile, capped at blocks_per_sm per SM) and the dynamic
shared bytes.
"""
from __future__ import annotations

import numpy as np

from kestrel_stream.cuda import q4_gemv_variants
from quant4_reference import group_form

ROUND = np.float32(12582912.0)   # 1.5 * 2^23: the kernel's DP4A_ROUND


def quantize_x(x: np.ndarray) -> tuple[np.ndarray, ...]:
    """x [K] → (hi, lo int64 [K'/32, 32], d / 128 float32 [K'/32], sum float32 [K'/32]: of the quantised
    block, d / 128 * sum(128 hi + lo), the same per 16 [K'/16]), K' = K padded to a multiple of 64 with zeros
    (the kernel's D-units)."""
    padded = np.zeros(-(-x.size // 64) * 64, np.float32)
    padded[:x.size] = x
    blocks = padded.reshape(-1, 32)
    d = np.abs(blocks).max(axis=1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)[:, None]
    t = blocks * inv
    hi = (t + ROUND) - ROUND                                             # rn, ties to even
    lo = ((t - hi) * np.float32(128) + ROUND) - ROUND                    # t - hi and the 128 exact: one rounding
    assert np.abs(hi).max(initial=0) <= 127 and np.abs(lo).max(initial=0) <= 127
    unit = d * np.float32(1 / 128)
    big = (128 * hi.astype(np.int64) + lo.astype(np.int64)).reshape(-1, 2, 16).sum(axis=2)   # [B, 2]: per 16
    sums = unit * big.sum(axis=1).astype(np.float32)
    sums16 = unit[:, None] * big.astype(np.float32)
    return hi.astype(np.int64), lo.astype(np.int64), unit, sums, sums16.reshape(-1)


def dp4a_products(fmt: str, blocks: np.ndarray, x: np.ndarray, K: int) -> np.ndarray:
    """One format part's rows times one token's x [K] as the kernel computes them: float32 [rows]."""
    hi, lo, dx, xsum, xsum16 = quantize_x(x)
    n_blocks = K // 32
    levels, s, o = group_form(blocks, fmt, K)                            # weight = s level - o per 16
    if fmt == "Q6_K":                                                    # a scale per 16, levels q - 32
        q = levels.astype(np.int64).reshape(-1, 2 * n_blocks, 16) + 32
        big_x = (128 * hi + lo)[:n_blocks].reshape(2 * n_blocks, 16)
        dots = np.einsum("ngk,gk->ng", q, big_x).astype(np.float32)
        unit16 = np.repeat(dx[:n_blocks], 2)[None, :]
        terms = s * (unit16 * dots - np.float32(32) * xsum16[None, :2 * n_blocks])
        return terms.astype(np.float32).sum(axis=1, dtype=np.float64).astype(np.float32)
    q = levels.astype(np.int64) + (8 if fmt == "Q4_0" else 0)          # the nibbles as stored
    big_x = (128 * hi + lo)[:n_blocks]                                   # [B, 32]
    dots = np.einsum("nbk,bk->nb", q.reshape(-1, n_blocks, 32), big_x)  # exact integers
    assert np.abs(dots).max(initial=0) < 2 ** 31
    dots_f = dots.astype(np.float32)
    dx, xsum = dx[None, :n_blocks], xsum[None, :n_blocks]
    if fmt == "Q4_K":                                                    # s, o per 32: one sub-block
        terms = (s[:, 0::2] * dx) * dots_f - o[:, 0::2] * xsum
    else:
        terms = s[:, 0::2] * (dx * dots_f - np.float32(8) * xsum)
    return terms.astype(np.float32).sum(axis=1, dtype=np.float64).astype(np.float32)


def q4_gemv_dp4a(launch, *args) -> None:
    import fake_kernels as fk
    from fake_block_kernels import parts
    x, N, K, ntok, rows_a = args[2], args[13], args[14], args[15], args[18]
    code, m, variant, silu = q4_gemv_variants.parse(launch.name)
    layout = q4_gemv_variants.M1_VARIANTS[variant]
    assert m == 1 and ntok == 1, f"{launch.name} for {ntok} tokens"
    assert launch.block == (layout.threads, 1, 1) and launch.grid[1:] == (1, 1), launch.name
    tiles = -(-rows_a // layout.rows) + -(-(N - rows_a) // layout.rows)
    grid = launch.grid[0]   # a block per tile, or blocks_per_sm times the device's SMs
    assert grid == tiles or (grid < tiles and grid % layout.blocks_per_sm == 0), f"{launch.name}: grid {grid}"
    assert launch.shared_bytes == q4_gemv_variants.dp4a_shared_bytes(code, K), \
        f"{launch.name}: {launch.shared_bytes} bytes of dynamic shared for K={K}"
    assert not silu or layout.rows % 2 == 0, f"{launch.name}: (gate, up) pairs split across tiles"
    assert x % 16 == 0, f"{launch.name}: x not 16-byte aligned"
    xs = fk.rows(x, 1, K, K)[0].copy()
    s = np.concatenate([dp4a_products(fmt, blocks, xs, K) for fmt, blocks in parts(launch.name, args)])[None, :]
    fk.gemv_epilogues(launch, s, *args[4:13], N, 1, 1, bool(silu), sums=True, tickets=1)
