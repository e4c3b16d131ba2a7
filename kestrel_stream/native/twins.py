"""The host kernels' arithmetic in numpy: the scalar twins the tests hold the C against.

Each quantized matmul quantizes its activations per block as the C does (bit for bit, two int8 levels:
x ~ d * (hi + lo / 128)), takes the integer dot product 128 * dot(w, hi) + dot(w, lo) of every (sub-)block
exactly, and forms each block's float32 term in the C's
order; only the sum over blocks differs in order (here float64).  The float ops' twins are
run/host.py's numpy functions themselves.
"""
from __future__ import annotations

import numpy as np

from kestrel_stream.model.quant4 import q4k_scale_min


def _roundf(x: np.ndarray) -> np.ndarray:
    return np.trunc(x + np.copysign(np.float32(0.5), x))


def quantize_activations(x: np.ndarray, group: int) -> tuple:
    """x float32 [T, K] → (hi int8 [T, K], lo int8 [T, K], d float32 [T, K/group], and when group is 256
    (q8_K) each level's bsums int16 [T, K/16], else None, None): d = max|x| / 127 per group, v = x * (1 / d),
    hi = round(v), lo = round((v - hi) * 128), half away from zero; x ~ d * (hi + lo / 128)."""
    x = np.asarray(x, np.float32)
    t, k = x.shape
    blocks = x.reshape(t, k // group, group)
    d = np.abs(blocks).max(axis=2) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    v = blocks * inv[:, :, None]
    hi_f = _roundf(v)
    hi = hi_f.astype(np.int8).reshape(t, k)
    lo = _roundf((v - hi_f) * np.float32(128)).astype(np.int8).reshape(t, k)
    if group != 256:
        return hi, lo, d.astype(np.float32), None, None
    bsums = [q.reshape(t, k // 16, 16).sum(axis=2, dtype=np.int32).astype(np.int16) for q in (hi, lo)]
    return hi, lo, d.astype(np.float32), bsums[0], bsums[1]


def _group_dots(a: np.ndarray, w: np.ndarray, size: int) -> np.ndarray:
    """Exact integer dot products per group of `size` values: a [T, K], w [N, K] → float64 [T, N, K/size]."""
    t, k = a.shape
    n = w.shape[0]
    a64 = a.astype(np.float64).reshape(t, k // size, size).transpose(1, 0, 2)    # [G, T, size]
    w64 = w.astype(np.float64).reshape(n, k // size, size).transpose(1, 2, 0)    # [G, size, N]
    return np.matmul(a64, w64).transpose(1, 2, 0)                                # [T, N, G]


def _joined_dots(hi: np.ndarray, lo: np.ndarray, w: np.ndarray, size: int) -> np.ndarray:
    """128 * dot(w, hi) + dot(w, lo) per group, exact (float64 holds them): [T, N, K/size]."""
    return 128 * _group_dots(hi, w, size) + _group_dots(lo, w, size)


_LO = np.float32(1 / 128)


def matmul_q8_0(x: np.ndarray, qs: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The C's ks_matmul for Q8_0: x [T, K] float32, qs int8 [N, K], scales f16 [N, K/32] → float32 [T, N]."""
    hi, lo, ad, _, _ = quantize_activations(x, 32)
    dots = _joined_dots(hi, lo, np.asarray(qs), 32)                               # [T, N, K/32]
    scale = np.asarray(scales).astype(np.float32)[None] * ad[:, None, :] * _LO   # float32, as the C
    return (scale.astype(np.float64) * dots).sum(axis=2).astype(np.float32)


def matmul_blocks(x: np.ndarray, fmt: str, blocks: np.ndarray, cols: int) -> np.ndarray:
    """The C's ks_matmul for Q4_0 / Q4_K / Q6_K blocks uint8 [N, cols/QK * bytes] → float32 [T, N]."""
    n = blocks.shape[0]
    b = np.asarray(blocks, np.uint8)
    if fmt == "Q4_0":
        hi, lo, ad, _, _ = quantize_activations(x, 32)
        b = b.reshape(n, cols // 32, 18)
        d = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)   # [N, nb]
        qs = b[:, :, 2:18]
        q = (np.concatenate([qs & 0x0F, qs >> 4], axis=2).astype(np.int8) - np.int8(8)).reshape(n, cols)
        dots = _joined_dots(hi, lo, q, 32)
        scale = d[None] * ad[:, None, :] * _LO
        return (scale.astype(np.float64) * dots).sum(axis=2).astype(np.float32)
    hi, lo, ad, bs_hi, bs_lo = quantize_activations(x, 256)
    ad = ad * _LO                                                                   # d / 128, float32
    nb = cols // 256
    bsums = 128 * bs_hi.astype(np.int64) + bs_lo.astype(np.int64)                   # both levels' sums per 16
    if fmt == "Q4_K":
        b = b.reshape(n * nb, 144)
        d = b[:, 0:2].copy().view(np.float16)[:, 0].astype(np.float32).reshape(n, nb)
        dmin = b[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float32).reshape(n, nb)
        sc, m = (v.astype(np.int64).reshape(n, nb, 8) for v in q4k_scale_min(b[:, 4:16]))
        q = ((b[:, 16:144].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F)
        dots = _joined_dots(hi, lo, q.reshape(n, cols), 32).astype(np.int64).reshape(-1, n, nb, 8)   # [T, N, nb, 8]
        sumi = (dots * sc[None]).sum(axis=3)                                                      # [T, N, nb]
        pair = bsums.reshape(-1, nb, 8, 2).sum(axis=3)                                            # [T, nb, 8]
        summ = np.einsum("tbj,nbj->tnb", pair, m)
        term = ad[:, None, :] * (d[None] * sumi.astype(np.float32) - dmin[None] * summ.astype(np.float32))
        return term.astype(np.float64).sum(axis=2).astype(np.float32)
    if fmt == "Q6_K":
        b = b.reshape(n * nb, 210)
        ql = (b[:, 0:128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        qh = (b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 0x03
        q = ql.reshape(-1, 8, 32) | (qh.reshape(-1, 8, 32) << np.uint8(4))                        # 0..63
        sc = b[:, 192:208].copy().view(np.int8).astype(np.int64).reshape(n, nb, 16)
        d = b[:, 208:210].copy().view(np.float16)[:, 0].astype(np.float32).reshape(n, nb)
        dots = _joined_dots(hi, lo, q.reshape(n, cols), 16).astype(np.int64).reshape(-1, n, nb, 16)
        offsets = 32 * np.einsum("tbg,nbg->tnb", bsums.reshape(-1, nb, 16), sc)
        sumi = (dots * sc[None]).sum(axis=3) - offsets
        term = (ad[:, None, :] * d[None]) * sumi.astype(np.float32)
        return term.astype(np.float64).sum(axis=2).astype(np.float32)
    raise ValueError(f"not a block format: {fmt}")
