"""numpy oracles of the 4/6-bit block images for the tests: the kernels' groups of 16 (group_form) and
the GGUF blocks back from an image's qs and meta parts (join_blocks, split_blocks' inverse)."""
from __future__ import annotations

import numpy as np

from kestrel_stream.model.quant4 import SPLITS, _f16, q4k_scale_min
from scheduler.ops import BLOCK_FORMATS


def group_form(blocks: np.ndarray, fmt: str, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernels' view of a block tensor: (levels int8 [N, K], s float32 [N, K/16], o float32 [N, K/16])
    with weight = s * level - o per group of 16 (Q4_0: level q - 8, s = d; Q4_K: level q, s = d*sc,
    o = dmin*m; Q6_K: level q - 32, s = d*sc)."""
    n = blocks.shape[0]
    elements, nbytes = BLOCK_FORMATS[fmt]
    b = np.asarray(blocks, np.uint8).reshape(-1, nbytes)
    if fmt == "Q4_0":
        qs = b[:, 2:18]
        levels = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int8) - np.int8(8)
        s = np.repeat(_f16(b[:, 0:2]), 2, axis=1)
        o = np.zeros_like(s)
    elif fmt == "Q4_K":
        qs = b[:, 16:144].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        levels = (qs & 0x0F).reshape(-1, 256).astype(np.int8)
        sc, m = q4k_scale_min(b[:, 4:16])
        s = np.repeat(_f16(b[:, 0:2]) * sc.astype(np.float32), 2, axis=1)
        o = np.repeat(_f16(b[:, 2:4]) * m.astype(np.float32), 2, axis=1)
    elif fmt == "Q6_K":
        ql = b[:, 0:128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        levels = (((ql & 0x0F).reshape(-1, 8, 32) | ((qh & 0x03).reshape(-1, 8, 32) << np.uint8(4))).astype(np.int8)
                  - np.int8(32)).reshape(-1, 256)
        s = _f16(b[:, 208:210]) * np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
        o = np.zeros_like(s)
    else:
        raise ValueError(f"not a block format: {fmt}")
    return levels.reshape(n, cols), s.reshape(n, cols // 16), o.reshape(n, cols // 16)


def join_blocks(qs: np.ndarray, meta: np.ndarray, fmt: str, cols: int) -> np.ndarray:
    """split_blocks' inverse: GGUF blocks uint8 [rows, nb * block_bytes] from the image's parts."""
    elements, nbytes = BLOCK_FORMATS[fmt]
    (q0, q1), (m0, m1) = SPLITS[fmt]
    rows, nb = qs.shape[0], cols // elements
    out = np.empty((rows, nb, nbytes), np.uint8)
    out[:, :, q0:q1] = qs.reshape(rows, nb, q1 - q0)
    out[:, :, m0:m1] = meta.reshape(rows, nb, m1 - m0)
    return out.reshape(rows, -1)
