"""Wall time of each stage of a load and of the first step (printed with ``--prof``).

Stages are recorded whether or not profiling is on (a few clock reads per load); a
stage entered many times (one per tensor) accumulates.  `report()` is the table
``--prof`` prints at exit; bench/load_time.py reads `snapshot()`.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

_lock = threading.Lock()
_seconds: dict[str, float] = {}
_counts: dict[str, int] = {}


def record(name: str, seconds: float) -> None:
    with _lock:
        _seconds[name] = _seconds.get(name, 0.0) + seconds
        _counts[name] = _counts.get(name, 0) + 1


@contextmanager
def stage(name: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        record(name, time.perf_counter() - start)


def snapshot() -> dict[str, dict]:
    """{stage: {"s": seconds, "count": entries}} in the order stages first ran."""
    with _lock:
        return {name: {"s": s, "count": _counts[name]} for name, s in _seconds.items()}


def reset() -> None:
    with _lock:
        _seconds.clear()
        _counts.clear()


def report() -> str:
    rows = snapshot()
    if not rows:
        return ""
    width = max(len(name) for name in rows)
    lines = ["[kestrel-prof] load stages (wall s; nested stages are part of the one above them):"]
    lines += [f"  {name:<{width}}  {row['s']:8.3f}" + (f"  x{row['count']}" if row["count"] > 1 else "")
              for name, row in rows.items()]
    return "\n".join(lines)
