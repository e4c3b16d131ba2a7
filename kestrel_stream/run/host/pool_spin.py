"""The native pool's spin during mixed steps: how long an idle worker polls for the next call before it sleeps.
"""
from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext

# How long an idle host worker polls before it sleeps during a mixed step whose host segments are native calls
# alone, unless Options.host_spin_us says: a device segment between two host segments lasts tens of
# microseconds to a few milliseconds, and a host segment that finds its workers asleep first pays for waking
# them (calibrate's host_call_us is measured after such a gap, at this setting).  Set for the step only:
# polling workers would take the cores from BLAS's threads (numpy attention over a prompt's chunk, the CPU
# engine's work in the same process), so the step puts the library's default back at its end.
# On a machine of few CPUs a polling worker more often holds a core another thread of the step (or of another
# process) needs, and a descheduled one costs a call a scheduler tick (a 2-core VM under load: 6 ms a call
# against 1 ms), so below MIXED_SPIN_MIN_CPUS the library's default stays.
MIXED_SPIN_US = 2000
MIXED_SPIN_MIN_CPUS = 8
LIBRARY_SPIN_US = 100


def mixed_spin(options) -> bool:
    """Whether mixed steps raise the pool's spin (Options.host_spin_us unset, enough CPUs)."""
    return (options is None or options.host_spin_us is None) and (os.cpu_count() or 1) >= MIXED_SPIN_MIN_CPUS


def spinning_step(kernels, options):
    """`spin(native_only)`: a context for one mixed step; it raises the pool's spin for the step where the
    step's host segments are native calls alone and mixed_spin allows, and puts the library's back after."""
    if kernels is None or not mixed_spin(options):
        return lambda native_only: nullcontext()

    @contextmanager
    def spin(native_only: bool):
        if not native_only:
            yield
            return
        kernels.set_spin_us(MIXED_SPIN_US)
        try:
            yield
        finally:
            kernels.set_spin_us(LIBRARY_SPIN_US)
    return spin
