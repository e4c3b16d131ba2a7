"""The event recorder: host spans, launches, copies, syncs and GPU times as Chrome Trace Event JSON.

One recorder per process, in the module-level ``active``; it is ``None`` while
tracing is off, so every hook costs one global lookup and a ``None`` check.
Turned on by ``--trace FILE``, ``KESTREL_TRACE=FILE`` or ``start(path)``;
``stop()`` writes the file (``.json`` or ``.json.gz``).

Layout of the output (what Perfetto and chrome://tracing show):
    pid 1             "host", one row per Python thread (spans, launches, syncs)
    pid 100 + device  "cuda:N", one row per stream ("compute", "copy h2d", ...)
categories: ``host``, ``kernel``, ``memcpy``, ``sync``; ``s``/``f`` flow arrows
go from each launch's host slice to the GPU slice it produced.

GPU times: the executor records one timing event (the *reference*) on an idle
stream and calls ``set_reference(device)`` right after, which pins that event
to the host clock.  Every later GPU op is handed over as milliseconds since
the reference (``cuEventElapsedTime(ref, ev)``), once its events completed.
"""
from __future__ import annotations

import atexit
import gzip
import itertools
import json
import os
import threading
import time
from pathlib import Path

HOST_PID = 1
DEVICE_PID_BASE = 100
CATEGORIES = ("host", "kernel", "memcpy", "sync")
EVENT_RESOLUTION_US = 1.0      # cuEventElapsedTime resolves about 0.5 us


class _NullSpan:
    """What ``span()`` returns while tracing is off: a reusable do-nothing context."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def set(self, **args) -> None:
        pass


NULL_SPAN = _NullSpan()
active: "Recorder | None" = None


class _Span:
    """A host slice (ph X) on the calling thread's row, emitted when it closes."""

    __slots__ = ("rec", "name", "cat", "args", "start_us")

    def __init__(self, rec: "Recorder", name: str, cat: str, args: dict):
        self.rec, self.name, self.cat, self.args = rec, name, cat, args

    def __enter__(self):
        self.start_us = self.rec.now_us()
        return self

    def __exit__(self, *exc):
        self.rec._host_slice(self.name, self.cat, self.start_us, self.rec.now_us(), self.args)
        return False

    def set(self, **args) -> None:
        self.args.update(args)


class _LaneSpan(_Span):
    """A host slice on a named row of its own (a lane: the work of one kind, whichever thread runs it)."""

    __slots__ = ("lane",)

    def __init__(self, rec: "Recorder", lane: str, name: str, cat: str, args: dict):
        super().__init__(rec, name, cat, args)
        self.lane = lane

    def __exit__(self, *exc):
        rec = self.rec
        rec.events.append({"ph": "X", "cat": self.cat, "name": self.name, "pid": HOST_PID,
                           "tid": rec._row(HOST_PID, ("lane", self.lane), self.lane), "ts": self.start_us,
                           "dur": rec.now_us() - self.start_us, "args": rec._args(self.args)})
        return False


class _Step(_Span):
    """The span of one executor step; events inside carry ``args.step``."""

    def __enter__(self):
        self.rec.step_index += 1
        self.args["step"] = self.rec.step_index
        self.rec.current_step = self.rec.step_index
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.rec.counter("tokens per step", {"tokens": self.args.get("tokens", 0)})
        self.rec.current_step = None
        return False


