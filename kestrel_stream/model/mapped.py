"""Weights that are views of a file's mmap (a GGUF's blocks): handing their pages back.

A page of a read-only file mapping that a load or a repack has read stays in the process's resident set
(RssFile) for as long as the mapping lives, even where nothing will read it again: a part copied into a
fused weight, a weight repacked into the host kernels' layout.  MADV_DONTNEED drops the process's
mapping of such pages; the file's data is unchanged, and a later read maps the page again (from the
page cache, or the file).
"""
from __future__ import annotations

import mmap

import numpy as np


def release_file_pages(a: np.ndarray) -> None:
    """Drop this process's mapping of the whole pages under `a` where it is a view of a file's mmap (its
    resident set shrinks by them; the file's data is unchanged and is read again if touched).  Memory of
    any other kind is left alone (DONTNEED would zero an anonymous page, and undo a copy-on-write one)."""
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    if not (isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap) and base.readonly and a.flags.c_contiguous):
        return
    whole = np.frombuffer(base, np.uint8)
    start = a.ctypes.data - whole.ctypes.data
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (start + a.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if whole.ctypes.data % mmap.PAGESIZE == 0 and first < end:
        base.obj.madvise(mmap.MADV_DONTNEED, first, end - first)
