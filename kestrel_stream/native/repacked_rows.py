"""Where a row's block bytes sit in host_kquants.c's repacked groups of 16 rows (its layouts' twin), for
reading a repacked weight's rows back out as the file stores them (kernels.PreparedWeight.file_rows)."""
from __future__ import annotations

import numpy as np

REPACK_ROWS = 16


def repacked_source(fmt: str) -> np.ndarray:
    """Where byte j of row r's block is in a repacked group's block (host_kquants.c's layouts, its
    twin): int [16 rows, block bytes]."""
    if fmt not in SOURCES:
        r = np.arange(REPACK_ROWS)[:, None]
        if fmt == "Q4_K":       # d, dmin f16 at 2240, 2272; 12 scale bytes at 2048 (16 apart); quants 4 at a time
            j = np.arange(4, 16)
            parts = [2240 + 2 * r + np.arange(2), 2272 + 2 * r + np.arange(2), 2048 + 16 * (j - 4) + r]
            j = np.arange(16, 144)
            parts.append(64 * ((j - 16) // 4) + 4 * r + (j - 16) % 4)
        else:                   # Q6_K: ql 4 at a time, qh at 2048, 16 scales at 3072, d at 3328
            j = np.arange(128)
            parts = [64 * (j // 4) + 4 * r + j % 4, 2048 + 64 * (j[:64] // 4) + 4 * r + j[:64] % 4]
            parts += [3072 + 16 * np.arange(16) + r, 3328 + 2 * r + np.arange(2)]
        SOURCES[fmt] = np.concatenate([np.broadcast_to(p, (REPACK_ROWS, p.shape[-1])) for p in parts], axis=1)
    return SOURCES[fmt]


SOURCES: dict[str, np.ndarray] = {}
