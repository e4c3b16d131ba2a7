"""NVRTC build of the kernel families to CUBIN, cached on disk.

CUBIN for the device's own arch, never PTX: the NVRTC wheel (13.5 here) emits a
PTX ISA newer than what an older driver (13.0 on the device) can JIT, while
CUBIN for sm_XY loads on any driver that knows the chip.  The cache key is a
hash of (source, options, NVRTC version, arch) so a new wheel or an edited
kernel never loads a stale binary.  This module imports no driver: it runs in
CI with no GPU.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from cuda.bindings import nvrtc

KERNEL_SOURCES = ("q8_gemv.cu", "q8_matmul.cu", "q8_mma.cu", "q8_mma_pipe.cu", "q8_mma_f16.cu", "q8_mma_f16_ws.cu",
                  "qkv_rope.cu", "attention.cu", "flash_attention.cu",
                  "elementwise.cu", "sample.cu", "q4_gemv.cu", "q4_mma.cu", "dense_gemm.cu",
                  "q4_gemv_m1.cu", "q4_gemv_mn.cu", "q4_gemv_mg.cu")
# no --use_fast_math: expf/sinf/cosf must track the numpy reference to ~1 ulp
BASE_OPTIONS = ("-std=c++17", "--extra-device-vectorization", "-lineinfo")


class KernelBuildError(RuntimeError):
    """An NVRTC failure; the message carries the full compile log."""


def source_dir() -> Path:
    return Path(__file__).resolve().parent


def default_cache_dir() -> Path:
    """Where compiled kernels go when a caller names no directory (the engine passes Options.kernel_cache)."""
    return Path.home() / ".cache" / "kestrel-stream" / "kernels"


def nvrtc_version() -> tuple[int, int]:
    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    return major, minor


def _check(err, what: str, log: str = "") -> None:
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, name = nvrtc.nvrtcGetErrorString(err)
        text = name.decode() if isinstance(name, bytes) else str(name)
        raise KernelBuildError(f"{what} failed: {text}" + (f"\n{log}" if log else ""))


def load_source(name: str) -> str:
    """The .cu text with local #include "x.cuh" spliced in (NVRTC sees one translation unit)."""
    text = (source_dir() / name).read_text()

    def splice(match: re.Match) -> str:
        return (source_dir() / match.group(1)).read_text().replace("#pragma once", "")

    return re.sub(r'^#include "([\w.]+)"\s*$', splice, text, flags=re.M)


def compile_cubin(name: str, arch: str, extra_options: tuple[str, ...] = (),
                  use_cache: bool = True, cache_dir: str | Path | None = None) -> tuple[bytes, str]:
    """(cubin bytes, compile log) for kernels_ptx/<name> and arch like "sm_90"; cached under `cache_dir`
    (default: default_cache_dir())."""
    source = load_source(name)
    options = BASE_OPTIONS + (f"--gpu-architecture={arch}",) + tuple(extra_options)
    key_text = "\0".join((source, *options, repr(nvrtc_version()), arch))
    key = hashlib.sha256(key_text.encode()).hexdigest()[:32]
    cached = Path(cache_dir or default_cache_dir()) / f"{Path(name).stem}-{arch}-{key}.cubin"
    if use_cache and cached.exists():
        return cached.read_bytes(), ""
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    _check(err, f"nvrtcCreateProgram({name})")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        log = _program_log(prog)
        _check(err, f"NVRTC compile of {name} for {arch}", log)
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        buffer = bytes(size + 1)   # never a 0/1-byte bytes object: CPython shares those, NVRTC writes in place
        (err,) = nvrtc.nvrtcGetCUBIN(prog, buffer)
        _check(err, "nvrtcGetCUBIN")
        cubin = buffer[:size]
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    if use_cache:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(cubin)
        tmp.replace(cached)   # atomic: concurrent processes never read half a file
    return cubin, log


def _program_log(prog) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    _check(err, "nvrtcGetProgramLogSize")
    log = bytes(size + 1)          # see compile_cubin: a fresh buffer NVRTC may write into
    (err,) = nvrtc.nvrtcGetProgramLog(prog, log)
    _check(err, "nvrtcGetProgramLog")
    return log.rstrip(b"\0 ").decode(errors="replace").strip()
