"""``kestrel-stream calibrate``: measure this machine's DeviceProfile once and cache it.

Host figures come from numpy doing what the host backend does (float32 BLAS on
dequantized weights); GPU figures from kestrel_stream.cuda.calibrate.  The
profile is cached per device + driver (scheduler.profile), so later runs and
the lazy first use of a GPU read it instead of measuring again.
"""
from __future__ import annotations

import time

import numpy as np

from scheduler.profile import DeviceProfile, default_cache_dir, load_profile, save_profile

from kestrel_stream.model.quant import GROUP


def measure_host(repeats: int = 5) -> dict:
    """host_gflops (M=32 float32 matmul) and host_weight_GBps (M=1, in Q8_0 bytes of the weight per second)."""
    rng = np.random.default_rng(0)
    rows, cols = 4096, 2048
    weight = rng.standard_normal((rows, cols), dtype=np.float32)
    q8_bytes = rows * cols * (GROUP + 2) / GROUP

    def best_seconds(x) -> float:
        x @ weight.T
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            x @ weight.T
            times.append(time.perf_counter() - start)
        return min(times)

    batch = rng.standard_normal((32, cols), dtype=np.float32)
    gflops = 2 * 32 * rows * cols / best_seconds(batch) / 1e9
    weight_GBps = q8_bytes / best_seconds(batch[:1]) / 1e9
    return {"host_gflops": round(gflops, 2), "host_weight_GBps": round(weight_GBps, 2)}


def calibrate(force: bool = False, cache_dir=None, options=None) -> DeviceProfile:
    """The cached profile of GPU 0 (measured now when missing or when ``force``), kept in `cache_dir`
    (default: the profiles directory under the options' cache_dir, KESTREL_CACHE_DIR)."""
    if options is None:
        from kestrel_stream.options import Options
        options = Options.from_env()
    if cache_dir is None:
        cache_dir = default_cache_dir(options.cache_root)
    from kestrel_stream.cuda import driver
    from kestrel_stream.cuda.calibrate import measure_gpu
    from cuda.bindings import driver as cu

    device = driver.Device(0)
    version = str(driver.check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
    if not force:
        cached = load_profile(device.name, version, cache_dir)
        if cached is not None:
            return cached
    profile = DeviceProfile(**measure_gpu(options=options), **measure_host())
    save_profile(profile, cache_dir)
    return profile
