"""4- and 6-bit GGUF block formats kept as blocks: Q4_0, Q4_K, Q6_K.

A ``BlockTensor`` holds a [N, K] weight as the file's own blocks, uint8
[N, K/QK * block_bytes] (QK = 32 for Q4_0, 256 for the K-quants); every block
lies inside one row, so row slices, row permutations (llama's q/k order) and
row concatenations (fused QKV, gate+up) are exact on the bytes.  The device
image of any block format (also Q8_0) is the split ``qs | meta``: the quant
bytes of every block, then, at the next 256-byte boundary, the scale bytes of
every block.  Each part is a contiguous byte range of the GGUF block:

    Q4_0 (18 B / 32):  meta = d f16 [0:2]               qs = 16 nibble bytes [2:18]
    Q4_K (144 B / 256): meta = d, dmin f16, 12 packed 6-bit scales/mins [0:16]   qs = [16:144]
    Q6_K (210 B / 256): qs = ql [0:128], qh [128:192]   meta = 16 int8 scales, d f16 [192:210]

Dequantization is gguf-py's arithmetic in the same float32 order (so equal bit
for bit, tests/test_quant4.py): Q4_0 d*(q-8); Q4_K (d*sc)*q - (dmin*m) per 32;
Q6_K (d*sc)*(q-32) per 16.  A fused weight whose parts have two formats (QKV
of a Q4_K_M file, whose attn_v is Q6_K in some layers) is a ``RowStack``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kestrel_stream.model.exact_q8 import EXACT_TYPES, exact_q8_0
from kestrel_stream.model.quant import QTensor, quantize
from scheduler.ops import BLOCK_FORMATS

BLOCK_TYPES = ("Q4_0", "Q4_K", "Q6_K")
# format → ((qs start, stop), (meta start, stop)) within one GGUF block
SPLITS = {"Q8_0": ((2, 34), (0, 2)), "Q4_0": ((2, 18), (0, 2)), "Q4_K": ((16, 144), (0, 16)),
          "Q6_K": ((0, 192), (192, 210))}
IMAGE_ALIGN = 256            # the meta part starts at this boundary (run/device/budget.ALIGN)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def dequantize_blocks(blocks: np.ndarray, fmt: str) -> np.ndarray:
    """float32 [n, QK] of n GGUF blocks uint8 [n, block_bytes]."""
    n = blocks.shape[0]
    if fmt == "Q4_0":
        d = _f16(blocks[:, 0:2])                                                      # [n, 1]
        qs = blocks[:, 2:18]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int8) - np.int8(8)
        return d * q.astype(np.float32)
    if fmt == "Q4_K":
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, m = q4k_scale_min(blocks[:, 4:16])
        qs = blocks[:, 16:144].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(n, 8, 32).astype(np.float32)
        return ((d * sc.astype(np.float32))[:, :, None] * q - (dmin * m.astype(np.float32))[:, :, None]).reshape(n, 256)
    if fmt == "Q6_K":
        ql = blocks[:, 0:128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        ql = (ql & 0x0F).reshape(n, 8, 32)
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        qh = (qh & 0x03).reshape(n, 8, 32)
        q = ((ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, 16, 16).astype(np.float32)
        scale = _f16(blocks[:, 208:210]) * np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
        return (scale[:, :, None] * q).reshape(n, 256)
    raise ValueError(f"not a block format: {fmt}")


def q4k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of Q4_K super-blocks from their 12 packed bytes [n, 12] (ggml's
    get_scale_min_k4): j < 4: sc = q[j] & 63, m = q[j+4] & 63; else the low nibbles of q[j+4] with
    the top two bits of q[j-4] (sc) or q[j] (m)."""
    q = packed.reshape(-1, 3, 4)
    lo, hi, mix = q[:, 0], q[:, 1], q[:, 2]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    m = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=1)
    return sc, m


