"""The CPU engine's one host copy of its weights: every Q4_K / Q6_K projection held as the host kernels'
repacked groups alone (native/host_kquants.c), the file's blocks let go.

With AVX-512 VNNI the kernels read a Q4_K / Q6_K weight repacked 16 rows together, a copy made once
(HostKernels.prepare_blocks).  Kept beside the blocks it was made from, every such weight would be on the
host twice: the file's pages (a view of the GGUF's mmap) or the array a fused QKV, gate+up or stack of
experts was concatenated into, and the repacked bytes.  Where the host backend is the weights' only
reader (cpu mode: no device uploads or streams them), `repacked_weights` prepares every projection once
and returns the weights with those tensors replaced by RepackedTensors that hold the prepared weights
alone; the blocks are dropped, and the file's pages under a view of an mmap are handed back
(MADV_DONTNEED: the mapping stays, and a later read of them reads the file again).  A RepackedTensor
still reads as the weight it was (its shape and bytes, its rows dequantized: the embedding of a tied
lm_head) by gathering rows back out of their groups.  The mixed modes keep the blocks: the device uploads
and streams them, and a step's split may move a layer between the host and the device.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from kestrel_stream.model.mapped import release_file_pages
from kestrel_stream.model.quant4 import BlockTensor, RowStack, dequantize_blocks
from kestrel_stream.model.weights import ModelWeights
from scheduler.ops import BLOCK_FORMATS


@dataclass
class RepackedTensor:
    """A [rows, cols] Q4_K / Q6_K weight held only as the kernels' prepared (repacked) weights: pieces
    (first row, native.PreparedWeight) covering its rows in order, one for a projection and one per expert
    for a stack of experts (each the row range HostBackend.linear asks for)."""
    fmt: str
    cols: int
    pieces: list

    @property
    def shape(self) -> tuple[int, int]:
        first, last = self.pieces[-1]
        return first + last.rows, self.cols

    @property
    def row_bytes(self) -> int:
        elements, nbytes = BLOCK_FORMATS[self.fmt]
        return self.cols // elements * nbytes

    @property
    def nbytes(self) -> int:
        """The file's bytes of these rows (what a step reads, as the blocks counted them)."""
        return self.shape[0] * self.row_bytes

    @property
    def formats(self) -> tuple[str, ...]:
        return (self.fmt,)

    def piece(self, start: int, stop: int):
        """The prepared weight of rows start..stop (one of the pieces it was prepared in)."""
        for first, prepared in self.pieces:
            if first == start and first + prepared.rows == stop:
                return prepared
        raise AssertionError(f"{self.fmt} rows {start}..{stop}: not a piece it was repacked in "
                             f"{[(first, first + p.rows) for first, p in self.pieces]}")

    def file_rows(self, index: np.ndarray | slice) -> np.ndarray:
        """Rows `index` as the file's blocks, uint8 [n, row bytes] (gathered out of the groups)."""
        rows = np.arange(self.shape[0])[index] if isinstance(index, slice) else np.asarray(index)
        if len(self.pieces) == 1:
            return self.pieces[0][1].file_rows(rows)
        out = np.empty((len(rows), self.row_bytes), np.uint8)
        for first, prepared in self.pieces:
            inside = (rows >= first) & (rows < first + prepared.rows)
            if inside.any():
                out[inside] = prepared.file_rows(rows[inside] - first)
        return out

    def dequantize_rows(self, index: np.ndarray) -> np.ndarray:
        """float32 [len(index), cols] of selected rows (a tied embedding's lookup): BlockTensor's values."""
        blocks = self.file_rows(np.asarray(index))
        return dequantize_blocks(blocks.reshape(-1, BLOCK_FORMATS[self.fmt][1]), self.fmt).reshape(len(blocks), -1)

    def dequantize(self, rows_per_chunk: int = 1024) -> np.ndarray:
        """float32 [rows, cols], gguf-py's values (a chunk of rows gathered at a time)."""
        n, k = self.shape
        out = np.empty((n, k), np.float32)
        for start in range(0, n, rows_per_chunk):
            out[start:start + rows_per_chunk] = self.dequantize_rows(np.arange(start, min(n, start + rows_per_chunk)))
        return out


def repacked_weights(weights: ModelWeights, kernels) -> ModelWeights:
    """`weights` with every projection the kernels repack (Q4_K, Q6_K with VNNI) prepared now and held as a
    RepackedTensor alone (a stack of experts: a piece per expert); the rest as they are.  `weights` itself
    is not changed: the blocks go once nothing else holds it."""
    def repack(w, ranges: list[tuple[int, int]] | None = None):
        if isinstance(w, RowStack):
            return RowStack(*(repack(part) for part in w.parts))
        if not isinstance(w, BlockTensor) or not kernels.repacks(w.fmt):
            return w
        pieces = [(lo, kernels.prepare_blocks(w.fmt, w.blocks[lo:hi], w.cols))
                  for lo, hi in ranges or [(0, w.shape[0])]]
        release_file_pages(w.blocks)
        return RepackedTensor(w.fmt, w.cols, pieces)

    def experts(moe):
        return replace(moe, gate_up=repack(moe.gate_up, [moe.gate_up_rows(e) for e in range(moe.experts)]),
                       down=repack(moe.down, [moe.down_rows(e) for e in range(moe.experts)]))

    lm_head = repack(weights.lm_head)
    layers = [replace(lw, wqkv=repack(lw.wqkv), wo=repack(lw.wo), w_gate_up=repack(lw.w_gate_up),
                      w_down=repack(lw.w_down), moe=None if lw.moe is None else experts(lw.moe))
              for lw in weights.layers]
    return replace(weights, embed=lm_head if weights.tied else weights.embed, lm_head=lm_head, layers=layers)
