"""Compiled kernel modules and launches with pre-packed argument arrays.

A `Launch` owns a numpy uint64 storage array (one 8-byte slot per argument) and
a `void*[]` array pointing into it; cuLaunchKernel gets the integer address of
the pointer array, so a launch packs nothing per call (cuda-bindings' tuple form
costs a packing pass every time).  Arguments are mutated in place with `set`.
"""
from __future__ import annotations

import numpy as np
from cuda.bindings import driver as cu

from kernels_ptx.build import KERNEL_SOURCES, compile_cubin

from .driver import Device, Stream, check

_modules: dict[tuple[str, str], object] = {}


def load_module(name: str, arch: str):
    """The CUmodule of kernels_ptx/<name> for `arch`: compiled (or read from the disk cache) once per process."""
    key = (name, arch)
    if key not in _modules:
        cubin, _log = compile_cubin(name, arch)
        _modules[key] = check(cu.cuModuleLoadData(cubin), f"cuModuleLoadData({name})")
    return _modules[key]


class KernelSet:
    """Every kernel function of every family, by name, for one device."""

    def __init__(self, device: Device):
        self.device = device
        self._functions: dict[str, object] = {}
        for source in KERNEL_SOURCES:
            load_module(source, device.arch)

    def function(self, kernel_name: str):
        if kernel_name not in self._functions:
            for source in KERNEL_SOURCES:
                err, fn = cu.cuModuleGetFunction(load_module(source, self.device.arch), kernel_name.encode())
                if err == cu.CUresult.CUDA_SUCCESS:
                    self._functions[kernel_name] = fn
                    break
            else:
                raise KeyError(f"no kernel named {kernel_name!r} in {', '.join(KERNEL_SOURCES)}")
        return self._functions[kernel_name]

    def launch(self, kernel_name: str, grid, block, signature: str, args, shared_bytes: int = 0) -> "Launch":
        return Launch(self.function(kernel_name), kernel_name, grid, block, signature, args, shared_bytes)


# argument kinds: "p" device pointer (or 0 for null), "i" int32, "q" int64, "f" float32
_WRITERS = {"p": np.uint64, "q": np.int64, "i": np.int32, "f": np.float32}


class Launch:
    """One kernel launch with its grid, block and pre-packed arguments."""

    def __init__(self, function, name: str, grid, block, signature: str, args, shared_bytes: int = 0):
        assert len(signature) == len(args), f"{name}: {len(args)} args for signature {signature!r}"
        self.function, self.name = function, name
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block = tuple(block) + (1,) * (3 - len(block))
        self.shared_bytes = shared_bytes
        self.signature = signature
        self.storage = np.zeros(max(len(args), 1), np.uint64)
        self.pointers = np.array([self.storage.ctypes.data + 8 * i for i in range(len(args))] or [0], np.uint64)
        self.params_address = self.pointers.ctypes.data
        for i, value in enumerate(args):
            self.set(i, value)

    def set(self, index: int, value) -> None:
        kind = self.signature[index]
        slot = self.storage[index:index + 1]
        slot[0] = 0   # 4-byte kinds fill the low half (little-endian); the rest stays zero
        slot.view(_WRITERS[kind])[0] = _WRITERS[kind](value)

    def enqueue(self, stream: Stream) -> None:
        gx, gy, gz = self.grid
        bx, by, bz = self.block
        (err,) = cu.cuLaunchKernel(self.function, gx, gy, gz, bx, by, bz, self.shared_bytes,
                                   stream.handle, self.params_address, 0)
        if err != cu.CUresult.CUDA_SUCCESS:
            check((err,), f"cuLaunchKernel({self.name} grid={self.grid} block={self.block})")
