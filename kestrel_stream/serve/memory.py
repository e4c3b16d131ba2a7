"""Large buffers go back to the operating system when a connection lets go of them.

A half-read request frame of up to --max-frame-mb is freed when its
connection closes, but glibc's malloc raises its mmap threshold each time it
frees a large mapped block, after which such buffers come from the heap and
stay in the process's RSS, fragmented.  A fixed threshold keeps every block
of 1 MiB and more in its own mapping, unmapped when freed.
"""
from __future__ import annotations

import ctypes
import sys

M_MMAP_THRESHOLD = -3               # glibc malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20


def map_large_buffers() -> bool:
    """glibc only (True if set); elsewhere the allocator keeps its own policy."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):    # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
