"""Q8_0 quantization: group-32 int8 with one fp16 scale per group.

Byte-compatible with GGUF Q8_0, whose 34-byte block is ``fp16 d`` followed by
32 ``int8 qs``.  We keep a tensor split into two arrays -- ``qs`` [N, K] int8
and ``scales`` [N, K/32] fp16 -- because the 34-byte block defeats 16-byte
loads on the GPU; the split is lossless in both directions.

Quantization follows ggml's ``quantize_row_q8_0_ref`` exactly:
    d  = max|x| / 127            (float32)
    q  = roundf(x * (1/d))       (half away from zero; 0 where d == 0)
    stored d = fp16(d)
so a tensor quantized here equals the one ``gguf`` writes, byte for byte.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32                 # elements per Q8_0 block
BLOCK_BYTES = 2 + GROUP    # fp16 scale + 32 int8


@dataclass
class QTensor:
    """A Q8_0 weight: qs [N, K] int8, scales [N, K/GROUP] float16 (row-major, rows = outputs)."""
    qs: np.ndarray
    scales: np.ndarray

    def __post_init__(self):
        assert self.qs.dtype == np.int8 and self.qs.ndim == 2
        assert self.scales.dtype == np.float16
        assert self.scales.shape == (self.qs.shape[0], self.qs.shape[1] // GROUP)

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.scales.nbytes

    def rows(self, start: int, stop: int) -> "QTensor":
        """Rows [start, stop) as views (a Q8_0 row is independent of the others)."""
        return QTensor(self.qs[start:stop], self.scales[start:stop])

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: qs * scale, the value every executor computes with."""
        n, k = self.qs.shape
        # np.asarray: a plain array even from a memory-mapped file (a memmap result would carry its
        # Python-level finalizer into every product computed with it)
        out = np.asarray(self.qs).reshape(n, k // GROUP, GROUP).astype(np.float32)
        out *= np.asarray(self.scales).astype(np.float32)[:, :, None]
        return out.reshape(n, k)

    def dequantize_rows(self, index: np.ndarray) -> np.ndarray:
        """float32 [len(index), K] for selected rows (embedding lookup)."""
        n = len(index)
        k = self.qs.shape[1]
        out = np.asarray(self.qs)[index].reshape(n, k // GROUP, GROUP).astype(np.float32)
        out *= np.asarray(self.scales)[index].astype(np.float32)[:, :, None]
        return out.reshape(n, k)

    def copy_into(self, qs_out: np.ndarray, scales_out: np.ndarray) -> None:
        """The split layout into qs_out [N, K] int8 and scales_out [N, K/32] fp16 (any strides)."""
        qs_out[...] = self.qs
        scales_out[...] = self.scales

    def to_blocks(self) -> np.ndarray:
        """GGUF Q8_0 bytes: uint8 [N, K/32 * 34]."""
        n, k = self.qs.shape
        blocks = np.empty((n, k // GROUP, BLOCK_BYTES), dtype=np.uint8)
        blocks[:, :, :2] = self.scales.reshape(n, k // GROUP, 1).view(np.uint8)
        blocks[:, :, 2:] = self.qs.reshape(n, k // GROUP, GROUP).view(np.uint8)
        return blocks.reshape(n, -1)

    @classmethod
    def from_blocks(cls, blocks: np.ndarray, shape: tuple[int, int]) -> "QTensor":
        """Split GGUF Q8_0 bytes (any uint8 array holding N*K/32 blocks) into qs and scales."""
        from kestrel_stream.obs.load_stages import stage
        n, k = shape
        with stage("  Q8_0 split into qs/scales"):     # one strided copy each, straight from the mmap
            b = np.asarray(blocks, dtype=np.uint8).reshape(n, k // GROUP, BLOCK_BYTES)
            scales = np.ascontiguousarray(b[:, :, :2]).view(np.float16).reshape(n, k // GROUP)
            qs = np.ascontiguousarray(b[:, :, 2:]).view(np.int8).reshape(n, k)
        return cls(qs, scales)

    @classmethod
    def concat(cls, parts: list["QTensor"]) -> "QTensor":
        """Row-wise concatenation (load-time fusion of Q,K,V or gate,up): exact, no requantization."""
        return cls(np.concatenate([p.qs for p in parts]), np.concatenate([p.scales for p in parts]))


def _roundf(x: np.ndarray) -> np.ndarray:
    """C roundf: half away from zero (np.round rounds half to even)."""
    return np.trunc(x + np.copysign(np.float32(0.5), x))


def quantize(w: np.ndarray, rows_per_chunk: int = 4096) -> QTensor:
    """Quantize float [N, K] (K % 32 == 0) to Q8_0, chunked to bound temporary memory."""
    n, k = w.shape
    assert k % GROUP == 0, f"K={k} is not a multiple of {GROUP}"
    qs = np.empty((n, k), dtype=np.int8)
    scales = np.empty((n, k // GROUP), dtype=np.float16)
    for start in range(0, n, rows_per_chunk):
        stop = min(n, start + rows_per_chunk)
        blocks = np.asarray(w[start:stop], dtype=np.float32).reshape(stop - start, k // GROUP, GROUP)
        d = np.abs(blocks).max(axis=2, keepdims=True) / np.float32(127)
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
        qs[start:stop] = _roundf(blocks * inv).reshape(stop - start, k).astype(np.int8)
        scales[start:stop] = d.reshape(stop - start, k // GROUP).astype(np.float16)
    return QTensor(qs, scales)
