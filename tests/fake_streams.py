"""Streams, events and graphs of the emulated device (fake_cuda): ordering, waits, capture and replay.

Ops queue per stream and run under POLICY["mode"]:
  "immediate"  every op runs at enqueue (host order);
  "deferred"   streams run only when the host synchronizes them or another stream
               waits on their events, except the streams named in POLICY["eager"]
               (the copy streams of the window and of the experts' ring), which run as soon as their
               waits allow.
A missing host sync, a host write racing a queued upload, or a missing
cross-stream wait then shows up as wrong data.  Capture records the ops of the
capturing stream and of every stream that joined it (a wait on an event
recorded in the capture); a Graph replays them on private streams under the
same policy.  Not modelled: concurrency and time (elapsed_ms is 0).
"""
from __future__ import annotations

from contextlib import contextmanager

from kestrel_stream.cuda.driver import CudaError

POLICY = {"mode": "immediate", "eager": ("window copy h2d", "experts copy h2d")}


class Stream:
    def __init__(self, name: str | None = None):
        self.name = name or "stream"
        self.capturing = False
        self.ops: list = []      # (kind, payload): ("run", fn) or ("wait", (stream, index))
        self.done = 0

    @property
    def eager(self) -> bool:
        return POLICY["mode"] == "immediate" or self.name in POLICY["eager"]

    def enqueue(self, kind: str, payload) -> None:
        if self.capturing:
            _capture[0].append((self, kind, payload))
            return
        self.ops.append((kind, payload))
        _pump()

    def synchronize(self) -> None:
        if self.capturing:
            raise CudaError("cuStreamSynchronize on a capturing stream")
        _run_until(self, len(self.ops))

    def wait(self, event: "Event") -> None:
        if event.target is not None:
            if event.target[0] == "capture" and not capturing():
                raise CudaError(f"stream {self.name} waits on event {event.name!r}, recorded only in a capture "
                                "that has ended")
            self.capturing = self.capturing or event.target[0] == "capture"   # joins the capture, as CUDA does
            self.enqueue("wait", event.target)


def _step(stream) -> None:
    kind, payload = stream.ops[stream.done]
    if kind == "wait":
        _run_until(*payload)
    else:
        payload()
    stream.done += 1


def _run_until(stream, index: int) -> None:
    while stream.done < index:
        _step(stream)
        _pump()


_pumping = [False]


def _pump() -> None:
    """Advance every eager stream while its next op can run."""
    if _pumping[0]:
        return
    _pumping[0] = True
    try:
        progress = True
        while progress:
            progress = False
            for s in list(_streams()):
                while s.eager and s.done < len(s.ops):
                    kind, payload = s.ops[s.done]
                    if kind == "wait" and payload[0].done < payload[1]:
                        break
                    _step(s)
                    progress = True
    finally:
        _pumping[0] = False


_live_streams: list = []


def _streams():
    return [s for s in _live_streams if s.done < len(s.ops)]


_capture: list = [None]      # the ops recorded by the capture in progress: (stream, kind, payload)


def capturing() -> bool:
    return _capture[0] is not None


class Event:
    def __init__(self, timing: bool = False, name: str = "event", external: bool = False, blocking: bool = False):
        self.name, self.target, self.external = name, None, external

    def record(self, stream: Stream) -> None:
        if stream.capturing:
            self.target = ("capture", len(_capture[0]), stream)
            _capture[0].append((stream, "record", self))
        else:
            self.target = (stream, len(stream.ops))

    mark = record

    def synchronize(self) -> None:
        if self.target is not None and self.target[0] == "capture":
            # CUDA: a plain record in a capture leaves no record a host can wait on (only an external one does)
            raise CudaError(f"cuEventSynchronize failed: event {self.name!r} was recorded only in a capture")
        if self.target is not None:
            _run_until(*self.target)

    def query(self) -> bool:
        return self.target is None or self.target[0].done >= self.target[1]

    def elapsed_ms(self, since: "Event") -> float:
        return 0.0

    def destroy(self) -> None:
        pass


def new_stream(*args, **kw):
    s = Stream(*args, **kw)
    _live_streams.append(s)
    return s


class Graph:
    """The ops captured on each stream; a replay runs them on private streams under the current policy."""

    def __init__(self, recorded, origin):
        self.recorded, self.origin = recorded, origin

    def launch(self, stream: Stream) -> None:
        stream.enqueue("run", self._replay)
        # an external event recorded in the capture is recorded by each launch (an event-record node): a
        # host wait on it returns once the replay is done -- later than CUDA's, which returns at the node
        for _, kind, payload in self.recorded:
            if kind == "record" and payload.external:
                payload.target = (stream, len(stream.ops))

    def _replay(self) -> None:
        lanes, events = {}, {}
        for s, kind, payload in self.recorded:
            lane = lanes.setdefault(s, Stream(s.name))
            if kind == "record":
                events[payload] = (lane, len(lane.ops))
            elif kind == "wait" and payload[0] == "capture":
                lane.ops.append(("wait", events[self.recorded[payload[1]][2]]))
            elif kind == "wait":
                raise CudaError("a captured stream waits on an event recorded outside the capture")
            else:
                lane.ops.append((kind, payload))
        _live_streams.extend(lanes.values())
        try:
            for lane in lanes.values():
                _run_until(lane, len(lane.ops))
        finally:
            for lane in lanes.values():
                _live_streams.remove(lane)

    def destroy(self) -> None:
        self.recorded = []


def _check_joined(recorded, origin) -> None:
    """Every side stream's last captured op is followed by a record the origin stream waits on (else CUDA
    ends the capture with CUDA_ERROR_STREAM_CAPTURE_UNJOINED)."""
    for side in {id(s): s for s, _, _ in recorded if s is not origin}.values():
        last = max(i for i, (s, _, _) in enumerate(recorded) if s is side)
        joined = any(recorded[i][0] is side and recorded[i][1] == "record" and any(
            s is origin and kind == "wait" and payload[0] == "capture" and payload[1] == i for s, kind, payload in recorded[i:])
            for i in range(last, len(recorded)))
        if not joined:
            raise CudaError(f"capture ends with stream {side.name} unjoined")


@contextmanager
def capture(stream: Stream):
    holder = type("Captured", (), {"graph": None})()
    assert _capture[0] is None, "nested capture"
    _capture[0] = []
    stream.capturing = True
    try:
        yield holder
        recorded = _capture[0]
        _check_joined(recorded, stream)
        holder.graph = Graph(recorded, stream)
    finally:
        for joined in {id(s): s for s, _, _ in _capture[0]}.values():    # the side streams leave it with it
            joined.capturing = False
        stream.capturing = False
        _capture[0] = None