class Recorder:
    def __init__(self, path: str | os.PathLike, metadata: dict | None = None):
        self.path = Path(path)
        self.metadata = dict(metadata or {})
        self.events: list[dict] = []
        self.origin_ns = time.perf_counter_ns()
        self.step_index = -1                # the last step begun; the first step is 0
        self.current_step: int | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, dict] = {}   # launch/copy id -> what its GPU slice needs
        self._reference_us: dict[int, float] = {}   # device -> host time of its reference event
        self._rows: dict[tuple[int, object], int] = {}   # (pid, thread ident or stream) -> tid
        self._lock = threading.Lock()
        self._row_end_us: dict[tuple[int, int], float] = {}   # last GPU slice end per stream row
        self._meta(HOST_PID, None, "process_name", "host")
        self._meta(HOST_PID, None, "process_sort_index", 0)

    # -- clock and rows -----------------------------------------------------
    def now_us(self) -> float:
        return (time.perf_counter_ns() - self.origin_ns) / 1000.0

    def _meta(self, pid: int, tid: int | None, name: str, value) -> None:
        key = "sort_index" if name.endswith("sort_index") else "name"
        event = {"ph": "M", "pid": pid, "name": name, "args": {key: value}}
        if tid is not None:
            event["tid"] = tid
        self.events.append(event)

    def _row(self, pid: int, key, label: str) -> int:
        """tid of a row, naming it (thread_name metadata) the first time it is used."""
        tid = self._rows.get((pid, key))
        if tid is None:
            with self._lock:
                tid = self._rows.setdefault((pid, key), sum(1 for p, k in self._rows if p == pid and k is not None) + 1)
                self._meta(pid, tid, "thread_name", label)
                self._meta(pid, tid, "thread_sort_index", tid)
        return tid

    def _host_tid(self) -> int:
        thread = threading.current_thread()
        return self._row(HOST_PID, thread.ident, "main" if thread is threading.main_thread() else thread.name)

    def _args(self, args: dict) -> dict:
        if self.current_step is not None and "step" not in args:
            args["step"] = self.current_step
        return args

    def _host_slice(self, name: str, cat: str, start_us: float, end_us: float, args: dict) -> dict:
        event = {"ph": "X", "cat": cat, "name": name, "pid": HOST_PID, "tid": self._host_tid(),
                 "ts": start_us, "dur": end_us - start_us, "args": self._args(args)}
        self.events.append(event)
        return event

    # -- host side ----------------------------------------------------------
    def span(self, name: str, cat: str = "host", **args) -> _Span:
        return _Span(self, name, cat, args)

    def host_slice(self, name: str, start_ns: int, end_ns: int, cat: str = "host", **args) -> None:
        """A host slice timed elsewhere (a native call's own clock reads): start_ns and end_ns on
        time.perf_counter_ns's clock (CLOCK_MONOTONIC on Linux)."""
        self._host_slice(name, cat, (start_ns - self.origin_ns) / 1000.0, (end_ns - self.origin_ns) / 1000.0, args)

    def lane_span(self, lane: str, name: str, cat: str = "host", **args) -> _LaneSpan:
        return _LaneSpan(self, lane, name, cat, args)

    def step(self, tokens: int, **args) -> _Step:
        return _Step(self, "step", "host", dict(args, tokens=tokens))

    def sync(self, what: str, **args) -> _Span:
        """A host wait on the device (stream/event/context synchronize)."""
        return _Span(self, f"sync {what}", "sync", args)

    def counter(self, name: str, values: dict, device: int | None = None) -> None:
        pid = HOST_PID if device is None else self.device_pid(device)
        self.events.append({"ph": "C", "name": name, "pid": pid, "ts": self.now_us(),
                            "args": {k: float(v) for k, v in values.items()}})

    # -- device side --------------------------------------------------------
    def gpu_counter(self, name: str, values: dict, at_ms: float, device: int = 0) -> None:
        """A counter sample on device ``device``'s track at a GPU time (ms since its reference event)."""
        self.events.append({"ph": "C", "name": name, "pid": self.device_pid(device),
                            "ts": self._reference_us[device] + at_ms * 1000.0,
                            "args": {k: float(v) for k, v in values.items()}})

    def device_pid(self, device: int, label: str | None = None) -> int:
        pid = DEVICE_PID_BASE + device
        if (pid, None) not in self._rows:
            self._rows[(pid, None)] = 0
            self._meta(pid, None, "process_name", label or f"cuda:{device}")
            self._meta(pid, None, "process_sort_index", pid)
        return pid

    def set_reference(self, device: int = 0, host_us: float | None = None, label: str | None = None) -> None:
        """Pin device ``device``'s reference event to the host clock (now, unless given)."""
        self.device_pid(device, label)
        self._reference_us[device] = self.now_us() if host_us is None else host_us

    def launch(self, stream: str, name: str, *, device: int = 0, host_start_us: float | None = None,
               cat: str = "kernel", **args) -> int:
        """A kernel (or graph) launch just issued; returns the id to hand to ``gpu_done``.

        ``host_start_us`` (from ``now_us()`` before the driver call) makes the
        host slice cover the call; without it the slice is the recorder's own time.
        """
        start_us = self.now_us() if host_start_us is None else host_start_us
        op_id = next(self._ids)
        kind = "copy" if cat == "memcpy" else "launch"
        host = self._host_slice(f"{kind} {name}", "host", start_us, self.now_us(),
                                {"kind": kind, "stream": stream, "device": device, "id": op_id})
        self._pending[op_id] = {"host": host, "stream": stream, "name": name, "device": device,
                                "cat": cat, "args": self._args(args)}
        return op_id

    def copy(self, stream: str, direction: str, nbytes: int, *, device: int = 0,
             host_start_us: float | None = None, **args) -> int:
        """An async copy just issued; ``direction`` is "h2d" or "d2h" (its byte count wins over any ``bytes`` arg)."""
        args.update(direction=direction, bytes=int(nbytes))
        return self.launch(stream, f"memcpy {direction}", device=device, host_start_us=host_start_us,
                           cat="memcpy", **args)

    def gpu_done(self, op_id: int, start_ms: float, end_ms: float) -> None:
        """GPU begin/end of a launch or copy, in ms since its device's reference event."""
        op = self._pending.pop(op_id, None)
        if op is None:          # issued under an earlier recorder (tracing was restarted): nothing to pair
            return
        gpu = self.gpu_span(op["stream"], op["name"], start_ms, end_ms, device=op["device"],
                            cat=op["cat"], **op["args"])
        host = op["host"]
        # Both ends sit mid-slice so each binds to the slice it belongs to, not a neighbour.
        common = {"cat": op["cat"], "name": "launch", "id": op_id, "bp": "e"}
        self.events.append(dict(common, ph="s", pid=host["pid"], tid=host["tid"],
                                ts=host["ts"] + host["dur"] / 2))
        self.events.append(dict(common, ph="f", pid=gpu["pid"], tid=gpu["tid"],
                                ts=gpu["ts"] + gpu["dur"] / 2))

    def gpu_span(self, stream: str, name: str, start_ms: float, end_ms: float, *, device: int = 0,
                 cat: str = "kernel", **args) -> dict:
        """A GPU slice with no host launch of its own (e.g. one node of a replayed graph)."""
        assert device in self._reference_us, f"set_reference({device}) must come before GPU times of device {device}"
        ref_us = self._reference_us[device]
        pid = self.device_pid(device)
        tid = self._row(pid, stream, stream)
        start_us, end_us = ref_us + start_ms * 1000.0, ref_us + max(end_ms, start_ms) * 1000.0
        previous_end_us = self._row_end_us.get((pid, tid), start_us)
        if start_us < previous_end_us < start_us + EVENT_RESOLUTION_US:
            # Work on one stream runs in order; an overlap this small is event-timer rounding,
            # and viewers drop slices that straddle their neighbour.
            start_us = min(previous_end_us, end_us)
        self._row_end_us[(pid, tid)] = max(end_us, previous_end_us)
        event = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": start_us,
                 "dur": end_us - start_us, "args": self._args(args)}
        self.events.append(event)
        return event

    def event_record(self, stream: str, event: str, *, device: int = 0, **args) -> None:
        self._instant(f"record {event}", stream, device, dict(args, event=event))

    def stream_wait(self, stream: str, event: str, *, device: int = 0, **args) -> None:
        self._instant(f"wait {event}", stream, device, dict(args, event=event))

    def _instant(self, name: str, stream: str, device: int, args: dict) -> None:
        # Host-side API calls: the GPU time of a record or wait is not measured.
        self.events.append({"ph": "i", "s": "t", "cat": "sync", "name": name, "pid": HOST_PID,
                            "tid": self._host_tid(), "ts": self.now_us(),
                            "args": self._args(dict(args, stream=stream, device=device))})

    # -- output -------------------------------------------------------------
    def to_json(self) -> dict:
        unresolved = len(self._pending)     # launches whose GPU times never came: host slice only
        return {"traceEvents": self.events, "displayTimeUnit": "ms",
                "otherData": dict(self.metadata, producer="kestrel-stream", clock="host perf_counter, us",
                                  unresolved_gpu_ops=unresolved)}

    def write(self) -> Path:
        data = json.dumps(self.to_json(), separators=(",", ":")).encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        opener = gzip.open if self.path.suffix == ".gz" else open
        with opener(self.path, "wb") as f:
            f.write(data)
        return self.path


# -- the process-wide switch ------------------------------------------------
def start(path: str | os.PathLike, **metadata) -> Recorder:
    """Begin recording to ``path`` (replacing any trace in progress, which is written first)."""
    global active
    stop()
    active = Recorder(path, metadata)
    return active


def stop() -> Path | None:
    """Write the trace in progress, if any, and turn tracing off; returns the file written."""
    global active
    rec, active = active, None
    return rec.write() if rec is not None else None


def start_for_process(path: str | None) -> Recorder | None:
    """Trace the whole process into `path` (Options.trace_path, ``KESTREL_TRACE=FILE``), written at exit;
    the trace already running, if any, stays."""
    if path and active is None:
        atexit.register(stop)
        return start(path)
    return active


def span(name: str, cat: str = "host", **args):
    rec = active
    return NULL_SPAN if rec is None else rec.span(name, cat, **args)


def lane_span(lane: str, name: str, cat: str = "host", **args):
    """A span on the host's row named `lane` (e.g. "draft": speculative decoding's drafting)."""
    rec = active
    return NULL_SPAN if rec is None else rec.lane_span(lane, name, cat, **args)


def step(tokens: int, **args):
    rec = active
    return NULL_SPAN if rec is None else rec.step(tokens, **args)
