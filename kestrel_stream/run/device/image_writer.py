"""Device images of Q8 weights written into pinned host memory, on several threads.

An image is qs [rows, cols] int8, then scales [rows, cols/32] fp16 at the next
256-byte boundary (gate_up with its rows interleaved (gate j, up j) for the SiLU
epilogue).  Writing it is the one copy a weight makes on its way to the device:
from the GGUF file's blocks in the page cache (model/q8_blocks.py) or from the
split arrays.  numpy releases the GIL in these copies, so pieces of rows run on
a few threads at once; each piece writes its own rows only.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kestrel_stream.model.quant import QTensor
from kestrel_stream.run.device.block_weights import write_block_image
from kestrel_stream.run.device.budget import ALIGN

PIECE_BYTES = 4 << 20          # rows per task: big enough that a copy, not Python, is what a task costs
MAX_WORKERS = 8                # past this the copies are bound by memory bandwidth, not threads


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def write_image(dst: np.ndarray, w: QTensor, interleave: bool, start: int = 0, stop: int | None = None) -> None:
    """Rows [start, stop) of the device layout of `w` into the uint8 view `dst` (image_bytes long);
    with `interleave` the range counts (gate, up) pairs, of which there are rows / 2."""
    if not isinstance(w, QTensor):
        write_block_image(dst, w, interleave)
        return
    rows, cols = w.shape
    qs = dst[:rows * cols].view(np.int8).reshape(rows, cols)
    scales = dst[_align(rows * cols):_align(rows * cols) + rows * cols // 16].view(np.float16)
    scales = scales.reshape(rows, cols // 32)
    if interleave:   # rows gate 0, up 0, gate 1, up 1, ...
        half = rows // 2
        stop = half if stop is None else stop
        qs_pairs = qs.reshape(half, 2, cols)[start:stop]
        scale_pairs = scales.reshape(half, 2, cols // 32)[start:stop]
        w.rows(start, stop).copy_into(qs_pairs[:, 0], scale_pairs[:, 0])
        w.rows(half + start, half + stop).copy_into(qs_pairs[:, 1], scale_pairs[:, 1])
    else:
        stop = rows if stop is None else stop
        w.rows(start, stop).copy_into(qs[start:stop], scales[start:stop])


def default_workers() -> int:
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


class ImageWriter:
    """write_images(jobs): every (dst, w, interleave) written, split into row pieces over `workers` threads."""

    def __init__(self, workers: int | None = None):
        self.workers = default_workers() if workers is None else workers
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kestrel-images") if self.workers > 1 \
            else None

    def write_images(self, jobs) -> None:
        pieces = []
        for dst, w, interleave in jobs:
            if not isinstance(w, QTensor):      # 4/6-bit blocks: qs | meta per format part, in one piece
                pieces.append((dst, w, interleave, 0, None))
                continue
            rows, cols = w.shape
            units = rows // 2 if interleave else rows
            unit_bytes = cols * (2 if interleave else 1)
            step = max(1, PIECE_BYTES // unit_bytes)
            pieces += [(dst, w, interleave, lo, min(units, lo + step)) for lo in range(0, units, step)]
        if self._pool is None or len(pieces) == 1:
            for piece in pieces:
                write_image(*piece)
            return
        for done in self._pool.map(lambda piece: write_image(*piece), pieces):
            pass                # map re-raises the first error here

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __enter__(self) -> "ImageWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
