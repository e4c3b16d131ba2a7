"""GGUF block types whose values are small integers times the block's f16 scale, turned into Q8_0 exactly.

A Q4_0, Q5_0 or IQ4_NL block holds 32 values: d (f16) times an integer level,
q - 8 (Q4_0, 4 bits), q - 16 (Q5_0, 4 bits and a fifth from the block's 32-bit
qh word) or IQ4_NL's table entry for q (-127..113).  Each level fits an int8,
so the Q8_0 block with the same d and those levels as its qs holds the same
values: d * level, computed as gguf-py's dequantize computes them (float32,
the same product), where the general conversion (dequantize, then quantize
again with d = max|x| / 127) rounds every value to a new step.  It is also a
byte shuffle, not float work: the 0.5B model of a Q4_K_M file whose 896-wide
rows llama-quantize keeps in Q5_0 converts in a fraction of a second.

Layouts (ggml's block_q4_0, block_q5_0, block_iq4_nl): d [0:2]; Q5_0's qh
[2:6] (bit j: value j's fifth bit); then 16 nibble bytes, byte j's low nibble
value j and its high nibble value j + 16.
"""
from __future__ import annotations

import numpy as np

from kestrel_stream.model.quant import QTensor

IQ4_NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
BLOCK_BYTES = {"Q4_0": 18, "Q5_0": 22, "IQ4_NL": 18}
EXACT_TYPES = tuple(BLOCK_BYTES)            # GGML type names


def levels(blocks: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(d float16 [n], levels int8 [n, 32]) of n blocks uint8 [n, block bytes] of an EXACT_TYPES type."""
    n = blocks.shape[0]
    d = np.ascontiguousarray(blocks[:, 0:2]).view(np.float16)[:, 0]
    qs = blocks[:, -16:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)                            # [n, 32], 0..15
    if qtype == "Q4_0":
        return d, q.astype(np.int8) - np.int8(8)
    if qtype == "Q5_0":         # qh's bits, least significant first: value j's in bit j
        q |= np.unpackbits(blocks[:, 2:6], axis=1, bitorder="little") << np.uint8(4)
        return d, q.astype(np.int8) - np.int8(16)
    if qtype == "IQ4_NL":
        return d, IQ4_NL_LEVELS[q]
    raise ValueError(f"{qtype} is not one of {', '.join(EXACT_TYPES)}")


CHUNK_VALUES = 1 << 22       # values converted at once: bounds the temporaries


def exact_q8_0(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> QTensor:
    """The [N, K] tensor of `qtype` blocks `raw` as a Q8_0 QTensor of the same values (bit for bit)."""
    rows, cols = shape
    blocks = np.asarray(raw, np.uint8).reshape(rows, cols // 32, BLOCK_BYTES[qtype])
    qs, scales = np.empty((rows, cols), np.int8), np.empty((rows, cols // 32), np.float16)
    step = max(1, CHUNK_VALUES // cols)
    for r in range(0, rows, step):
        chunk = blocks[r:r + step]
        d, q = levels(chunk.reshape(-1, BLOCK_BYTES[qtype]), qtype)
        qs[r:r + step], scales[r:r + step] = q.reshape(len(chunk), cols), d.reshape(len(chunk), -1)
    return QTensor(qs, scales)
