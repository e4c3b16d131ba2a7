"""Native host kernels: C sources, their build for the running machine, ctypes bindings; no model knowledge.

    from kestrel_stream import native
    kernels = native.load(options)      # HostKernels, or NativeUnavailable (its message is one line)
    wq = kernels.prepare_q8_0(w.qs, w.scales)           # once per weight (no copy)
    wb = kernels.prepare_blocks(w.fmt, w.blocks, w.cols)
    y = kernels.matmul(x, wq)                           # x float32 [T, K] → [T, N]
    proj = kernels.linear(wq, norm, eps, glu=False)     # bound once: rmsnorm prologue, SiLU·mul epilogue
    y = proj(x)
    kernels.qkv_rope(qkv, heads, kv_heads, bias, qk_norm, eps, cos, sin, q, k_rows, v_rows)
    kernels.rmsnorm(x, w, eps), kernels.silu_mul(gate, up), kernels.rope(qk, cos, sin),
    kernels.attention(q, k, v, start, window)           # run/host.py's conventions

kernels.program_call runs a whole step's bound op list (host_program.c; run/host/native_program.py binds
it); native/routed.py binds a routed layer's router and experts (host_moe.c).  The numpy twins of the same arithmetic are in native/twins.py.  Importing the package compiles
nothing; `load` builds the library on first use (cached under Options.host_kernel_cache) and
`availability` says whether it can, and why not.
"""
from __future__ import annotations

from pathlib import Path

from kestrel_stream.native.build import DEFAULT_CC, NativeBuildError, build_library
from kestrel_stream.native.kernels import FORMATS, ISAS, HostKernels, PreparedWeight, physical_cores

__all__ = ["FORMATS", "ISAS", "HostKernels", "NativeUnavailable", "PreparedWeight", "availability", "load",
           "physical_cores"]


class NativeUnavailable(RuntimeError):
    """The host kernels cannot be built or loaded here; str() is one line for the user."""

    def __init__(self, reason: str, log: str = ""):
        super().__init__(f"kestrel-stream: native host kernels unavailable ({reason}); using numpy")
        self.reason, self.log = reason, log


def load(options=None, *, isa: str | None = None, threads: int | None = None, cc: str | None = None,
         cache_dir: Path | None = None, spin_us: int | None = None) -> HostKernels:
    """The host kernels for this machine, built on first use.  Settings come from `options`
    (kestrel_stream.options.Options: host_isa, host_cc, host_spin_us, host_kernel_cache) unless given
    here; threads default to the physical cores, spin_us to the library's 100.  Raises NativeUnavailable when there is
    no compiler or the build fails."""
    if options is None:
        from kestrel_stream.options import Options
        options = Options()
    cc = cc or options.host_cc or DEFAULT_CC
    isa = isa or options.host_isa
    spin_us = options.host_spin_us if spin_us is None else spin_us
    try:
        path = build_library(Path(cache_dir or options.host_kernel_cache), cc)
    except NativeBuildError as e:
        first, _, log = str(e).partition("\n")
        raise NativeUnavailable(first, log) from None
    try:
        return HostKernels(path, isa=isa, threads=threads, spin_us=spin_us)
    except OSError as e:
        raise NativeUnavailable(f"{path.name} did not load: {e}") from None


def availability(options=None, **settings) -> tuple[bool, str | None]:
    """(True, None) when `load` works with these settings, else (False, the one-line reason)."""
    try:
        load(options, **settings)
    except NativeUnavailable as e:
        return False, str(e)
    return True, None
