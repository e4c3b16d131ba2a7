"""The device layer: every CUDA driver call of kestrel-stream goes through here.

A few small classes over ``cuda.bindings.driver`` (tinygrad's shape: allocator,
copies, streams/events, graphs), each driver call through ``check()``, which
raises ``CudaError`` naming the failing call and the driver's error name.
Importing this module never touches the driver; ``detect()`` probes it once.
"""
from __future__ import annotations

import ctypes
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from cuda.bindings import driver as cu


class CudaError(RuntimeError):
    """A driver call that did not return CUDA_SUCCESS."""


def check(result, what: str = "CUDA call"):
    """Unpack a cuda.bindings ``(err, *outputs)`` tuple; raise on error, return the outputs."""
    err, *outputs = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        text = name.decode() if isinstance(name, bytes) else str(err)
        raise CudaError(f"{what} failed: {text}")
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


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
    def __init__(self, timing: bool = False):
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT if timing else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = check(cu.cuEventCreate(flags), "cuEventCreate")

    def record(self, stream: "Stream") -> None:
        check(cu.cuEventRecord(self.handle, stream.handle), "cuEventRecord")

    def synchronize(self) -> None:
        check(cu.cuEventSynchronize(self.handle), "cuEventSynchronize")

    def elapsed_ms(self, since: "Event") -> float:
        return float(check(cu.cuEventElapsedTime(since.handle, self.handle), "cuEventElapsedTime"))


class Stream:
    """A non-blocking stream (no implicit ordering with the legacy default stream)."""

    def __init__(self):
        self.handle = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")

    def synchronize(self) -> None:
        check(cu.cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def wait(self, event: Event) -> None:
        check(cu.cuStreamWaitEvent(self.handle, event.handle, 0), "cuStreamWaitEvent")


class PinnedBuffer:
    """Page-locked host memory (cuMemHostAlloc) with a zero-copy uint8 numpy view."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.address = int(check(cu.cuMemHostAlloc(max(nbytes, 1), 0), "cuMemHostAlloc"))
        self.bytes = np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(self.address))

    def view(self, dtype, shape, offset_bytes: int = 0) -> np.ndarray:
        count = int(np.prod(shape))
        end = offset_bytes + count * np.dtype(dtype).itemsize
        assert end <= self.nbytes, "view past the end of the pinned buffer"
        return self.bytes[offset_bytes:end].view(dtype).reshape(shape)

    def free(self) -> None:
        if self.address:
            check(cu.cuMemFreeHost(self.address), "cuMemFreeHost")
            self.address = 0


_registered: dict[int, int] = {}


def register_host(array: np.ndarray) -> None:
    """Page-lock an existing array's memory once (weights); later H2D copies run at pinned speed."""
    address, nbytes = array.ctypes.data, array.nbytes
    if _registered.get(address, 0) >= nbytes:
        return
    check(cu.cuMemHostRegister(address, nbytes, 0), "cuMemHostRegister")
    _registered[address] = nbytes


@dataclass
class DeviceArray:
    """A typed window of the arena: `ptr` is a device address."""
    ptr: int
    shape: tuple
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


class Arena:
    """ONE device allocation, sub-allocated (bump + first-fit reuse of freed blocks).

    Weights, activations and KV caches all live here: no cuMemAlloc per tensor and
    none per step; `used_bytes` / `peak_bytes` account for every live block.
    """
    ALIGN = 256

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.base = int(check(cu.cuMemAlloc(capacity_bytes), f"cuMemAlloc({capacity_bytes} bytes)"))
        self._top = 0
        self._free: list[tuple[int, int]] = []   # (offset, size) of returned blocks
        self._live: dict[int, int] = {}
        self.used_bytes = 0
        self.peak_bytes = 0

    def alloc(self, nbytes: int) -> int:
        size = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        for i, (offset, free_size) in enumerate(self._free):
            if free_size >= size:
                rest = (offset + size, free_size - size)
                self._free[i:i + 1] = [rest] if rest[1] else []
                break
        else:
            if self._top + size > self.capacity_bytes:
                raise CudaError(f"device arena full: need {size} bytes, {self.capacity_bytes - self._top} "
                                f"left of {self.capacity_bytes}")
            offset = self._top
            self._top += size
        self._live[offset] = size
        self.used_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return self.base + offset

    def array(self, shape, dtype) -> DeviceArray:
        shape = tuple(int(s) for s in np.atleast_1d(shape))
        return DeviceArray(self.alloc(int(np.prod(shape)) * np.dtype(dtype).itemsize), shape, np.dtype(dtype))

    def free(self, ptr: int) -> None:
        offset = ptr - self.base
        size = self._live.pop(offset)
        self.used_bytes -= size
        self._free.append((offset, size))
        self._free.sort()

    def release(self) -> None:
        if self.base:
            check(cu.cuMemFree(self.base), "cuMemFree")
            self.base = 0


def h2d_async(dst_ptr: int, src: np.ndarray | PinnedBuffer, nbytes: int, stream: Stream) -> None:
    address = src.address if isinstance(src, PinnedBuffer) else src.ctypes.data
    check(cu.cuMemcpyHtoDAsync(dst_ptr, address, nbytes, stream.handle), "cuMemcpyHtoDAsync")


def d2h_async(dst: np.ndarray | PinnedBuffer, src_ptr: int, nbytes: int, stream: Stream) -> None:
    address = dst.address if isinstance(dst, PinnedBuffer) else dst.ctypes.data
    check(cu.cuMemcpyDtoHAsync(address, src_ptr, nbytes, stream.handle), "cuMemcpyDtoHAsync")


def h2d_sync(dst_ptr: int, src: np.ndarray) -> None:
    """Load-time upload from pageable memory (weights, once)."""
    src = np.ascontiguousarray(src)
    check(cu.cuMemcpyHtoD(dst_ptr, src.ctypes.data, src.nbytes), "cuMemcpyHtoD")


def memset_async(ptr: int, nbytes: int, stream: Stream) -> None:
    check(cu.cuMemsetD8Async(ptr, 0, nbytes, stream.handle), "cuMemsetD8Async")


class Graph:
    """A captured stream's work, instantiated once and replayed with one launch."""

    def __init__(self, graph):
        self.graph = graph
        self.exec = check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    def launch(self, stream: Stream) -> None:
        check(cu.cuGraphLaunch(self.exec, stream.handle), "cuGraphLaunch")

    def destroy(self) -> None:
        check(cu.cuGraphExecDestroy(self.exec), "cuGraphExecDestroy")
        check(cu.cuGraphDestroy(self.graph), "cuGraphDestroy")


@contextmanager
def capture(stream: Stream):
    """Record everything enqueued on `stream` inside the block; yields a holder whose .graph is set after."""
    holder = type("Captured", (), {"graph": None})()
    mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    check(cu.cuStreamBeginCapture(stream.handle, mode), "cuStreamBeginCapture")
    try:
        yield holder
    except BaseException:
        cu.cuStreamEndCapture(stream.handle)   # leave the stream usable; the original error wins
        raise
    holder.graph = Graph(check(cu.cuStreamEndCapture(stream.handle), "cuStreamEndCapture"))
