"""Device profile: the handful of measured numbers the cost model needs.

The scheduler never measures anything itself (it imports no CUDA); the
calibration code elsewhere produces a DeviceProfile and this module caches it
as JSON, keyed by device name and driver version, so the measurement runs once
per machine. Units: microseconds, GB/s (1e9 bytes per second), GFLOP/s.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path



@dataclass(frozen=True)
class DeviceProfile:
    name: str                # device name as the driver reports it
    driver: str              # driver version string; a new driver re-measures
    round_trip_us: float     # small pinned H2D + one kernel + small D2H + stream sync
    h2d_GBps: float          # pinned host→device bandwidth
    d2h_GBps: float          # pinned device→host bandwidth
    gpu_weight_GBps: float   # weight bytes/s a q8 mat-vec achieves (M=1 is bandwidth-bound)
    gpu_launch_us: float     # each extra launch inside a segment
    host_gflops: float       # float32 matmul on the host (bounds M>1 projections)
    host_weight_GBps: float  # weight bytes/s of the host q8 mat-vec (bounds M=1 projections)
    gpu_gflops: float = 30000.0  # q8 matmul compute bound, reached only at large M
    # host memory is one pool: the host kernels and pinned H2D each read it slower while the other runs
    # (None: not measured; the offload placement then assumes they do not slow each other)
    host_joint_GBps: float | None = None   # host_weight_GBps while an H2D stream runs
    h2d_joint_GBps: float | None = None    # h2d_GBps while the host kernels run
    host_call_us: float | None = None      # one host kernel call from Python (dispatch, pool wake-up)
    # block format -> weight bytes/s of its host mat-vec alone, where a format's kernel is slower than the pool
    # (Q4_K, Q6_K decode more per byte than Q8_0); None or a missing format: host_weight_GBps
    host_format_GBps: dict | None = None
    # block format -> [[tokens, weight bytes/s of its host kernel at a step of that many tokens]], tokens ascending
    # from 1 (calibrate: each alone, weights cold): within a few tokens the kernels turn compute-bound, each format
    # at its own pace (Q8_0's 16 token lanes cost the same from 6 to 16 tokens); None or a missing format:
    # host_gflops bounds the steps of many tokens
    host_format_tokens_GBps: dict | None = None
    # FLOP/s of the device expert kernels (route, gate_up, down, combine) over a prompt chunk of a routed layer
    # whose every expert is on the device (mode offload's streamed experts); None: not measured, gpu_gflops
    gpu_expert_gflops: float | None = None
    # the host kernels these host rates are of, "library file name:ISA" (the name hashes the sources, flags,
    # compiler and CPU); calibrate measures again under others (new kernels, such as AMX tiles, change the rates)
    host_kernels: str | None = None

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("float", float) or (f.type == "float | None" and value is not None):
                if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                    raise ValueError(f"DeviceProfile.{f.name} must be a positive number, "
                                     f"got {value!r}")
        for fmt, rate in (self.host_format_GBps or {}).items():
            if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
                raise ValueError(f"DeviceProfile.host_format_GBps[{fmt!r}] must be a positive number, got {rate!r}")
        for fmt, curve in (self.host_format_tokens_GBps or {}).items():
            pairs = isinstance(curve, (list, tuple)) and all(
                isinstance(point, (list, tuple)) and len(point) == 2 for point in curve)
            tokens = [point[0] for point in curve] if pairs else None
            if not (tokens and tokens[0] == 1 and tokens == sorted(set(tokens))
                    and all(isinstance(t, int) for t in tokens)
                    and all(isinstance(r, (int, float)) and math.isfinite(r) and r > 0 for _, r in curve)):
                raise ValueError(f"DeviceProfile.host_format_tokens_GBps[{fmt!r}] must be [[tokens, GB/s], ...] "
                                 f"from 1 token, tokens ascending, rates positive; got {curve!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "profile") -> "DeviceProfile":
        known = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"{where}: missing {', '.join(missing)}")
        kwargs = {k: v for k, v in data.items() if k in known}
        for key in ("name", "driver"):
            kwargs[key] = str(kwargs[key])
        return cls(**kwargs)


# Figures from CUDA_NOTES.md (H200, measured 2026-11-30). The host figures were
# not measured there: they are placeholders of the right order for a numpy
# q8 executor on 16 cores, until `calibrate` replaces them.
H200_MEASURED = DeviceProfile(
    name="NVIDIA H200", driver="13.0",
    round_trip_us=19.5,       # 16 KB pinned H2D + kernel + 16 KB D2H + sync, p50
    h2d_GBps=55.4, d2h_GBps=55.3,
    gpu_weight_GBps=1500.0,   # naive q8 GEMV: 1.48 TB/s at 12288x2048, 1.91 at 151936x2048
    gpu_launch_us=5.0,        # cuLaunchKernel from Python, empty kernel
    host_gflops=500.0, host_weight_GBps=20.0,
    gpu_gflops=30000.0,
)

# An H200 machine's host memory pool (issue figures, 2026-12-03, machine B: 16 threads of AVX-512 VNNI
# int8 GEMV over Q8_0, pinned H2D on its own thread, each alone and both at once), with the GPU figures
# above: the offload placement's tests and `plan` without a measured profile.
H200_POOL = DeviceProfile(
    name="NVIDIA H200 (pool figures)", driver="13.0",
    round_trip_us=19.5, h2d_GBps=54.5, d2h_GBps=55.3, gpu_weight_GBps=1500.0, gpu_launch_us=5.0,
    host_gflops=1500.0, host_weight_GBps=72.0, gpu_gflops=30000.0,
    host_joint_GBps=58.0, h2d_joint_GBps=51.5, host_call_us=8.0,
)

# The seed's machine (RTX 5090 era): ~100 us per offloaded call. Host rates come
# from the seed's CPU decode buckets on the 2B q8 model: gate/up 748 MB in
# 16.96 ms (44 GB/s), lm_head 330 MB in 6.87 ms (48 GB/s); its best rate is used.
SEED_LIKE = DeviceProfile(
    name="seed-like RTX 5090", driver="seed",
    round_trip_us=100.0,
    h2d_GBps=25.0, d2h_GBps=25.0,
    gpu_weight_GBps=1500.0,
    gpu_launch_us=5.0,
    host_gflops=200.0, host_weight_GBps=48.0,
    gpu_gflops=50000.0,
)


def default_cache_dir(base: str | Path | None = None) -> Path:
    """The profiles directory under `base` (Options.cache_dir, KESTREL_CACHE_DIR; default ~/.cache/kestrel-stream)."""
    return (Path(base) if base else Path.home() / ".cache" / "kestrel-stream") / "profiles"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "unknown"


def profile_cache_path(name: str, driver: str, cache_dir: str | Path | None = None) -> Path:
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return directory / f"{_slug(name)}--driver-{_slug(driver)}.json"


def save_profile(profile: DeviceProfile, cache_dir: str | Path | None = None) -> Path:
    path = profile_cache_path(profile.name, profile.driver, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return path


def load_profile(name: str, driver: str,
                 cache_dir: str | Path | None = None) -> DeviceProfile | None:
    """The cached profile of this device + driver, or None if it was never measured."""
    path = profile_cache_path(name, driver, cache_dir)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); delete it to re-measure") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object; delete it to re-measure")
    return DeviceProfile.from_dict(data, where=str(path))
