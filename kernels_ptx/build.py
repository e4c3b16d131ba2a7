"""NVRTC build of the kernel families to CUBIN, cached on disk.

CUBIN for the device's own arch, never PTX: the NVRTC wheel (13.5 here) emits a
PTX ISA newer than what an older driver (13.0 on the device) can JIT, while
CUBIN for sm_XY loads on any driver that knows the chip.  The cache key is a
hash of (source, options, NVRTC stamp, arch) so a new wheel or an edited
kernel never loads a stale binary.  This module imports no driver: it runs in
CI with no GPU.  NVRTC itself is imported and loaded only to compile: a load
whose modules are all in the disk cache reads the stamp from the installed
wheels' metadata (nvrtc_stamp) and never locates or loads the library.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import sys
from pathlib import Path

KERNEL_SOURCES = ("q8_gemv.cu", "q8_gemv_hmma.cu", "q4k_gemv_hmma.cu", "q6k_gemv_hmma.cu", "q8_matmul.cu", "q8_mma.cu",
                  "q8_mma_pipe.cu", "q8_mma_f16_ws.cu", "qkv_rope.cu", "attention.cu", "attention_rope.cu", "flash_attention.cu",
                  "elementwise.cu", "sample.cu", "q4_gemv.cu", "q4_mma.cu", "dense_gemm.cu",
                  "q4_gemv_m1.cu", "q4_gemv_mn.cu", "q4_gemv_mg.cu", "q4_gemv_m1d.cu", "q8_gemm_f16.cu", "q8_wgmma.cu",
                  "moe.cu", "moe_mma.cu")
# sources with arch-specific instructions (wgmma): compiled for sm_90a on an sm_90 GPU
ARCH_FEATURE_SOURCES = ("q8_wgmma.cu",)
# no --use_fast_math: expf/sinf/cosf must track the numpy reference to ~1 ulp
BASE_OPTIONS = ("-std=c++17", "--extra-device-vectorization", "-lineinfo")


class KernelBuildError(RuntimeError):
    """An NVRTC failure; the message carries the full compile log."""


def source_dir() -> Path:
    return Path(__file__).resolve().parent


def default_cache_dir() -> Path:
    """Where compiled kernels go when a caller names no directory (the engine passes Options.kernel_cache)."""
    return Path.home() / ".cache" / "kestrel-stream" / "kernels"


def _nvrtc():
    from cuda.bindings import nvrtc    # locates and loads libnvrtc (cuda.pathfinder): only to compile
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    err, major, minor = _nvrtc().nvrtcVersion()
    _check(err, "nvrtcVersion")
    return major, minor


# cuda.bindings finds libnvrtc through cuda.pathfinder, which looks in site-packages (these wheels)
# before any system toolkit, so an installed wheel's version names the library that compiles.
NVRTC_WHEELS = ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12")
BINDINGS_DIST = "cuda-bindings"


@functools.lru_cache(maxsize=1)
def nvrtc_stamp() -> str:
    """The compiler's part of the cache key, read once per process (see read_nvrtc_stamp)."""
    return read_nvrtc_stamp()


def read_nvrtc_stamp() -> str:
    """The versions of the NVRTC wheel that carries the library and of cuda-bindings, from their
    installed dist-info (no library loaded; the wheel's full version, so a patch release recompiles
    too); the loaded library's nvrtcVersion() where no wheel carries it (a system CUDA toolkit) or
    the versions cannot be read."""
    wheels = [f"{name} {version}" for name in NVRTC_WHEELS
              for dist_info, version in _installed(name)[:1] if _carries_nvrtc(dist_info)]
    bindings = _installed(BINDINGS_DIST)[:1]
    if not wheels or not bindings:
        return "nvrtcVersion %d.%d" % nvrtc_version()
    return "; ".join(wheels + [f"{BINDINGS_DIST} {bindings[0][1]}"])


