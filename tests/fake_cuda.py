"""A numpy emulation of the CUDA device layer (driver.py, memory.py) and of every kernel of kernels_ptx.

`install(monkeypatch)` swaps it into kestrel_stream.cuda, so the real executors run with no GPU.

Memory: each Arena is one numpy uint8 buffer at a fake device address; every
device access is checked to lie inside one live arena block.  Fresh device and
pinned memory is filled with 0xFF (float NaN, uint32 0xFFFFFFFF), as neither
allocator zeroes it.  Host memory that async copies touch is resolved by address
to a live pinned buffer (use after free raises); copies enqueued during capture
must use pinned memory.

Devices: DEVICE_COUNT of them, each with a context a thread makes current
(``Device.make_current``); an arena belongs to the device current where it was
made, and in the "immediate" policy (where ops run on the thread that enqueues
them) a device access from a thread whose current device is another raises,
as a pointer of another context would fail on a GPU.

Streams, events and graphs (ordering policies, capture, replay): fake_streams.py.
Kernels: FakeKernelSet launches the numpy twins of fake_kernels.py.  Not
modelled: real concurrency and timing, memory ordering inside a kernel, launch
limits beyond simple geometry and alignment checks.
"""
from __future__ import annotations

import os
import time
import threading

import itertools
import re

import numpy as np

from kestrel_stream.cuda import driver as real_driver
from kestrel_stream.cuda.memory import Arena as RealArena

import fake_streams
from fake_streams import POLICY, Event, Graph, Stream, capture, new_stream

CudaError = real_driver.CudaError
_arenas: list = []
_pinned: dict[int, "PinnedBuffer"] = {}        # address -> live pinned buffer (or registered array)
_bases = itertools.count(1)
DEVICE_COUNT = 2
EMULATED_HOST_BYTES = 1 << 40     # MemAvailable of the emulated machine (run/host_memory.py)
_current = threading.local()                    # .ordinal: the device whose context this thread made current


def current_ordinal() -> int | None:
    return getattr(_current, "ordinal", None)


# ---- memory -----------------------------------------------------------------------------------------
class Arena(RealArena):
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.mem = np.full(capacity_bytes, 0xFF, np.uint8)
        self.base = (0x7000 + next(_bases)) << 32
        self._top, self._free, self._live = 0, [], {}
        self.used_bytes = self.peak_bytes = 0
        self.device = current_ordinal()         # None: made with no device current (a test's own arena)
        _arenas.append(self)

    def release(self) -> None:
        if self.base:
            _arenas.remove(self)
            self.base = 0


def dev(ptr: int, nbytes: int, dtype=np.uint8) -> np.ndarray:
    """The device bytes [ptr, ptr + nbytes) as `dtype`; they must lie in one live arena block."""
    for a in _arenas:
        if a.base <= ptr < a.base + a.capacity_bytes:
            off = ptr - a.base
            current = current_ordinal()
            if POLICY["mode"] == "immediate" and None not in (a.device, current) and a.device != current:
                raise CudaError(f"device access to an arena of device {a.device} while device {current}'s "
                                f"context is current")
            if not any(o <= off and off + nbytes <= o + s for o, s in a._live.items()):
                raise CudaError(f"device access [{off}, +{nbytes}) outside any live arena block")
            assert off % np.dtype(dtype).itemsize == 0, "misaligned device access"
            return a.mem[off:off + nbytes].view(dtype)
    for base, buf in _pinned.items():        # mapped pinned host memory (unified addressing: zero-copy reads)
        if base <= ptr and ptr + nbytes <= base + buf.nbytes:
            return buf.bytes[ptr - base:ptr - base + nbytes].view(dtype)
    raise CudaError(f"device pointer {ptr:#x} in no arena (null, freed or host?)")


def host(address: int, nbytes: int, dtype=np.uint8) -> np.ndarray:
    """Page-locked host bytes [address, address + nbytes) a kernel reads (unified addressing): they must lie
    in one live pinned buffer."""
    for base, buf in _pinned.items():
        if base <= address and address + nbytes <= base + buf.nbytes:
            return buf.bytes[address - base:address - base + nbytes].view(dtype)
    raise CudaError(f"host pointer {address:#x} (+{nbytes}) in no live pinned buffer")


