"""The tensor-core Q8_0 GEMM (q8_mma.cu) against the fp32 SIMT q8_matmul.cu, in TFLOP/s.

    PYTHONPATH=. python3 -m bench.mma [--out DIR] [--repeats N]

Shapes are tokens x rows x K of the qwen3-1.7b projections (o / qkv-ish 2048x2048, 6144x2048,
down 2048x6144) at prefill (512) and batched-decode (16, 32, 64) token counts; every tile of
mma_variants.TILES plus the default choice.  Each kernel is captured REPEATS times into one graph
and timed with events around replays (bench/gpu_kernels.py's method; weights are 4-25 MB, so
mostly L2-resident: a compute figure, not an HBM one).
"""
from __future__ import annotations

import argparse

import numpy as np

from kestrel_stream.cli.bench import environment
from kestrel_stream.cuda import driver, mma_variants
from kestrel_stream.cuda.kernels import KernelSet, QWeight, gemv_launch

from .gpu_kernels import time_graph_us
from .report import write_results

SHAPES = [(512, 2048, 2048), (512, 6144, 2048), (512, 2048, 6144), (512, 12288, 2048), (128, 4096, 2048),
          (16, 2048, 2048), (32, 2048, 2048), (64, 2048, 2048), (16, 4096, 2048), (16, 12288, 2048),
          (16, 2048, 6144), (32, 12288, 2048), (64, 12288, 2048), (64, 2048, 6144), (32, 151936, 2048)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = driver.Device(0)
    kernels, stream = KernelSet(device), driver.Stream()
    arena = driver.Arena(2 << 30)
    rng = np.random.default_rng(0)
    rows = []
    for tokens, n, k in SHAPES:
        qs, scales = arena.alloc(n * k), arena.alloc(n * k // 32 * 2)
        driver.h2d_sync(qs, rng.integers(-127, 128, n * k, dtype=np.int8))
        driver.h2d_sync(scales, np.full(n * k // 32, 0.01, np.float16))
        x, y = arena.array((tokens, k), np.float32), arena.array((tokens, n), np.float32)
        driver.h2d_sync(x.ptr, rng.standard_normal((tokens, k)).astype(np.float32))
        w = QWeight(qs, scales, n, k)
        default = mma_variants.choose_tile(tokens, n)
        for variant in ["simt", *mma_variants.TILES]:
            launch = gemv_launch(kernels, w, x.ptr, k, y.ptr, n, tokens, variant=variant)
            us = time_graph_us(stream, lambda i: launch.enqueue(stream), repeats=args.repeats)
            tflops = 2 * tokens * n * k / us / 1e6
            rows.append({"tokens": tokens, "rows": n, "k": k, "kernel": launch.name,
                         "default": variant == default, "us": round(us, 2), "tflop_s": round(tflops, 2)})
            print(f"{tokens:4d} x {n:5d} x {k:5d}  {launch.name:22s}{' *' if variant == default else '  '}"
                  f"  {us:9.2f} us  {tflops:7.2f} TFLOP/s", flush=True)
        for ptr in (qs, scales, x.ptr, y.ptr):
            arena.free(ptr)
    notes = ("q8_mma tiles vs q8_matmul (simt); default = mma_variants.choose_tile's pick. "
             f"{args.repeats} launches per graph, median of 5 replays.")
    path = write_results("h200-mma", environment(), rows, ["tokens", "rows", "k", "kernel", "default", "us", "tflop_s"],
                         notes, args.out)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