def _installed(project: str) -> list[tuple[Path, str]]:
    """(dist-info directory, version) of `project` on sys.path, first first: the <name>-<version>.dist-info
    directories importlib.metadata reads, found without importing it (its imports cost more than a
    load from the cache)."""
    wanted = re.sub(r"[-_.]+", "_", project).lower()
    found = []
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            stem, dot, suffix = name.rpartition(".")
            project_part, dash, version = stem.partition("-")
            if suffix == "dist-info" and dash and re.sub(r"[-_.]+", "_", project_part).lower() == wanted:
                found.append((Path(entry or ".") / name, version))
    return found


def _carries_nvrtc(dist_info: Path) -> bool:
    """Whether the wheel's RECORD lists libnvrtc and the file is there."""
    try:
        lines = (dist_info / "RECORD").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        path = line.split(",", 1)[0]
        name = path.rsplit("/", 1)[-1]
        if name.startswith(("libnvrtc.so", "nvrtc64_")) and "builtins" not in name:
            return (dist_info.parent / path).exists()
    return False


def cache_path(name: str, arch: str, extra_options: tuple[str, ...] = (), cache_dir: str | Path | None = None) -> Path:
    """Where compile_cubin keeps kernels_ptx/<name> for `arch`: named by a hash of (source, options,
    nvrtc_stamp(), arch)."""
    key_text = "\0".join((load_source(name), *_options(target_arch(name, arch), extra_options), nvrtc_stamp(), arch))
    key = hashlib.sha256(key_text.encode()).hexdigest()[:32]
    return Path(cache_dir or default_cache_dir()) / f"{Path(name).stem}-{arch}-{key}.cubin"


def target_arch(name: str, arch: str) -> str:
    """The architecture kernels_ptx/<name> is compiled for on an `arch` GPU (sm_90a for ARCH_FEATURE_SOURCES)."""
    return arch + "a" if name in ARCH_FEATURE_SOURCES and arch == "sm_90" else arch


def _options(arch: str, extra_options: tuple[str, ...]) -> tuple[str, ...]:
    return BASE_OPTIONS + (f"--gpu-architecture={arch}",) + tuple(extra_options)


def _check(err, what: str, log: str = "") -> None:
    nvrtc = _nvrtc()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, name = nvrtc.nvrtcGetErrorString(err)
        text = name.decode() if isinstance(name, bytes) else str(name)
        raise KernelBuildError(f"{what} failed: {text}" + (f"\n{log}" if log else ""))


def load_source(name: str) -> str:
    """The .cu text with local #include "x.cuh" spliced in, headers' own includes too, each header once
    (NVRTC sees one translation unit)."""
    seen: set[str] = set()

    def expand(text: str) -> str:
        return re.sub(r'^#include "([\w.]+)"\s*$', splice, text, flags=re.M)

    def splice(match: re.Match) -> str:
        if match.group(1) in seen:
            return ""
        seen.add(match.group(1))
        return expand((source_dir() / match.group(1)).read_text().replace("#pragma once", ""))

    return expand((source_dir() / name).read_text())


def compile_cubin(name: str, arch: str, extra_options: tuple[str, ...] = (),
                  use_cache: bool = True, cache_dir: str | Path | None = None) -> tuple[bytes, str]:
    """(cubin bytes, compile log) for kernels_ptx/<name> and arch like "sm_90"; cached under `cache_dir`
    (default: default_cache_dir())."""
    cached = cache_path(name, arch, extra_options, cache_dir)
    if use_cache and cached.exists():
        return cached.read_bytes(), ""
    source, options, nvrtc = load_source(name), _options(target_arch(name, arch), extra_options), _nvrtc()
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
    nvrtc = _nvrtc()
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    _check(err, "nvrtcGetProgramLogSize")
    log = bytes(size + 1)          # see compile_cubin: a fresh buffer NVRTC may write into
    (err,) = nvrtc.nvrtcGetProgramLog(prog, log)
    _check(err, "nvrtcGetProgramLog")
    return log.rstrip(b"\0 ").decode(errors="replace").strip()