class PinnedBuffer:
    def __init__(self, nbytes: int):
        if fake_streams.capturing():
            raise CudaError("cuMemHostAlloc failed: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
        self.nbytes = nbytes
        self.bytes = np.full(max(nbytes, 1), 0xFF, np.uint8)
        self.address = self.bytes.ctypes.data
        _pinned[self.address] = self

    def view(self, dtype, shape, offset_bytes: int = 0) -> np.ndarray:
        count = int(np.prod(shape))
        end = offset_bytes + count * np.dtype(dtype).itemsize
        assert end <= self.nbytes, "view past the end of the pinned buffer"
        return self.bytes[offset_bytes:end].view(dtype).reshape(shape)

    def free(self) -> None:
        if self.address:
            del _pinned[self.address]
            self.address = 0


class RegisteredBuffer(PinnedBuffer):
    """memory.RegisteredBuffer: plain host bytes until `pin`, then pinned (a kernel reads it only after)."""

    def __init__(self, nbytes: int):
        self.nbytes, self.pinned = nbytes, False
        self.bytes = np.full(max(nbytes, 1), 0xFF, np.uint8)
        self.address = self.bytes.ctypes.data

    def pin(self) -> None:
        if fake_streams.capturing():
            raise CudaError("cuMemHostRegister failed: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
        if not self.pinned:
            _pinned[self.address], self.pinned = self, True

    def free(self) -> None:
        if self.address:
            if self.pinned:
                del _pinned[self.address]
            self.address, self.pinned = 0, False


class _Registered:
    def __init__(self, array):
        self.bytes, self.address, self.nbytes = array.reshape(-1).view(np.uint8), array.ctypes.data, array.nbytes


def register_host(array: np.ndarray) -> None:
    _pinned.setdefault(array.ctypes.data, _Registered(array))


def _host(src, nbytes: int, capturing: bool):
    """(buffer, offset): the pinned buffer holding [address, +nbytes), or the pageable array itself."""
    address = src.address if isinstance(src, PinnedBuffer) else src.ctypes.data
    for buf in _pinned.values():
        if buf.address <= address and address + nbytes <= buf.address + buf.nbytes:
            return buf, address - buf.address
    if capturing:
        raise CudaError("stream capture of a copy from pageable (unpinned) host memory")
    assert isinstance(src, np.ndarray) and src.flags.c_contiguous and nbytes <= src.nbytes, "copy past the array"
    return _Registered(src), 0


def _host_bytes(buf, off: int, nbytes: int) -> np.ndarray:
    if not isinstance(buf, _Registered) and _pinned.get(buf.address) is not buf:
        raise CudaError("async copy touches a pinned buffer after its free()")
    return buf.bytes[off:off + nbytes]


# ---- copies ---------------------------------------------------------------------------------------------
def h2d_async(dst_ptr: int, src, nbytes: int, stream: Stream, **labels) -> None:
    buf, off = _host(src, nbytes, stream.capturing)
    dev(dst_ptr, nbytes)
    stream.enqueue("run", lambda: dev(dst_ptr, nbytes).__setitem__(slice(None), _host_bytes(buf, off, nbytes)))


def d2h_async(dst, src_ptr: int, nbytes: int, stream: Stream, **labels) -> None:
    buf, off = _host(dst, nbytes, stream.capturing)
    dev(src_ptr, nbytes)
    stream.enqueue("run", lambda: _host_bytes(buf, off, nbytes).__setitem__(slice(None), dev(src_ptr, nbytes)))


def h2d_sync(dst_ptr: int, src: np.ndarray) -> None:
    if fake_streams.capturing():
        raise CudaError("cuMemcpyHtoD while a stream is being captured")
    src = np.ascontiguousarray(src)
    dev(dst_ptr, src.nbytes)[:] = src.reshape(-1).view(np.uint8)


def d2d_async(dst_ptr: int, src_ptr: int, nbytes: int, stream: Stream) -> None:
    dev(dst_ptr, nbytes), dev(src_ptr, nbytes)
    stream.enqueue("run", lambda: dev(dst_ptr, nbytes).__setitem__(slice(None), dev(src_ptr, nbytes)))


def memset_async(ptr: int, nbytes: int, stream: Stream) -> None:
    dev(ptr, nbytes)
    stream.enqueue("run", lambda: dev(ptr, nbytes).__setitem__(slice(None), 0))


def host_word(address: int) -> int:
    host(address, 4)                  # a word of a live pinned buffer
    return address


def write_value(stream: Stream, word: int, value: int) -> None:
    stream.enqueue("run", lambda: host(word, 4, np.uint32).__setitem__(0, value))


WAIT_VALUE_S = 30.0


def wait_value(stream: Stream, word: int, value: int) -> None:
    """The stream's ops after this wait (this thread polling) until another thread -- the host library's
    server (native/host_serve.c) -- writes the word."""
    def wait():
        give_up = time.monotonic() + WAIT_VALUE_S
        while int(host(word, 4, np.uint32)[0]) < value:
            if time.monotonic() > give_up:
                raise CudaError(f"cuStreamWaitValue32: word {word:#x} never reached {value}")
            time.sleep(1e-5)
    stream.enqueue("run", wait)


class Device:
    def __init__(self, ordinal: int = 0):
        if not 0 <= ordinal < DEVICE_COUNT:
            raise CudaError(f"cuDeviceGet failed: CUDA_ERROR_INVALID_DEVICE (ordinal {ordinal} of {DEVICE_COUNT})")
        self.ordinal = ordinal
        self.arch, self.name, self.sm_count = "sm_90", "Emulated H200", 132
        self.make_current()

    def make_current(self) -> None:
        _current.ordinal = self.ordinal

    def free_bytes(self) -> int:
        return 140 << 30


# ---- kernels ----------------------------------------------------------------------------------------------
_READ = {"p": np.uint64, "q": np.int64, "i": np.int32, "f": np.float32}


class FakeLaunch:
    programmatic = False   # kernels.Launch's programmatic stream serialization flag (no effect here)
    launch_count = 1

    def __init__(self, name: str, grid, block, signature: str, args, shared_bytes: int = 0):
        from fake_kernels import KERNELS   # the numpy twins of kernels_ptx
        assert len(signature) == len(args), f"{name}: {len(args)} args for signature {signature!r}"
        self.name, self.signature, self.shared_bytes = name, signature, shared_bytes
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block = tuple(block) + (1,) * (3 - len(block))
        self.impl = next((fn for pattern, fn in KERNELS if re.fullmatch(pattern, name)), None)
        if self.impl is None:
            raise KeyError(f"no kernel named {name!r}")
        self.storage = np.zeros(max(len(args), 1), np.uint64)
        self.labels: dict = {}
        for i, value in enumerate(args):
            self.set(i, value)

    def label(self, **labels) -> "FakeLaunch":
        self.labels.update((k, v) for k, v in labels.items() if v is not None)
        return self

    def set(self, index: int, value) -> None:
        kind = self.signature[index]
        slot = self.storage[index:index + 1]
        slot[0] = 0
        slot.view(_READ[kind])[0] = _READ[kind](value)

    def arg(self, index: int):
        kind = self.signature[index]
        value = self.storage[index:index + 1].view(_READ[kind])[0]
        return float(value) if kind == "f" else int(value)

    def enqueue(self, stream: Stream) -> None:
        """The arguments as they are now (cuLaunchKernel and graph capture copy them), run when the stream gets there."""
        args = [self.arg(i) for i in range(len(self.signature))]
        stream.enqueue("run", lambda: self.impl(self, *args))

    submit = enqueue


class FakeKernelSet:
    def __init__(self, device=None, options=None):
        self.device = device
        self.gemv_m1 = options.gemv_m1 if options is not None else None
        self.gemv_mn = options.gemv_mn if options is not None else None
        self.gemv_block = options.gemv_block if options is not None else None
        self.block_mma_min_tokens = options.block_mma_min_tokens if options is not None else None
        self.moe_mma_min_tokens = options.moe_mma_min_tokens if options is not None else None
        self.moe_mma_tile = options.moe_mma_tile if options is not None else None
        self.moe_gemv = options.moe_gemv if options is not None else None

    def launch(self, kernel_name: str, grid, block, signature: str, args, shared_bytes: int = 0) -> FakeLaunch:
        return FakeLaunch(kernel_name, grid, block, signature, args, shared_bytes)


# ---- installing -------------------------------------------------------------------------------------------------
def install(monkeypatch, mode: str = "immediate", cublas: bool = False) -> None:
    """Swap the emulation into kestrel_stream.cuda for the test (monkeypatch undoes it).  cublas: an
    emulated cuBLAS (fake_dense.FakeCublas) for the library GEMM path; else the library is absent."""
    import kestrel_stream.run.calibrate
    import scheduler
    from kestrel_stream.cuda import calibrate
    from kestrel_stream.cuda import cublas as cublas_module
    from fake_dense import FakeCublas
    from kestrel_stream.run.device import backend as device_backend
    from kestrel_stream.cuda import kernels
    from kestrel_stream.run import host_memory
    monkeypatch.setitem(POLICY, "mode", mode)
    _current.ordinal = None                 # no device current on this thread until a Device is made
    names = dict(Device=Device, Stream=new_stream, Event=Event, PinnedBuffer=PinnedBuffer, Arena=Arena,
                 RegisteredBuffer=RegisteredBuffer,
                 register_host=register_host, h2d_async=h2d_async, d2h_async=d2h_async, h2d_sync=h2d_sync,
                 d2d_async=d2d_async, memset_async=memset_async, host_word=host_word, write_value=write_value, wait_value=wait_value, capture=capture, Graph=Graph,
                 detect=lambda: "Emulated H200 sm_90", gpu_available=lambda: True, device_count=lambda: DEVICE_COUNT,
                 gpu_status=lambda: (True, "Emulated H200 sm_90"))
    for name, value in names.items():
        monkeypatch.setattr(real_driver, name, value)
    # the emulated machine's host memory: room for any test's pinned images (a test sets less to see the guard)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: EMULATED_HOST_BYTES)
    for module in (kernels, device_backend, calibrate):
        monkeypatch.setattr(module, "KernelSet", FakeKernelSet)
    monkeypatch.setattr(kestrel_stream.run.calibrate, "calibrate", lambda *a, **k: scheduler.H200_MEASURED)
    # gpu mode under a budget keeps the window alone unless a test asks for mode offload's choice: the
    # emulation has no host memory pool to weigh
    if "KESTREL_OFFLOAD" not in os.environ:
        monkeypatch.setenv("KESTREL_OFFLOAD", "stream")
    monkeypatch.setattr(cublas_module, "load", (lambda log=None: FakeCublas()) if cublas else (lambda log=None: None))
    monkeypatch.setattr(cublas_module, "available", lambda: cublas)
