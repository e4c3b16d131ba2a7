"""Run-time options: every KESTREL_* setting of the engine, parsed once where the engine is built.

``Options.from_env()`` reads the environment (and takes what flags or ks.load
arguments gave) into one frozen object; the engine passes it down to the
executor, the kernel set and the planner, and nothing below reads the
environment.  A bad value raises here, naming the variable.

    KESTREL_PROF=1            the per-stage profile table at exit (as --prof)
    KESTREL_TRACE=FILE        a Chrome trace of the whole process, written at exit (as --trace)
    KESTREL_VERIFY=1          recompute every GPU step on the host and count mismatches
    KESTREL_PDL=0             no programmatic dependent launch between a step's kernels
    KESTREL_MINFLOP=F         the seed's per-projection FLOP threshold instead of the cost model (gated)
    KESTREL_GEMV_M1=SUFFIX    force one single-token GEMV layout (KESTREL_GEMV_M1_ROWS=4|2: "r4" | "")
    KESTREL_GEMV_MN=SUFFIX    force one 2..8-token GEMV layout
    KESTREL_KERNEL_CACHE=DIR  where compiled kernels are cached
    KESTREL_CACHE_DIR=DIR     where device profiles (and preset models) are cached

The daemon's and clients' own variables (KESTREL_SOCKET, KESTREL_TOKEN) are
read by the CLI and the client where they enter, not here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from kestrel_stream.cuda.gemv_variants import MULTI_VARIANTS, VARIANTS
from kestrel_stream.run.budget import parse_vram_budget
from scheduler.gate import minflop_from_env


@dataclass(frozen=True)
class Options:
    vram_budget: int | float | None = None   # bytes, or a fraction of free VRAM (parse_vram_budget)
    prof: bool = False
    trace_path: str | None = None
    verify: bool = False
    programmatic_launch: bool = True
    minflop: float | None = None
    gemv_m1: str | None = None               # None: the layout measured fastest for the shape
    gemv_mn: str | None = None
    kernel_cache_dir: Path | None = None     # None: kernels_ptx.build's default
    cache_dir: Path | None = None            # None: ~/.cache/kestrel-stream

    @classmethod
    def from_env(cls, environ=None, **given) -> "Options":
        """The environment's settings, overridden by `given` (flags, ks.load arguments)."""
        env = os.environ if environ is None else environ
        m1 = env.get("KESTREL_GEMV_M1")
        if m1 is None and env.get("KESTREL_GEMV_M1_ROWS"):
            m1 = {"4": "r4", "2": ""}.get(env["KESTREL_GEMV_M1_ROWS"])
        if m1 is not None and m1 not in VARIANTS:
            raise ValueError(f"KESTREL_GEMV_M1={m1!r}: not a GEMV variant; one of "
                             f"{', '.join(repr(v) for v in VARIANTS)}")
        mn = env.get("KESTREL_GEMV_MN")
        if mn is not None and mn not in MULTI_VARIANTS:
            raise ValueError(f"KESTREL_GEMV_MN={mn!r}: not a multi-token GEMV variant; one of "
                             f"{', '.join(repr(v) for v in MULTI_VARIANTS)}")
        options = cls(prof=env.get("KESTREL_PROF") == "1", trace_path=env.get("KESTREL_TRACE") or None,
                      verify=env.get("KESTREL_VERIFY") == "1", programmatic_launch=env.get("KESTREL_PDL", "1") != "0",
                      minflop=minflop_from_env(env), gemv_m1=m1, gemv_mn=mn,
                      kernel_cache_dir=_path(env.get("KESTREL_KERNEL_CACHE")),
                      cache_dir=_path(env.get("KESTREL_CACHE_DIR")))
        return options.with_(**given)

    def with_(self, **changes) -> "Options":
        """A copy with `changes`; a VRAM budget is parsed here (bytes or a fraction), once."""
        if "vram_budget" in changes:
            changes["vram_budget"] = parse_vram_budget(changes["vram_budget"])
        return replace(self, **changes)


def _path(text: str | None) -> Path | None:
    return Path(text) if text else None
