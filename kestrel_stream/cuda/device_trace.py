"""The device layer's tracing: GPU times of launches, copies and graph replays from timing events.

driver.py's ``timed`` (for each launch, copy or graph replay while
``trace.active`` is set) and ``resolve_gpu_times`` (after each host sync) keep
one GpuTimes per recorder; this module imports no driver.

``GpuTimes`` is the logic, pure over event objects so it is tested without a
GPU.  An event is anything with ``query() -> bool`` (has the GPU passed it?),
``elapsed_ms(since)`` (cuEventElapsedTime, both events complete) and
``destroy()``.  Each traced op is bracketed by a ``pair()`` of events and
``add``-ed; ``resolve()`` after a host sync hands the complete ones to the
recorder: nothing here waits on the device.

Times are milliseconds since the trace's reference event, recorded on an idle
stream at host time ``reference_host_us`` (the recorder's clock), so
``Recorder.set_reference`` pins the two clocks together.
"""
from __future__ import annotations

from typing import Callable, NamedTuple


class PendingOp(NamedTuple):
    op_id: int          # what Recorder.launch / Recorder.copy returned
    start: object       # timing event recorded just before the op on its stream
    end: object         # ... and just after it
    direction: str      # "h2d" / "d2h" for a copy, "" for a kernel or graph replay
    nbytes: int


class GpuTimes:
    """The pending timed ops of one recorder, a pool of reusable events, and the bytes-in-flight counter."""

    def __init__(self, recorder, reference, reference_host_us: float, new_event: Callable[[], object],
                 device: int = 0, label: str | None = None):
        self.recorder, self.reference, self.device = recorder, reference, device
        self._new_event = new_event
        self.free: list = []                     # completed events, ready to record again
        self.pending: list[PendingOp] = []       # in issue order
        self._copies: list[tuple[float, float, str, int]] = []   # resolved (start ms, end ms, dir, bytes)
        recorder.set_reference(device, host_us=reference_host_us, label=label)

    def pair(self) -> tuple[object, object]:
        """Two timing events for one op, from the pool when it has them."""
        start = self.free.pop() if self.free else self._new_event()
        end = self.free.pop() if self.free else self._new_event()
        return start, end

    def add(self, op_id: int, start, end, direction: str = "", nbytes: int = 0) -> None:
        self.pending.append(PendingOp(op_id, start, end, direction, nbytes))

    def resolve(self) -> int:
        """Hand every op whose end event completed to the recorder; returns how many."""
        if not self.pending or not self.reference.query():
            return 0
        still: list[PendingOp] = []
        for op in self.pending:
            if not op.end.query():      # work on one stream runs in order: a complete end means a complete start
                still.append(op)
                continue
            start_ms, end_ms = op.start.elapsed_ms(self.reference), op.end.elapsed_ms(self.reference)
            self.recorder.gpu_done(op.op_id, start_ms, end_ms)
            if op.direction:
                self._copies.append((start_ms, end_ms, op.direction, op.nbytes))
            self.free += [op.start, op.end]
        resolved = len(self.pending) - len(still)
        self.pending = still
        if self._copies and not any(op.direction for op in still):
            self._emit_bytes_in_flight()
        return resolved

    def _emit_bytes_in_flight(self) -> None:
        """The counter track over every copy resolved since the last emission.

        Emitted only once no copy is pending: every copy issued later starts
        after these ended, so the running sums never need revising.
        """
        edges = sorted([(start, nbytes, d) for start, _, d, nbytes in self._copies] +
                       [(end, -nbytes, d) for _, end, d, nbytes in self._copies])
        level = {"h2d": 0, "d2h": 0}
        for at_ms, delta, direction in edges:
            level[direction] += delta
            self.recorder.gpu_counter("bytes in flight", dict(level), at_ms, device=self.device)
        self._copies.clear()

    def close(self) -> None:
        """Give every event back to the driver (pending ones are released once the GPU passes them)."""
        for event in self.free + [e for op in self.pending for e in (op.start, op.end)] + [self.reference]:
            event.destroy()
        self.free, self.pending = [], []
