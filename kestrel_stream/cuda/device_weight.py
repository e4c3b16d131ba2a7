"""Where a linear weight lives in device memory (the launch builders' view of it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class QWeight:
    """A weight in device memory: for Q8_0 qs [rows, cols] int8 and scales [rows, cols/32] fp16; for a
    block format (fmt Q4_0 / Q4_K / Q6_K, model/quant4.py) its blocks' qs and meta bytes, row after row.
    `tail`: the last rows in a second block format (a fused QKV whose v rows are Q6_K)."""
    qs: int
    scales: int
    rows: int
    cols: int
    fmt: str = "Q8_0"
    tail: "QWeight | None" = None
