"""Large buffers go back to the operating system when a connection or a request lets go of them.

A half-read request frame of up to --max-frame-mb is freed when its
connection closes, but glibc's malloc raises its mmap threshold each time it
frees a large mapped block, after which such buffers come from the heap and
stay in the process's RSS, fragmented.  A fixed threshold keeps every block
of 1 MiB and more in its own mapping, unmapped when freed.

Many small objects (a large JSON body's strings and dicts) come from the
heap instead; once freed, ``release_freed_memory`` has glibc return the free
pages at its top and inside it (``malloc_trim``), so a burst of large requests
does not leave its high-water mark in the process's RSS.

A request that ends by cancellation (a streaming client that left) leaves
reference cycles behind: the cancelled tasks, their exceptions and the
frames those hold, with the request's buffers.  Only the cyclic collector
frees them, and it runs on allocations: in a daemon gone idle it would not
run for a long while, and neither free nor trim could give their pages back.
``collect_cycles`` runs it (the model's objects are frozen out of its view at
start, so it walks only what requests left) before the idle trim.
"""
from __future__ import annotations

import ctypes
import gc
import sys
from functools import cache

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


@cache
def _malloc_trim():
    """glibc's malloc_trim, or None elsewhere (not Linux, or a libc without it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def collect_cycles() -> int:
    """Free what only the cyclic collector can (the objects it found unreachable)."""
    return gc.collect()


def release_freed_memory() -> bool:
    """After a large transient allocation was freed: return the free heap pages to the system (True where the
    allocator could be told)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
