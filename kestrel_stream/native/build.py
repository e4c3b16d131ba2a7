"""The host kernels' build: the system C compiler makes a shared library for the running machine,
cached on disk.

As kernels_ptx/build.py does for NVRTC, the cache key is a hash of (the C sources, the flags, the
compiler's version line, the CPU's model and feature flags), so an edited kernel, another compiler
or another CPU never loads a stale library.  The library is built with -march=native; every ISA
path (scalar, AVX2, AVX-512 VNNI) is compiled in it with per-function target attributes, and the
one to run is picked at call time from what the CPU has (or forced lower, for tests).
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = "host_kernels.c"
SOURCES = (SOURCE, "host_amx.c", "host_kquants.c", "host_moe.c", "host_program.c", "host_serve.c")       # compiled into one library
HEADERS = ("host_amx.h", "host_kernels.h", "host_kquants.h", "host_simd.h")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fPIC", "-shared", "-fopenmp-simd", "-pthread", "-std=gnu11")
DEFAULT_CC = "cc"


class NativeBuildError(RuntimeError):
    """No compiler, or the compile failed; the message is one line, the log follows it."""


def source_path() -> Path:
    return Path(__file__).resolve().parent / SOURCE


@functools.lru_cache(maxsize=8)
def compiler_version(cc: str) -> str:
    """The first line of `cc --version`; NativeBuildError when there is no such compiler."""
    exe = shutil.which(cc)
    if exe is None:
        raise NativeBuildError(f"no C compiler {cc!r} on PATH")
    try:
        done = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeBuildError(f"C compiler {cc!r} did not run: {e}") from None
    if done.returncode != 0:
        raise NativeBuildError(f"C compiler {cc!r} --version failed (status {done.returncode})")
    return (done.stdout.splitlines() or [""])[0].strip()


@functools.lru_cache(maxsize=1)
def cpu_signature() -> str:
    """The CPU model and feature flags (Linux /proc/cpuinfo; elsewhere platform's names)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return f"{fields.get('model name', platform.machine())}; {fields.get('flags', fields.get('Features', ''))}"


def source_texts() -> tuple[str, ...]:
    folder = source_path().parent
    return tuple((folder / name).read_text() for name in SOURCES + HEADERS)


def library_path(cache_dir: Path, cc: str, extra_flags: tuple[str, ...] = ()) -> Path:
    key_text = "\0".join((*source_texts(), *FLAGS, *extra_flags, compiler_version(cc), cpu_signature()))
    key = hashlib.sha256(key_text.encode()).hexdigest()[:32]
    return Path(cache_dir) / f"host_kernels-{platform.machine()}-{key}.so"


def build_library(cache_dir: Path, cc: str = DEFAULT_CC, extra_flags: tuple[str, ...] = ()) -> Path:
    """The cached shared library's path, compiling it first when it is not there (`extra_flags`, e.g.
    -DKS_NO_X86 for the scalar-only build the tests make, join the flags and the key)."""
    target = library_path(cache_dir, cc, extra_flags)
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            sources = [str(source_path().parent / name) for name in SOURCES]
            cmd = [shutil.which(cc) or cc, *FLAGS, *extra_flags, *sources, "-o", str(out), "-lm"]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise NativeBuildError(f"compiling {SOURCE} with {cc!r} failed: {e}") from None
            if done.returncode != 0:
                log = (done.stderr or done.stdout).strip()
                raise NativeBuildError(f"compiling {SOURCE} with {cc!r} failed (status {done.returncode})\n{log}")
            os.replace(out, target)     # atomic: a concurrent process never loads half a file
    except OSError as e:
        raise NativeBuildError(f"cannot write the host kernels' cache {target.parent}: {e.strerror or e}") from None
    return target
