"""The device arena's bookkeeping (offsets only: no device memory is touched): freed blocks beside each other
merge, and a block freed at the top gives its bytes back to the top."""
import pytest

from kestrel_stream.cuda.errors import CudaError
from kestrel_stream.cuda.memory import Arena

MB = 1 << 20


def bookkeeping(capacity: int) -> Arena:
    arena = Arena.__new__(Arena)            # the offsets alone, over a made-up base
    arena.capacity_bytes, arena.base, arena._top = capacity, 1 << 40, 0
    arena._free, arena._live, arena.used_bytes, arena.peak_bytes = [], {}, 0, 0
    return arena


def test_freed_neighbours_hold_a_block_as_large_as_them_together():
    arena = bookkeeping(10 * MB)
    blocks = [arena.alloc(2 * MB) for _ in range(4)]        # 8 MB used, 2 left at the top
    keep = arena.alloc(2 * MB)                              # full
    for ptr in (blocks[1], blocks[0], blocks[2]):           # left, then its left, then its right neighbour
        arena.free(ptr)
    assert arena._free == [(0, 6 * MB)]
    assert arena.alloc(6 * MB) == arena.base                # fits where the three were
    with pytest.raises(CudaError, match="arena full"):
        arena.alloc(1)
    assert arena.used_bytes == 10 * MB and keep == arena.base + 8 * MB


def test_a_block_freed_at_the_top_returns_its_bytes_and_its_free_neighbours():
    arena = bookkeeping(8 * MB)
    a, b, c = (arena.alloc(2 * MB) for _ in range(3))
    arena.free(b)
    assert arena._free == [(2 * MB, 2 * MB)] and arena._top == 6 * MB
    arena.free(c)                                           # ends at the top: c and b go back to it
    assert arena._free == [] and arena._top == 2 * MB
    assert arena.alloc(6 * MB) == arena.base + 2 * MB
    arena.free(a)
    assert arena._free == [(0, 2 * MB)] and arena.used_bytes == 6 * MB


def test_blocks_apart_stay_apart():
    arena = bookkeeping(8 * MB)
    ptrs = [arena.alloc(MB) for _ in range(5)]
    arena.free(ptrs[0])
    arena.free(ptrs[2])
    assert arena._free == [(0, MB), (2 * MB, MB)]
    with pytest.raises(CudaError, match="arena full"):
        arena.alloc(5 * MB)                                 # 3 at the top + two apart: no 5 MB run
    assert arena.alloc(3 * MB) == arena.base + 5 * MB
