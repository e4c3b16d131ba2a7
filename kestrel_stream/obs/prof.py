"""The per-stage profile table (``KESTREL_PROF=1`` or ``--prof``), printed at exit.

As in the seed: for every offloaded call (one GPU segment of a step), how many
there were (weight-cache hits vs uploads) and the average µs and share of each
stage -- cache_probe, upload, h2d, gemm, reduce, d2h+sync.  The seed found
lm_head never offloaded only by reading this table; it is the first place to
look before optimizing anything.

Off by default; when off, ``enabled`` is False and executors skip timing
entirely (one attribute check per call).
"""
from __future__ import annotations

import atexit
import sys
import threading
from collections import defaultdict

STAGES = ("cache_probe", "upload", "h2d", "gemm", "reduce", "d2h+sync")

enabled = False      # enable(): --prof, or KESTREL_PROF=1 read into Options when an engine is built
_lock = threading.Lock()
_calls = 0
_hits = 0
_uploads = 0
_stage_us: dict[str, float] = defaultdict(float)
_registered = False


def enable() -> None:
    """Turn profiling on (``--prof``) and print the table at exit."""
    global enabled, _registered
    enabled = True
    if not _registered:
        atexit.register(_print_at_exit)
        _registered = True


def _print_at_exit() -> None:
    sys.stdout.flush()          # keep the table after the command's own output
    print(report(), file=sys.stderr)
    from kestrel_stream.obs import load_stages
    if load_stages.snapshot():
        print(load_stages.report(), file=sys.stderr)


def record_call(stage_us: dict[str, float], uploads: int = 0) -> None:
    """One offloaded call: µs spent per stage; uploads = weights copied because they were not resident."""
    global _calls, _hits, _uploads
    unknown = set(stage_us) - set(STAGES)
    assert not unknown, f"unknown profile stages {unknown}"
    with _lock:
        _calls += 1
        if uploads:
            _uploads += 1
        else:
            _hits += 1
        for stage, us in stage_us.items():
            _stage_us[stage] += us


def snapshot() -> dict:
    with _lock:
        total = sum(_stage_us.values())
        per_call = {s: (_stage_us[s] / _calls if _calls else 0.0) for s in STAGES}
        share = {s: (100.0 * _stage_us[s] / total if total else 0.0) for s in STAGES}
        return {"calls": _calls, "hits": _hits, "uploads": _uploads,
                "total_us_per_call": total / _calls if _calls else 0.0,
                "avg_us": per_call, "share_pct": share}


def reset() -> None:
    global _calls, _hits, _uploads
    with _lock:
        _calls = _hits = _uploads = 0
        _stage_us.clear()


def report() -> str:
    s = snapshot()
    avg, share = s["avg_us"], s["share_pct"]
    return ("[kestrel-prof] calls=%d (hits=%d uploads=%d)  per-call avg us:\n"
            "  total=%.1f  cache_probe=%.1f  upload=%.1f  h2d=%.1f  gemm=%.1f  reduce=%.1f  d2h+sync=%.1f\n"
            "  share: gemm=%.1f%%  d2h+sync=%.1f%%  h2d=%.1f%%  upload=%.1f%%  reduce=%.1f%%  cache=%.1f%%"
            % (s["calls"], s["hits"], s["uploads"], s["total_us_per_call"], avg["cache_probe"], avg["upload"],
               avg["h2d"], avg["gemm"], avg["reduce"], avg["d2h+sync"], share["gemm"], share["d2h+sync"],
               share["h2d"], share["upload"], share["reduce"], share["cache_probe"]))


if enabled:
    enable()
