"""The device layer: every CUDA driver call of kestrel-stream goes through here.

A few small classes over ``cuda.bindings.driver`` (tinygrad's shape: allocator,
copies, streams/events, graphs), each driver call through ``check()``, which
raises ``CudaError`` naming the failing call and the driver's error name.
Importing this module never touches the driver; ``detect()`` probes it once.

Tracing lives here too, so every executor is traced without code of its own:
while ``trace.active`` is set, async copies, kernel launches (kernels.Launch)
and graph replays are bracketed by two timing events from a pool and reported
to the recorder on their stream's row (``Stream.name``); event records, stream
waits and host syncs are reported as they happen.  GPU times are read lazily,
after the next host sync, against one reference event per trace (device_trace.py);
tracing adds no sync of its own.  Work enqueued while a stream is being
captured into a graph is not timed (an event record there would become a graph
edge): the graph's replays are, one span each.  While tracing is off, each
hook costs one attribute check.
"""
from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Callable

import numpy as np
from cuda.bindings import driver as cu

from kestrel_stream.obs import trace
from kestrel_stream.cuda.device_trace import GpuTimes
from kestrel_stream.cuda.errors import CudaError, check
# host and device memory (pinned buffers, registration, the arena) live in memory.py; re-exported here
from kestrel_stream.cuda.memory import Arena, DeviceArray, PinnedBuffer, RegisteredBuffer, register_host  # noqa: F401


_detected: str | None = None


def detect() -> str:
    """"no GPU: <why>" or "<name> sm_XY"; probes the driver once per process, never hangs.

    Without a driver library, cuInit raises cuda.pathfinder's DynamicLibNotFoundError
    (a RuntimeError) instead of returning an error code.
    """
    global _detected
    if _detected is None:
        try:
            (err,) = cu.cuInit(0)
            if err != cu.CUresult.CUDA_SUCCESS:
                _detected = f"no GPU: cuInit returned {err.name}"
            else:
                count = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
                if count == 0:
                    _detected = "no GPU: no CUDA device"
                else:
                    dev = check(cu.cuDeviceGet(0), "cuDeviceGet")
                    name = check(cu.cuDeviceGetName(256, dev), "cuDeviceGetName")
                    name = name.split(b"\0", 1)[0].decode()
                    _detected = f"{name} {device_arch(dev)}"
        except (RuntimeError, OSError) as e:   # library absent or unusable
            _detected = f"no GPU: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return _detected


def gpu_available() -> bool:
    return not detect().startswith("no GPU")


def gpu_status() -> tuple[bool, str]:
    """(available, "<device> sm_XY" or why not): what the engine and the test suite ask."""
    text = detect()
    return (False, text[len("no GPU: "):]) if text.startswith("no GPU") else (True, text)


def device_count() -> int:
    """The GPUs the driver sees (0 without a usable GPU); ordinals run 0..count-1."""
    if not gpu_available():
        return 0
    return int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))


def device_attribute(dev, attr: str) -> int:
    return check(cu.cuDeviceGetAttribute(getattr(cu.CUdevice_attribute, attr), dev), attr)


