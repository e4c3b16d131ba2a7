"""Device weights of any linear weight type: where a launch finds the parts of a weight's image.

The image (model/quant4.image_layout) is Q8_0's qs | scales for a QTensor and qs | meta per
format part for the block formats; gate_up's rows are interleaved (gate j, up j) for the
SiLU epilogue whatever the format (rows are independent in every format).
"""
from __future__ import annotations

import numpy as np

from kestrel_stream.cuda.kernels import QWeight
from kestrel_stream.model.quant4 import image_bytes_of, image_layout, write_image_parts


def device_qweight(address: int, w) -> QWeight:
    """The QWeight of `w`'s image at device `address`."""
    layout = image_layout(w)
    fmt, _, qs_at, meta_at, _ = layout[0]
    rows, cols = w.shape
    tail = None
    if len(layout) == 2:
        fmt_b, rows_b, qs_b, meta_b, _ = layout[1]
        tail = QWeight(address + qs_b, address + meta_b, rows_b, cols, fmt_b)
    return QWeight(address + qs_at, address + meta_at, rows, cols, fmt, tail)


def interleave_order(rows: int) -> np.ndarray:
    """Row order (gate 0, up 0, gate 1, up 1, ...) of a fused [gate; up] weight."""
    half = rows // 2
    return np.stack([np.arange(half), half + np.arange(half)], axis=1).reshape(-1)


def write_block_image(dst: np.ndarray, w, interleave: bool) -> None:
    """The image of a block-format weight into the uint8 view `dst` (image_bytes_of(w) long)."""
    write_image_parts(dst, w, interleave_order(w.shape[0]) if interleave else slice(None))


def block_image(w, interleave: bool) -> np.ndarray:
    """The image as a new uint8 array (a weight uploaded after load: weight_cache.py)."""
    out = np.zeros(image_bytes_of(w), np.uint8)
    write_block_image(out, w, interleave)
    return out
