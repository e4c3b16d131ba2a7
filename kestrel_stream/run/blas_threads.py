"""The CPU engine's BLAS threads (numpy's OpenBLAS), set where the engine is built (ks.load's
``cpu_threads``, ``--cpu-threads``).

OpenBLAS splits even small GEMMs (a 16-token prompt suffix, a decode step's
attention) across its threads, and its idle workers spin; when other processes
hold the cores, every such call waits for a descheduled worker, so a short step
can take longer than a long one.  One thread is then the faster choice; where
the cores are free, more threads speed up long prefills.  threadpoolctl sets
the count at run time (the OPENBLAS_NUM_THREADS variable only works before
numpy loads); it is imported only when a count is given.
"""
from __future__ import annotations

_limits = None        # the live threadpoolctl limiter: the setting holds while it exists


def set_cpu_threads(threads: int | None) -> None:
    """Process-wide BLAS thread count (None: leave the library's own, by default one per core)."""
    global _limits
    if threads is None:
        return
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"cpu_threads={threads!r}: expected a whole number >= 1 (or None for BLAS's default)")
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        raise ValueError("cpu_threads needs the threadpoolctl package (pip install threadpoolctl)") from None
    _limits = threadpool_limits(limits=threads, user_api="blas")


def cpu_threads_now() -> list[int]:
    """The thread count of every BLAS library numpy loaded (for tests and stats)."""
    from threadpoolctl import threadpool_info
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