@dataclass
class BlockTensor:
    """A [rows, cols] weight in one block format, as GGUF blocks: uint8 [rows, cols/QK * block_bytes]."""
    fmt: str
    blocks: np.ndarray
    cols: int

    def __post_init__(self):
        elements, nbytes = BLOCK_FORMATS[self.fmt]
        assert self.fmt in BLOCK_TYPES and self.blocks.dtype == np.uint8 and self.blocks.ndim == 2
        assert self.cols % elements == 0 and self.blocks.shape[1] == self.cols // elements * nbytes, \
            (self.fmt, self.blocks.shape, self.cols)

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.cols

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    @property
    def formats(self) -> tuple[str, ...]:
        return (self.fmt,)

    def rows(self, start: int, stop: int) -> "BlockTensor":
        return BlockTensor(self.fmt, self.blocks[start:stop], self.cols)

    def take(self, order: np.ndarray) -> "BlockTensor":
        """Rows in `order` (a permutation or a selection): exact, the rows' bytes move whole."""
        return BlockTensor(self.fmt, np.ascontiguousarray(np.asarray(self.blocks)[order]), self.cols)

    def _block_view(self, blocks: np.ndarray) -> np.ndarray:
        elements, nbytes = BLOCK_FORMATS[self.fmt]
        return np.asarray(blocks, np.uint8).reshape(-1, nbytes)

    def dequantize(self, rows_per_chunk: int = 1024) -> np.ndarray:
        """float32 [rows, cols], gguf-py's values."""
        n, k = self.shape
        out = np.empty((n, k), np.float32)
        for start in range(0, n, rows_per_chunk):
            stop = min(n, start + rows_per_chunk)
            out[start:stop] = dequantize_blocks(self._block_view(self.blocks[start:stop]), self.fmt).reshape(-1, k)
        return out

    def dequantize_rows(self, index: np.ndarray) -> np.ndarray:
        """float32 [len(index), cols] of selected rows (embedding lookup)."""
        return dequantize_blocks(self._block_view(np.asarray(self.blocks)[index]), self.fmt).reshape(len(index), -1)

    def split(self) -> tuple[np.ndarray, np.ndarray]:
        """(qs uint8 [rows, nb * qs bytes], meta uint8 [rows, nb * meta bytes]): the device image's parts."""
        return split_blocks(self.blocks, self.fmt, self.cols)

    def to_q8(self) -> QTensor:
        """As Q8_0: Q4_0 exactly (model/exact_q8.py); the K-quants requantized (lossy: their values are not an
        int8 times one scale per 32)."""
        if self.fmt in EXACT_TYPES:
            return exact_q8_0(self.blocks, self.fmt, self.shape)
        return quantize(_Dequantized(self), rows_per_chunk=1024)


class _Dequantized:
    """A BlockTensor seen as float32 row chunks, for ``quantize``."""

    def __init__(self, t: BlockTensor):
        self.t, self.shape = t, t.shape

    def __getitem__(self, rows: slice) -> np.ndarray:
        return self.t.rows(rows.start, rows.stop).dequantize()


