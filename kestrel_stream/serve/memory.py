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
``FreedPages`` runs it before the idle trim, once no request is being handled:
a full collection holds the interpreter from start to end, wherever it runs,
so it waits for a daemon with nothing to answer.  What the daemon loaded
before serving (the model, the modules, the servers) is frozen out of the
collector's view (``freeze_loaded_objects``), so it walks only what requests
left.
"""
from __future__ import annotations

import asyncio
# the loop's default executor (release_freed_memory runs there): imported at start, not at the first trim,
# which can come while every file descriptor is taken (the module file could not be opened then)
import concurrent.futures.thread  # noqa: F401
import ctypes
import gc
import sys
import time
from functools import cache
from typing import Callable

M_MMAP_THRESHOLD = -3               # glibc malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20
TRIM_INTERVAL_S = 1.0       # while work goes on, freed memory is given back at most this often


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


def freeze_loaded_objects() -> None:
    """Once, before serving: what exists now stays for the daemon's life, so no full collection need walk it."""
    gc.collect()
    gc.freeze()


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


class FreedPages:
    """Loop: freed pages go back to the system, off the loop: at most every TRIM_INTERVAL_S while work goes on, and
    once the daemon has been idle for TRIM_INTERVAL_S, after the cycles requests left are collected (an idle daemon
    allocates nothing that would start the collector)."""

    def __init__(self):
        self.busy: list[Callable[[], int]] = []     # each: work in progress (sessions held, requests handled)
        self.trimmed_at = 0.0                       # when freed memory was last given back (monotonic s)
        self.idle_trim: asyncio.TimerHandle | None = None

    def count_busy(self, work_in_progress: Callable[[], int]) -> None:
        """The idle trim waits until ``work_in_progress()`` is 0 (as for every other count)."""
        self.busy.append(work_in_progress)

    def give_back_soon(self) -> None:
        """After something large was let go of (a session closed, a body refused)."""
        loop, now = asyncio.get_running_loop(), time.monotonic()
        if now - self.trimmed_at >= TRIM_INTERVAL_S:
            self.trimmed_at = now
            loop.run_in_executor(None, release_freed_memory)
        if self.idle_trim is None:
            self.idle_trim = loop.call_later(TRIM_INTERVAL_S, self.when_idle)

    def when_idle(self) -> None:
        loop = asyncio.get_running_loop()
        if any(work() for work in self.busy):          # look again later: a collection now would hold up that work
            self.idle_trim = loop.call_later(TRIM_INTERVAL_S, self.when_idle)
            return
        self.idle_trim = None
        self.trimmed_at = time.monotonic()
        collect_cycles()
        loop.run_in_executor(None, release_freed_memory)
