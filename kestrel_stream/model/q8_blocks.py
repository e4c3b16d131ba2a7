"""A Q8_0 weight left in GGUF's own 34-byte blocks, as views of the file's memory map.

A GGUF Q8_0 tensor is [N, K/32] blocks of ``fp16 d`` then 32 ``int8 qs``.  The
kernels want the split layout (model/quant.py), but every consumer copies the
weight once anyway -- the device image is written into pinned memory, the CPU
engine dequantizes to float32 -- so the split is done by that one copy, reading
the blocks where they lie in the page cache.  The load itself copies nothing.

A fused weight (QKV, gate+up) is a list of row segments, one per file tensor;
``rows`` slices them without a copy.  Anything that asks for ``qs`` or
``scales`` (the split modes' weight cache, the quantized cache) gets them
built once, on first use, and kept.

The memory map must stay as it is while the model runs: like llama.cpp's mmap
loading, a file truncated or rewritten under a running engine is undefined.
"""
from __future__ import annotations

import numpy as np

from kestrel_stream.model.quant import BLOCK_BYTES, GROUP, QTensor
from kestrel_stream.obs.load_stages import stage

Q8_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (GROUP,))])
# The same block with its 32 values as one opaque item: numpy copies a [rows, K/32] array of those at
# memcpy speed, where 32-byte int8 inner loops at a 34-byte stride run an order of magnitude slower.
QS_ITEM = np.dtype((np.void, GROUP))
Q8_BLOCK_ITEMS = np.dtype([("d", "<f2"), ("qs", QS_ITEM)])
assert Q8_BLOCK.itemsize == Q8_BLOCK_ITEMS.itemsize == BLOCK_BYTES


class Q8Blocks(QTensor):
    """A Q8_0 weight [N, K] as row segments of GGUF blocks, each [rows_i, K/32] of Q8_BLOCK."""

    def __init__(self, segments: list[np.ndarray]):
        assert segments and all(s.dtype == Q8_BLOCK and s.ndim == 2 for s in segments)
        assert len({s.shape[1] for s in segments}) == 1
        self.segments = segments
        self._split: tuple[np.ndarray, np.ndarray] | None = None

    @classmethod
    def from_bytes(cls, raw: np.ndarray, shape: tuple[int, int]) -> "Q8Blocks":
        """A view of GGUF Q8_0 bytes (uint8, N*K/32 blocks, e.g. from the mmap) as [N, K/32] blocks."""
        n, k = shape
        assert k % GROUP == 0 and raw.nbytes == n * k // GROUP * BLOCK_BYTES, (shape, raw.nbytes)
        return cls([np.asarray(raw, np.uint8).reshape(-1).view(Q8_BLOCK).reshape(n, k // GROUP)])

    @classmethod
    def concat(cls, parts: list[QTensor]) -> QTensor:
        """Row-wise concatenation; stays a list of views when every part is one."""
        if all(isinstance(p, Q8Blocks) for p in parts):
            return cls([s for p in parts for s in p.segments])
        return QTensor.concat(parts)

    # -- what a QTensor answers --------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        return sum(s.shape[0] for s in self.segments), self.segments[0].shape[1] * GROUP

    @property
    def nbytes(self) -> int:
        n, k = self.shape
        return n * k + n * (k // GROUP) * 2

    @property
    def qs(self) -> np.ndarray:
        return self._split_once()[0]

    @property
    def scales(self) -> np.ndarray:
        return self._split_once()[1]

    def __repr__(self) -> str:
        return f"Q8Blocks(shape={self.shape}, segments={len(self.segments)})"

    def _split_once(self) -> tuple[np.ndarray, np.ndarray]:
        if self._split is None:
            n, k = self.shape
            with stage("  Q8_0 split into qs/scales (on first use)"):
                qs, scales = np.empty((n, k), np.int8), np.empty((n, k // GROUP), np.float16)
                self.copy_into(qs, scales)
            self._split = qs, scales
        return self._split

    def rows(self, start: int, stop: int) -> "Q8Blocks":
        """Rows [start, stop) as views (of the file's blocks, or of the split arrays once they exist)."""
        assert 0 <= start < stop <= self.shape[0], (start, stop, self.shape)
        out, at = [], 0
        for s in self.segments:
            lo, hi = max(start - at, 0), min(stop - at, s.shape[0])
            if lo < hi:
                out.append(s[lo:hi])
            at += s.shape[0]
        return Q8Blocks(out)

    def copy_into(self, qs_out: np.ndarray, scales_out: np.ndarray) -> None:
        """The split layout written straight from the blocks: qs_out [N, K] int8 (rows contiguous, at any
        row stride) and scales_out [N, K/32] fp16 (any strides), one pass over the blocks."""
        assert qs_out.strides[-1] == 1, "qs_out's rows must be contiguous"
        at = 0
        for s in self.segments:
            rows = s.shape[0]
            items = s.view(Q8_BLOCK_ITEMS)
            qs_out[at:at + rows].view(QS_ITEM)[...] = items["qs"]
            scales_out[at:at + rows] = items["d"]
            at += rows

    def dequantize(self) -> np.ndarray:
        """float32 [N, K] = qs * scale, read from the blocks in one pass (the same products as QTensor's)."""
        n, k = self.shape
        out = np.empty((n, k // GROUP, GROUP), np.float32)
        at = 0
        for s in self.segments:
            rows = s.shape[0]
            np.multiply(s["qs"], s["d"].astype(np.float32)[:, :, None], out=out[at:at + rows], dtype=np.float32)
            at += rows
        return out.reshape(n, k)

    def dequantize_rows(self, index: np.ndarray) -> np.ndarray:
        """float32 [len(index), K] for selected rows (embedding lookup), only those rows read."""
        index = np.asarray(index)
        n, k = self.shape
        blocks = self.segments[0] if len(self.segments) == 1 else np.concatenate(self.segments)
        picked = blocks[index]
        out = np.multiply(picked["qs"], picked["d"].astype(np.float32)[:, :, None], dtype=np.float32)
        return out.reshape(len(index), k)

    def to_blocks(self) -> np.ndarray:
        n, _ = self.shape
        return np.concatenate(self.segments).view(np.uint8).reshape(n, -1)