def split_blocks(blocks: np.ndarray, fmt: str, cols: int) -> tuple[np.ndarray, np.ndarray]:
    elements, nbytes = BLOCK_FORMATS[fmt]
    (q0, q1), (m0, m1) = SPLITS[fmt]
    b = np.asarray(blocks, np.uint8).reshape(blocks.shape[0], cols // elements, nbytes)
    return (np.ascontiguousarray(b[:, :, q0:q1]).reshape(blocks.shape[0], -1),
            np.ascontiguousarray(b[:, :, m0:m1]).reshape(blocks.shape[0], -1))


def split_q8(w: QTensor) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(w.qs).view(np.uint8), np.asarray(w.scales).view(np.uint8)


@dataclass
class RowStack:
    """Rows of two block formats, one run each: rows [0, head.rows) of `head`, the rest of `tail`."""
    head: BlockTensor
    tail: BlockTensor

    def __post_init__(self):
        assert self.head.cols == self.tail.cols and self.head.fmt != self.tail.fmt

    @property
    def shape(self) -> tuple[int, int]:
        return self.head.shape[0] + self.tail.shape[0], self.head.cols

    @property
    def nbytes(self) -> int:
        return self.head.nbytes + self.tail.nbytes

    @property
    def formats(self) -> tuple[str, ...]:
        return self.head.fmt, self.tail.fmt

    @property
    def parts(self) -> tuple[BlockTensor, BlockTensor]:
        return self.head, self.tail

    def dequantize(self) -> np.ndarray:
        return np.concatenate([self.head.dequantize(), self.tail.dequantize()])

    def to_q8(self) -> QTensor:
        return QTensor.concat([self.head.to_q8(), self.tail.to_q8()])


def tensor_parts(w) -> list:
    """The single-format runs of rows of any linear weight, in row order."""
    return list(w.parts) if isinstance(w, RowStack) else [w]


def tensor_format(w) -> str:
    """Q8_0 | Q4_0 | Q4_K | Q6_K of a single-format weight."""
    return "Q8_0" if isinstance(w, QTensor) else w.fmt


def fuse_rows(parts: list, allow_stack: bool = True):
    """Row-wise concatenation of projections sharing an input (QKV, gate+up), exact where it can be:
    one format → that format; two runs of block formats → a RowStack (unless `allow_stack` is False:
    gate+up, whose rows the SiLU epilogue reads in (gate j, up j) pairs); anything else (Q8_0 beside a
    block format, three runs) → every part as Q8_0 (Q4_0 exactly, the K-quants requantized)."""
    if all(isinstance(p, QTensor) for p in parts):
        return type(parts[0]).concat(parts)     # views of a GGUF file's Q8_0 blocks stay views
    runs: list[list] = []
    for p in parts:
        if runs and isinstance(p, BlockTensor) and isinstance(runs[-1][0], BlockTensor) and runs[-1][0].fmt == p.fmt:
            runs[-1].append(p)
        else:
            runs.append([p])
    joined = [BlockTensor(run[0].fmt, np.concatenate([np.asarray(p.blocks) for p in run]), run[0].cols)
              if isinstance(run[0], BlockTensor) else None for run in runs]
    if len(joined) == 1 and joined[0] is not None:
        return joined[0]
    if allow_stack and len(joined) == 2 and all(j is not None for j in joined):
        return RowStack(*joined)
    return QTensor.concat([p if isinstance(p, QTensor) else p.to_q8() for p in parts])


def image_layout(w) -> list[tuple[str, int, int, int, int]]:
    """(format, rows, qs offset, meta offset, image bytes) per part of a weight's device image: every
    part's qs back to back from 0 (each a multiple of 16 bytes), then at the next IMAGE_ALIGN boundary
    every part's meta, each at a 16-byte boundary.  One part: exactly the Q8_0 image of run/device/weight_window.py."""
    parts = tensor_parts(w)
    qs_sizes = [_part_bytes(p)[0] for p in parts]
    meta_at = -(-sum(qs_sizes) // IMAGE_ALIGN) * IMAGE_ALIGN
    out, qs_at = [], 0
    for p, qs_size in zip(parts, qs_sizes):
        meta_size = _part_bytes(p)[1]
        assert qs_size % 16 == 0, (tensor_format(p), p.shape)
        out.append((tensor_format(p), p.shape[0], qs_at, meta_at, meta_at + meta_size))
        qs_at += qs_size
        meta_at = -(-(meta_at + meta_size) // 16) * 16
    return out


def _part_bytes(p) -> tuple[int, int]:
    fmt = tensor_format(p)
    elements = BLOCK_FORMATS[fmt][0]
    (q0, q1), (m0, m1) = SPLITS[fmt]
    blocks = p.shape[0] * (p.shape[1] // elements)
    return blocks * (q1 - q0), blocks * (m1 - m0)


def image_bytes_of(w) -> int:
    """Device bytes of a weight's image (image_layout's end)."""
    return image_layout(w)[-1][4]


def write_image_parts(dst: np.ndarray, w, order: np.ndarray | slice = slice(None)) -> None:
    """The device image of `w` (rows taken in `order` within each part) into the uint8 view `dst`."""
    for p, (fmt, rows, qs_at, meta_at, _) in zip(tensor_parts(w), image_layout(w)):
        qs, meta = split_q8(p) if isinstance(p, QTensor) else p.split()
        qs, meta = qs[order], meta[order]
        dst[qs_at:qs_at + qs.size] = qs.reshape(-1)
        dst[meta_at:meta_at + meta.size] = meta.reshape(-1)


def tensor_key(w) -> int:
    """The id of the array behind a weight (one dequantized copy per stored weight, whatever view holds it);
    a QTensor or any other weight object: the object (the tied lm_head is the embed object itself; w.qs
    would split a GGUF view)."""
    if isinstance(w, RowStack):
        return tensor_key(w.head)
    return id(w.blocks) if isinstance(w, BlockTensor) else id(w)