def device_arch(dev) -> str:
    major = device_attribute(dev, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR")
    minor = device_attribute(dev, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR")
    return f"sm_{major}{minor}"


class Device:
    """Device `ordinal` with its primary context made current on the calling thread."""

    def __init__(self, ordinal: int = 0):
        if not gpu_available():
            raise CudaError(detect())
        self.ordinal = ordinal          # one primary context per device: kernel modules are loaded per ordinal
        self.handle = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
        self.make_current()
        self.arch = device_arch(self.handle)
        self.name = detect().rsplit(" ", 1)[0]
        self.sm_count = device_attribute(self.handle, "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT")

    def make_current(self) -> None:
        """The engine may call from a worker thread; a context is current per thread."""
        check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def free_bytes(self) -> int:
        free, _total = check(cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free)


class Event:
    """`name` labels its record/wait instants in a trace ("weights 3 ready", ...).  A record inside a stream
    capture only orders the captured streams and leaves nothing a host can wait on; an `external` event's
    record becomes an event-record node of the graph (CU_EVENT_RECORD_EXTERNAL), so each replay records it
    and the host can synchronize on it (a step's outputs, before the graph's tail).  A `blocking` event's
    waiter sleeps (CU_EVENT_BLOCKING_SYNC) instead of spinning on a core the host's own work needs."""

    def __init__(self, timing: bool = False, name: str = "event", external: bool = False, blocking: bool = False):
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT if timing else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        if blocking:
            flags = int(flags) | int(cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
        self.handle = check(cu.cuEventCreate(flags), "cuEventCreate")
        self.name = name
        self.external = external

    def record(self, stream: "Stream") -> None:
        if self.external and stream.capturing:      # the flag is only valid inside a capture
            check(cu.cuEventRecordWithFlags(self.handle, stream.handle,
                                            cu.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL), "cuEventRecordWithFlags")
        else:
            check(cu.cuEventRecord(self.handle, stream.handle), "cuEventRecord")
        rec = trace.active
        if rec is not None and not stream.capturing:
            rec.event_record(stream.name, self.name)

    def synchronize(self) -> None:
        rec = trace.active
        if rec is None:
            check(cu.cuEventSynchronize(self.handle), "cuEventSynchronize")
            return
        with rec.sync(f"event {self.name}"):
            check(cu.cuEventSynchronize(self.handle), "cuEventSynchronize")
        resolve_gpu_times(rec)

    def query(self) -> bool:
        """True once the GPU has passed the event's last record (cuEventQuery; never waits)."""
        (err,) = cu.cuEventQuery(self.handle)
        if err == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        check((err,), "cuEventQuery")
        return True

    def mark(self, stream: "Stream") -> None:
        """Record without a trace report (tracing's own timing events)."""
        check(cu.cuEventRecord(self.handle, stream.handle), "cuEventRecord")

    def elapsed_ms(self, since: "Event") -> float:
        return float(check(cu.cuEventElapsedTime(since.handle, self.handle), "cuEventElapsedTime"))

    def destroy(self) -> None:
        check(cu.cuEventDestroy(self.handle), "cuEventDestroy")


_stream_numbers = itertools.count(1)


class Stream:
    """A non-blocking stream (no implicit ordering with the legacy default stream).

    `name` is its row in a trace ("compute", "copy h2d", ...); `capturing` is
    set while `capture()` records it into a graph.
    """

    def __init__(self, name: str | None = None):
        self.handle = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        self.name = name or f"stream {next(_stream_numbers)}"
        self.capturing = False

    def synchronize(self) -> None:
        rec = trace.active
        if rec is None:
            check(cu.cuStreamSynchronize(self.handle), "cuStreamSynchronize")
            return
        with rec.sync(self.name):
            check(cu.cuStreamSynchronize(self.handle), "cuStreamSynchronize")
        resolve_gpu_times(rec)

    def wait(self, event: Event) -> None:
        check(cu.cuStreamWaitEvent(self.handle, event.handle, 0), "cuStreamWaitEvent")
        rec = trace.active
        if rec is not None and not self.capturing:
            rec.stream_wait(self.name, event.name)


def h2d_async(dst_ptr: int, src: np.ndarray | PinnedBuffer, nbytes: int, stream: Stream, **labels) -> None:
    """`labels` (op, layer, ...) go into the copy's trace args."""
    address = src.address if isinstance(src, PinnedBuffer) else src.ctypes.data
    rec = trace.active
    if rec is None or stream.capturing:
        check(cu.cuMemcpyHtoDAsync(dst_ptr, address, nbytes, stream.handle), "cuMemcpyHtoDAsync")
        return
    timed(rec, stream, lambda: check(cu.cuMemcpyHtoDAsync(dst_ptr, address, nbytes, stream.handle),
                                     "cuMemcpyHtoDAsync"), "h2d", direction="h2d", nbytes=nbytes, **labels)


def d2h_async(dst: np.ndarray | PinnedBuffer, src_ptr: int, nbytes: int, stream: Stream, **labels) -> None:
    address = dst.address if isinstance(dst, PinnedBuffer) else dst.ctypes.data
    rec = trace.active
    if rec is None or stream.capturing:
        check(cu.cuMemcpyDtoHAsync(address, src_ptr, nbytes, stream.handle), "cuMemcpyDtoHAsync")
        return
    timed(rec, stream, lambda: check(cu.cuMemcpyDtoHAsync(address, src_ptr, nbytes, stream.handle),
                                     "cuMemcpyDtoHAsync"), "d2h", direction="d2h", nbytes=nbytes, **labels)


def h2d_sync(dst_ptr: int, src: np.ndarray) -> None:
    """Load-time upload from pageable memory (weights, once)."""
    src = np.ascontiguousarray(src)
    check(cu.cuMemcpyHtoD(dst_ptr, src.ctypes.data, src.nbytes), "cuMemcpyHtoD")


def d2d_async(dst_ptr: int, src_ptr: int, nbytes: int, stream: Stream) -> None:
    """Device-to-device copy in stream order (KV blocks: copy-on-write, forks)."""
    check(cu.cuMemcpyDtoDAsync(dst_ptr, src_ptr, nbytes, stream.handle), "cuMemcpyDtoDAsync")


def memset_async(ptr: int, nbytes: int, stream: Stream) -> None:
    check(cu.cuMemsetD8Async(ptr, 0, nbytes, stream.handle), "cuMemsetD8Async")


def host_word(address: int) -> int:
    """The device's address of a word of pinned host memory (cuMemHostGetDevicePointer), for write_value
    and wait_value."""
    return int(check(cu.cuMemHostGetDevicePointer(address, 0), "cuMemHostGetDevicePointer"))


def write_value(stream: Stream, word: int, value: int) -> None:
    """Write `value` into a 32-bit word (host_word's) in stream order, after the work before it is done and
    visible (cuStreamWriteValue32; captured, a memory-operation node)."""
    check(cu.cuStreamWriteValue32(stream.handle, cu.CUdeviceptr(word), value, 0), "cuStreamWriteValue32")


def wait_value(stream: Stream, word: int, value: int) -> None:
    """Hold the work after this on `stream` until the word holds `value` or more (cuStreamWaitValue32, GEQ)."""
    check(cu.cuStreamWaitValue32(stream.handle, cu.CUdeviceptr(word), value,
                                 cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32")


class Graph:
    """A captured stream's work, instantiated once and replayed with one launch.

    A traced replay is one GPU slice, `name`, with `labels` as its args.
    """

    def __init__(self, graph, name: str = "graph replay", **labels):
        self.graph = graph
        self.exec = check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        self.name, self.labels = name, dict(labels, graph=True)

    def launch(self, stream: Stream) -> None:
        rec = trace.active
        if rec is None or stream.capturing:
            check(cu.cuGraphLaunch(self.exec, stream.handle), "cuGraphLaunch")
            return
        timed(rec, stream, lambda: check(cu.cuGraphLaunch(self.exec, stream.handle), "cuGraphLaunch"),
              self.name, **self.labels)

    def destroy(self) -> None:
        check(cu.cuGraphExecDestroy(self.exec), "cuGraphExecDestroy")
        check(cu.cuGraphDestroy(self.graph), "cuGraphDestroy")


@contextmanager
def capture(stream: Stream):
    """Record everything enqueued on `stream` inside the block; yields a holder whose .graph is set after."""
    holder = type("Captured", (), {"graph": None})()
    mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    with trace.span("graph capture", stream=stream.name):
        check(cu.cuStreamBeginCapture(stream.handle, mode), "cuStreamBeginCapture")
        stream.capturing = True
        try:
            yield holder
        except BaseException:
            cu.cuStreamEndCapture(stream.handle)   # leave the stream usable; the original error wins
            raise
        finally:
            stream.capturing = False
        holder.graph = Graph(check(cu.cuStreamEndCapture(stream.handle), "cuStreamEndCapture"))


# ---- tracing: one device_trace.GpuTimes per recorder ---------------------------------------------------
_gpu_times: GpuTimes | None = None      # the active recorder's, made at its first timed op
_reference_stream = None                # a driver.Stream idle but for reference events: they complete at once


def _times_for(rec) -> GpuTimes:
    """The GPU clock of recorder `rec`, begun (a reference event on the idle stream) at its first op."""
    global _gpu_times, _reference_stream
    if _gpu_times is not None and _gpu_times.recorder is rec:
        return _gpu_times
    if _gpu_times is not None:              # a trace that ended: its events go back to the driver
        _gpu_times.close()
    if _reference_stream is None:
        _reference_stream = Stream("trace reference")
    reference = Event(timing=True, name="trace reference")
    reference.mark(_reference_stream)
    _gpu_times = GpuTimes(rec, reference, rec.now_us(), lambda: Event(timing=True),
                          label=f"cuda:0 {detect()}")
    return _gpu_times


def resolve_gpu_times(rec) -> None:
    """After a host sync: hand the GPU times of every op that completed to `rec`."""
    if _gpu_times is not None and _gpu_times.recorder is rec:
        _gpu_times.resolve()


def timed(rec, stream, enqueue: Callable[[], None], name: str, *, direction: str = "", nbytes: int = 0,
          **args) -> None:
    """Run `enqueue()` (one launch, copy or graph replay on driver.Stream `stream`) between two timing events.

    The host slice covers the driver call; the GPU slice, with a flow arrow
    from the host slice, appears once a later sync shows the events complete.
    """
    times = _times_for(rec)
    start, end = times.pair()
    start.mark(stream)
    host_start_us = rec.now_us()
    enqueue()
    if direction:
        op_id = rec.copy(stream.name, direction, nbytes, host_start_us=host_start_us, **args)
    else:
        op_id = rec.launch(stream.name, name, host_start_us=host_start_us, **args)
    end.mark(stream)
    times.add(op_id, start, end, direction, nbytes)
