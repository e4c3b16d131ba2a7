"""Which replica a new session goes to: the least-loaded one, unless another holds a longer cached prefix of its
prompt and is at most ``slack`` busier.

A replica's load is the work it has: sessions placed on it (open, or being
opened) and requests waiting in its batcher.  A cached prefix saves its
positions' prefill on the replica that holds it; the slack bounds what that
saving may cost the balance: a replica with the longest cached prefix wins
while its load is within ``slack`` of the least load, so no replica is ever
chosen over one more than ``slack`` less loaded.  With prompts that share a
prefix, the first replica to cache it takes new sessions until it is
``slack`` ahead; the next one then caches the prefix too, and balance decides
between them.  Ties go to the lower load, then to the lower index.

Pure: numbers in, an index out (the daemon's serve/replicas.py asks it).
"""
from __future__ import annotations

from typing import Sequence

DEFAULT_PREFIX_SLACK = 4        # serve --route-prefix-slack: sessions a cached prefix may outweigh


def choose_replica(loads: Sequence[int], cached: Sequence[int], slack: int = DEFAULT_PREFIX_SLACK) -> tuple[int, bool]:
    """(index, by_prefix): the replica for a new session, and whether a cached prefix chose it over a less
    loaded one.  loads[i]: replica i's load; cached[i]: positions of the prompt its prefix cache holds (0: none,
    or no prompt known)."""
    assert loads and len(loads) == len(cached) and slack >= 0
    least = min(range(len(loads)), key=lambda i: (loads[i], i))
    near = [i for i in range(len(loads)) if loads[i] <= loads[least] + slack]
    longest = max(cached[i] for i in near)
    if longest == 0 or cached[least] == longest:
        return least, False
    return min((i for i in near if cached[i] == longest), key=lambda i: (loads[i], i)), True
