"""The CPU engine's BLAS threads (numpy's OpenBLAS), set where the engine is built (ks.load's
``cpu_threads`` and ``blas_threads``, ``--cpu-threads``, KESTREL_BLAS_THREADS).

OpenBLAS splits even small GEMMs (a 16-token prompt suffix, a decode step's
attention) across its threads, and its idle workers spin; when other processes
hold the cores, every such call waits for a descheduled worker, so a short step
can take longer than a long one.  One thread is then the faster choice; where
the cores are free, more threads speed up long prefills.  threadpoolctl sets
the count at run time (the OPENBLAS_NUM_THREADS variable only works before
numpy loads); it is imported only when a count is given.

Where the native host kernels run the CPU engine's projections on their own pool of threads, BLAS runs
only a token tree's masked attention (program.py), between two projections: its workers, idle and spinning, then hold the cores the pool needs for the next projection.
The CPU engine over the native kernels therefore gives BLAS one thread unless told otherwise
(`engine_blas_threads`); the mixed modes' host segments keep the host's threads.
"""
from __future__ import annotations

_limits = None        # the live threadpoolctl limiter: the setting holds while it exists


def set_cpu_threads(threads: int | None) -> None:
    """Process-wide BLAS thread count (None: leave the library's own, by default one per core)."""
    global _limits
    if threads is None:
        return
    check_threads(threads, "cpu_threads")
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        raise ValueError("cpu_threads needs the threadpoolctl package (pip install threadpoolctl)") from None
    _limits = threadpool_limits(limits=threads, user_api="blas")


def check_threads(threads, name: str) -> None:
    """ValueError naming `name` unless `threads` is None or a whole number >= 1."""
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise ValueError(f"{name}={threads!r}: expected a whole number >= 1 (or None for BLAS's default)")


def engine_blas_threads(options, mode: str, native_projections: bool) -> int | None:
    """numpy's BLAS threads for an engine of `mode`: options.blas_threads where given; 1 on the CPU engine
    whose projections the native kernels run (native_projections); else the host's threads
    (options.host_threads; None: BLAS's default)."""
    if options.blas_threads is not None:
        return options.blas_threads
    if mode == "cpu" and native_projections:
        return 1
    return options.host_threads


def cpu_threads_now() -> list[int]:
    """The thread count of every BLAS library numpy loaded (for tests and stats)."""
    from threadpoolctl import threadpool_info
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
