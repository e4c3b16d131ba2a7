"""Test oracles of the residency window (scheduler/window.py): its ring replayed step by step, and plain LRU.

simulate_window replays decode steps through a WindowPlan's ring and asserts
that no slot is overwritten before its weight was read (the slot-reuse race);
simulate_lru is the LRU cache the window replaces, for contrast.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from scheduler.window import WindowPlan


@dataclass
class WindowStats:
    hits_per_step: list        # accesses served by resident weights
    misses_per_step: list      # accesses to streamed weights (each needed one copy)
    copies_per_step: list      # copies issued during the step (prefetch runs ahead)
    exposed_copies: int        # copies issued for the very next access (not overlapped)
    streamed_bytes_per_step: list


def simulate_window(window: WindowPlan, items, steps: int) -> WindowStats:
    """Replay `steps` decode steps of cyclic access through the ring, checking its invariants.

    Streamed access j (counted across steps) uses slot j % slot_count; before
    reading it, copies up to j + prefetch_distance are issued. A copy into a
    slot whose previous occupant has not been read yet would be the
    slot-reuse race; the simulation asserts it never happens.
    """
    sizes = {i.name: i.nbytes for i in items}
    streamed = set(window.streamed)
    order = [i.name for i in items if i.name in streamed or i.name in window.resident]
    ring = [None] * window.slot_count     # global streamed index held by each slot
    per_step = len(window.streamed)
    stats = WindowStats([], [], [], 0, [])
    next_copy = 0
    access = 0
    for step in range(steps):
        hits = misses = copies = moved = 0
        for name in order:
            if name not in streamed:
                hits += 1
                continue
            while next_copy <= access + window.prefetch_distance:
                slot = next_copy % window.slot_count
                assert ring[slot] is None or ring[slot] < access, "slot overwritten before read"
                ring[slot] = next_copy
                copies += 1
                moved += sizes[window.streamed[next_copy % per_step]]
                stats.exposed_copies += next_copy == access
                next_copy += 1
            assert ring[access % window.slot_count] == access
            misses += 1
            access += 1
        stats.hits_per_step.append(hits)
        stats.misses_per_step.append(misses)
        stats.copies_per_step.append(copies)
        stats.streamed_bytes_per_step.append(moved)
    return stats


def simulate_lru(items, capacity_bytes: int, steps: int) -> list:
    """Misses per step of a plain LRU weight cache under the same cyclic access (for contrast)."""
    cache = OrderedDict()
    used = 0
    misses_per_step = []
    for _ in range(steps):
        misses = 0
        for item in items:
            if item.name in cache:
                cache.move_to_end(item.name)
                continue
            misses += 1
            if item.nbytes > capacity_bytes:
                continue
            while used + item.nbytes > capacity_bytes:
                _, evicted = cache.popitem(last=False)
                used -= evicted
            cache[item.name] = item.nbytes
            used += item.nbytes
        misses_per_step.append(misses)
    return misses_per_step
