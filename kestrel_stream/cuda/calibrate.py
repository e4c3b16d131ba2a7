"""Measure the GPU figures of a DeviceProfile: round trip, copy bandwidths, q8 mat-vec bandwidth, launch cost.

Every figure is measured the way the executor pays it: pinned staging buffers,
the project's own q8 GEMV kernel, pre-packed launches, one stream.
"""
from __future__ import annotations

import time

import numpy as np

from kestrel_stream.model.quant import quantize
from kestrel_stream.cuda import driver
from kestrel_stream.cuda.kernels import KernelSet, QWeight, gemv_launch


def _median_us(samples: list[float]) -> float:
    return float(np.median(samples)) * 1e6


def measure_gpu(repeats: int = 200, options=None) -> dict:
    """Figures in the DeviceProfile's units (µs, GB/s), plus the device's name and driver.

    options: the engine's Options (where the kernels are cached)."""
    device = driver.Device(0)
    kernels = KernelSet(device, options)
    stream = driver.Stream()
    rows, cols = 6144, 2048                                  # a gate/up-sized weight: 12.6 MB of Q8_0
    weight = quantize(np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32))
    copy_bytes = 256 << 20
    arena = driver.Arena(weight.nbytes + copy_bytes + 4 * (rows + cols) + (1 << 20))
    qs, scales = arena.alloc(weight.qs.nbytes), arena.alloc(weight.scales.nbytes)
    driver.h2d_sync(qs, weight.qs)
    driver.h2d_sync(scales, weight.scales)
    x, y, big = arena.alloc(4 * cols), arena.alloc(4 * rows), arena.alloc(copy_bytes)
    pinned = driver.PinnedBuffer(copy_bytes)
    pinned.bytes[:] = 1
    small = 16 << 10

    # round trip: what one offloaded op costs beyond its compute (16 KB in, a small kernel, 16 KB out, sync)
    tiny = gemv_launch(kernels, QWeight(qs, scales, 128, cols), x, cols, y, rows, 1)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        driver.h2d_async(x, pinned, small // 2, stream)
        tiny.enqueue(stream)
        driver.d2h_async(pinned, y, small // 2, stream)
        stream.synchronize()
        samples.append(time.perf_counter() - start)
    round_trip_us = _median_us(samples[repeats // 10:])

    def bandwidth(copy) -> float:
        copy()
        stream.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            copy()
        stream.synchronize()
        return 5 * copy_bytes / (time.perf_counter() - start) / 1e9

    h2d = bandwidth(lambda: driver.h2d_async(big, pinned, copy_bytes, stream))
    d2h = bandwidth(lambda: driver.d2h_async(pinned, big, copy_bytes, stream))

    # q8 mat-vec bandwidth, M = 1, timed on the device with events
    gemv = gemv_launch(kernels, QWeight(qs, scales, rows, cols), x, cols, y, rows, 1)
    begin, end = driver.Event(timing=True), driver.Event(timing=True)
    for _ in range(10):
        gemv.enqueue(stream)
    begin.record(stream)
    for _ in range(repeats):
        gemv.enqueue(stream)
    end.record(stream)
    end.synchronize()
    gemv_us = end.elapsed_ms(begin) * 1e3 / repeats
    gpu_weight_GBps = weight.nbytes / (gemv_us * 1e-6) / 1e9

    # host cost of one more launch inside a segment (the GPU is kept busy by the previous ones)
    start = time.perf_counter()
    for _ in range(repeats):
        tiny.enqueue(stream)
    launch_us = (time.perf_counter() - start) / repeats * 1e6
    stream.synchronize()
    pinned.free()
    arena.release()
    from cuda.bindings import driver as cu
    version = driver.check(cu.cuDriverGetVersion(), "cuDriverGetVersion")
    return {
        "name": device.name, "driver": str(version), "round_trip_us": round(round_trip_us, 2),
        "h2d_GBps": round(h2d, 2), "d2h_GBps": round(d2h, 2), "gpu_weight_GBps": round(gpu_weight_GBps, 1),
        "gpu_launch_us": round(max(launch_us, gemv_us), 2),
    }
