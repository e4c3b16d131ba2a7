"""Host and device memory: pinned buffers, page-locking of existing arrays, and the one device arena.

Weights, activations and KV caches all live in one device allocation,
sub-allocated here (seed 004: no cuMemAlloc per tensor, none per step); host
memory that copies read or write is page-locked once, never per transfer.
"""
from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass

import numpy as np
from cuda.bindings import driver as cu

from kestrel_stream.cuda.errors import CudaError, check


class PinnedBuffer:
    """Page-locked host memory (cuMemHostAlloc) with a zero-copy uint8 numpy view."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.address = int(check(cu.cuMemHostAlloc(max(nbytes, 1), 0), "cuMemHostAlloc"))
        self.bytes = np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(self.address))

    def view(self, dtype, shape, offset_bytes: int = 0) -> np.ndarray:
        count = int(np.prod(shape))
        end = offset_bytes + count * np.dtype(dtype).itemsize
        assert end <= self.nbytes, "view past the end of the pinned buffer"
        return self.bytes[offset_bytes:end].view(dtype).reshape(shape)

    def free(self) -> None:
        if self.address:
            check(cu.cuMemFreeHost(self.address), "cuMemFreeHost")
            self.address = 0


class RegisteredBuffer(PinnedBuffer):
    """Page-locked host memory on huge pages where the kernel gives them: an anonymous mapping advised
    MADV_HUGEPAGE, written first (by any threads: its pages fault in where they are written), then locked and
    mapped for the device by `pin` (cuMemHostRegister, portable and device-mapped), which cuMemHostAlloc's
    pages are from the start.  Freed, its pages go when the last view of them does."""

    def __init__(self, nbytes: int):
        self.nbytes, self.pinned = nbytes, False
        self._map = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self._map.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):         # no transparent huge pages here: small pages, the same use
            pass
        self.bytes = np.frombuffer(self._map, np.uint8)
        self.address = self.bytes.ctypes.data

    def pin(self) -> None:
        if not self.pinned:
            flags = int(cu.CU_MEMHOSTREGISTER_PORTABLE) | int(cu.CU_MEMHOSTREGISTER_DEVICEMAP)
            check(cu.cuMemHostRegister(self.address, max(self.nbytes, 1), flags), "cuMemHostRegister")
            self.pinned = True

    def free(self) -> None:
        if self.address:
            if self.pinned:
                check(cu.cuMemHostUnregister(self.address), "cuMemHostUnregister")
            self.address, self.pinned, self.bytes, self._map = 0, False, None, None


_registered: dict[int, int] = {}


def register_host(array: np.ndarray) -> None:
    """Page-lock an existing array's memory once (weights); later H2D copies run at pinned speed."""
    address, nbytes = array.ctypes.data, array.nbytes
    if _registered.get(address, 0) >= nbytes:
        return
    check(cu.cuMemHostRegister(address, nbytes, 0), "cuMemHostRegister")
    _registered[address] = nbytes


@dataclass
class DeviceArray:
    """A typed window of the arena: `ptr` is a device address."""
    ptr: int
    shape: tuple
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


class Arena:
    """ONE device allocation, sub-allocated (bump + first-fit reuse of freed blocks).

    Weights, activations and KV caches all live here: no cuMemAlloc per tensor and
    none per step; `used_bytes` / `peak_bytes` account for every live block.
    """
    ALIGN = 256

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.base = int(check(cu.cuMemAlloc(capacity_bytes), f"cuMemAlloc({capacity_bytes} bytes)"))
        self._top = 0
        self._free: list[tuple[int, int]] = []   # (offset, size) of returned blocks
        self._live: dict[int, int] = {}
        self.used_bytes = 0
        self.peak_bytes = 0

    def alloc(self, nbytes: int) -> int:
        size = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        for i, (offset, free_size) in enumerate(self._free):
            if free_size >= size:
                rest = (offset + size, free_size - size)
                self._free[i:i + 1] = [rest] if rest[1] else []
                break
        else:
            if self._top + size > self.capacity_bytes:
                raise CudaError(f"device arena full: need {size} bytes, {self.capacity_bytes - self._top} "
                                f"left of {self.capacity_bytes}")
            offset = self._top
            self._top += size
        self._live[offset] = size
        self.used_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return self.base + offset

    def array(self, shape, dtype) -> DeviceArray:
        shape = tuple(int(s) for s in np.atleast_1d(shape))
        return DeviceArray(self.alloc(int(np.prod(shape)) * np.dtype(dtype).itemsize), shape, np.dtype(dtype))

    def free(self, ptr: int) -> None:
        """Return a block: merged with the free blocks beside it, and given back to the top where it ends
        there, so a later block as large as several freed ones beside each other fits where they were."""
        offset = ptr - self.base
        size = self._live.pop(offset)
        self.used_bytes -= size
        merged = []
        for free_offset, free_size in self._free:
            if free_offset + free_size == offset:
                offset, size = free_offset, free_size + size
            elif offset + size == free_offset:
                size += free_size
            else:
                merged.append((free_offset, free_size))
        if offset + size == self._top:
            self._top = offset
        else:
            merged.append((offset, size))
        self._free = sorted(merged)

    def release(self) -> None:
        if self.base:
            check(cu.cuMemFree(self.base), "cuMemFree")
            self.base = 0
