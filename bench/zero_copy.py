"""How fast a kernel reads page-locked host memory in place (zero-copy, as the link share's expert GEMVs
do: run/device/expert_link.py) against the copy engine, alone and while the host's cores read their own
memory (the host kernels' read_sum on --threads threads: the pool both draw on).

    python3 -m bench.zero_copy [--sizes-mb 10,64,1024] [--blocks 1,4,16] [--threads 16] [--out DIR]

Rows: per size, the copy engine's H2D GB/s and a streaming read kernel's (16-byte loads, --blocks x the SMs
blocks of 256 threads) over pinned memory, with the device's own memory for scale; then both beside the
host's readers, with the host's GB/s during and alone.  Medians and bests of 5 after a warm-up.
"""
from __future__ import annotations

import argparse
import ctypes
import threading
import time

import numpy as np

SOURCE = r'''
extern "C" __global__ void read_probe(const int4* __restrict__ p, unsigned long long n, int* out) {
    int4 a = make_int4(0, 0, 0, 0);
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {          // four loads in flight a thread
        const int4 v0 = p[i], v1 = p[i + stride], v2 = p[i + 2 * stride], v3 = p[i + 3 * stride];
        a.x ^= v0.x ^ v1.x ^ v2.x ^ v3.x; a.y ^= v0.y ^ v1.y ^ v2.y ^ v3.y;
        a.z ^= v0.z ^ v1.z ^ v2.z ^ v3.z; a.w ^= v0.w ^ v1.w ^ v2.w ^ v3.w;
    }
    for (; i < n; i += stride) { const int4 v = p[i]; a.x ^= v.x; a.y ^= v.y; a.z ^= v.z; a.w ^= v.w; }
    if ((a.x ^ a.y ^ a.z ^ a.w) == 0x7f3a2b1c) out[0] = 1;   // never true for the bench's bytes: keeps the loads
}
'''


def probe_function(device):
    from cuda.bindings import driver as cu, nvrtc
    from kestrel_stream.cuda.driver import check
    err, program = nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"read_probe.cu", 0, [], [])
    options = [f"--gpu-architecture={device.arch}".encode()]
    (err,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
    assert int(err) == 0, f"read_probe did not compile: {err}"
    err, size = nvrtc.nvrtcGetCUBINSize(program)
    cubin = bytes(size + 1)
    nvrtc.nvrtcGetCUBIN(program, cubin)
    module = check(cu.cuModuleLoadData(cubin[:size]), "cuModuleLoadData(read_probe)")
    return check(cu.cuModuleGetFunction(module, b"read_probe"), "cuModuleGetFunction(read_probe)")


def timed_gbps(stream, enqueue, nbytes: int, repeats: int = 5) -> tuple[float, float]:
    from kestrel_stream.cuda import driver
    start, end = driver.Event(timing=True), driver.Event(timing=True)
    times = []
    for r in range(repeats + 1):
        start.mark(stream)
        enqueue()
        end.mark(stream)
        stream.synchronize()
        if r:
            times.append(end.elapsed_ms(start) * 1e-3)
    return round(nbytes / np.median(times) / 1e9, 1), round(nbytes / min(times) / 1e9, 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mb", default="10,64,1024")
    parser.add_argument("--blocks", default="1,4,16", help="blocks per SM of the read kernel, a comma list")
    parser.add_argument("--threads", type=int, default=None, help="the host's readers (default: physical cores)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from cuda.bindings import driver as cu
    from kestrel_stream import native
    from kestrel_stream.cli.bench import environment
    from kestrel_stream.cuda import driver
    from .report import write_results
    device = driver.Device(0)
    device.make_current()
    function, stream = probe_function(device), driver.Stream("zero-copy")
    sizes = [int(float(s) * (1 << 20)) // 16 * 16 for s in args.sizes_mb.split(",")]
    largest = max(sizes)
    pinned = driver.PinnedBuffer(largest)
    pinned.bytes[:] = 7
    arena = driver.Arena(largest + 4096)
    target, flag = arena.alloc(largest), arena.alloc(64)
    mapped = driver.host_word(pinned.address)

    def read(address: int, nbytes: int, blocks: int):
        values = (ctypes.c_uint64 * 3)(address, nbytes // 16, flag)
        params = (ctypes.c_void_p * 3)(*[ctypes.addressof(values) + 8 * i for i in range(3)])

        def launch(values=values, params=params) -> None:   # both kept alive: params points into values
            check_launch(cu.cuLaunchKernel(function, blocks, 1, 1, 256, 1, 1, 0, stream.handle,
                                           ctypes.addressof(params), 0))
        return launch

    def check_launch(result) -> None:
        driver.check(result, "cuLaunchKernel(read_probe)")

    def copy(nbytes: int):
        return lambda: driver.h2d_async(target, pinned, nbytes, stream)

    rows = []
    for nbytes in sizes:
        mb = round(nbytes / (1 << 20))
        rows.append({"MB": mb, "reader": "copy engine", "GBps": timed_gbps(stream, copy(nbytes), nbytes)})
        for per_sm in [int(b) for b in args.blocks.split(",")]:
            blocks = per_sm * device.sm_count
            rows.append({"MB": mb, "reader": f"kernel, pinned, {blocks} blocks",
                         "GBps": timed_gbps(stream, read(mapped, nbytes, blocks), nbytes)})
        rows.append({"MB": mb, "reader": f"kernel, device memory, {16 * device.sm_count} blocks",
                     "GBps": timed_gbps(stream, read(target, nbytes, 16 * device.sm_count), nbytes)})
    # beside the host's cores reading 4 GB of their own, over and over
    kernels = native.load(threads=args.threads)
    words = np.ones(1 << 29, np.uint64)
    stop, read_bytes = threading.Event(), [0]

    def host_readers() -> None:
        while not stop.is_set():
            kernels.read_sum(words)
            read_bytes[0] += words.nbytes

    def host_rate(during) -> float:
        """The host readers' GB/s while during() runs."""
        read_bytes[0] = 0
        stop.clear()
        reader = threading.Thread(target=host_readers)
        started = time.perf_counter()
        reader.start()
        during()
        stop.set()
        reader.join()
        return round(read_bytes[0] / (time.perf_counter() - started) / 1e9, 1)

    alone = host_rate(lambda: time.sleep(1.0))
    beside: dict = {}

    def both() -> None:
        time.sleep(0.2)
        beside["copy engine"] = timed_gbps(stream, copy(largest), largest)
        beside["kernel, pinned"] = timed_gbps(stream, read(mapped, largest, 16 * device.sm_count), largest)
    during = host_rate(both)
    for reader, rate in beside.items():
        rows.append({"MB": round(largest / (1 << 20)), "reader": f"{reader}, beside the host's readers", "GBps": rate})
    rows.append({"MB": round(words.nbytes / (1 << 20)), "reader": f"host read_sum, {kernels.threads} threads, alone",
                 "GBps": (alone, alone)})
    rows.append({"MB": round(words.nbytes / (1 << 20)), "reader": "host read_sum, beside the device's reads",
                 "GBps": (during, during)})
    for row in rows:
        row["GBps_median"], row["GBps_best"] = row.pop("GBps")
        print(row)
    pinned.free()
    arena.release()
    write_results("zero-copy", environment(), rows, ["MB", "reader", "GBps_median", "GBps_best"],
                  notes="GB/s: median / best of 5 after a warm-up; beside: while the host's readers run.",
                  out_dir=args.out)


if __name__ == "__main__":
    main()
