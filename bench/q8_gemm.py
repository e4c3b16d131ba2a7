"""The built-in dense GEMM's tiles (kernels_ptx/q8_gemm_f16.cu, q8_wgmma.cu on sm_90: cuda/dense_gemm.ALL_GEMM_TILES) on every layer
shape of qwen3-1.7b and qwen3-8b, beside the fp16 q8_mma_f16 tile the launcher would pick, in TFLOP/s.

    PYTHONPATH=. python3 -m bench.q8_gemm [--out DIR] [--tokens 128,256,512] [--repeats N]

Each GEMM alone (A already fp16; no epilogue), captured `repeats` times into a graph, timed with events
around replays (bench/gpu_kernels.py's method).  Prints the winner per shape and the
`MEASURED_GEMM = {...}` line for cuda/dense_gemm.py.
"""
from __future__ import annotations

import argparse

import numpy as np

from kestrel_stream.cli.bench import environment
from kestrel_stream.cuda import driver, mma_variants
from kestrel_stream.cuda.dense_gemm import ALL_GEMM_TILES, GEMM_SIGNATURE, GEMM_TILES, choose_gemm_tile
from kestrel_stream.cuda.kernels import KernelSet, QWeight, gemv_launch

from .gpu_kernels import time_graph_us
from .mma_prefill import LAYER_SHAPES
from .report import write_results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--tokens", default="128,256,512")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = driver.Device(0)
    kernels, stream, arena = KernelSet(device), driver.Stream(), driver.Arena(4 << 30)
    rng = np.random.default_rng(0)
    rows, measured = [], {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        for model, op, n, k in LAYER_SHAPES:
            qs = arena.alloc(n * k)
            scales = arena.alloc(2 * n * (k // 32))
            driver.h2d_sync(qs, rng.integers(-127, 128, n * k, dtype=np.int8))
            driver.h2d_sync(scales, (rng.random(n * (k // 32)) * 0.01).astype(np.float16))
            a = arena.alloc(2 * tokens * k)
            driver.h2d_sync(a, rng.standard_normal(tokens * k).astype(np.float16))
            c = arena.alloc(4 * tokens * n)
            x = arena.alloc(4 * tokens * k)
            driver.h2d_sync(x, rng.standard_normal(tokens * k).astype(np.float32))
            flops = 2.0 * tokens * n * k
            results = {}
            for tile in ALL_GEMM_TILES if device.arch == "sm_90" else GEMM_TILES:
                launch = kernels.launch(tile.name, (-(-tokens // tile.tokens), -(-n // tile.rows)), (tile.threads,),
                                        GEMM_SIGNATURE, [qs, scales, a, k, c, n, tokens, n, k, 0], tile.shared_bytes)
                results[tile.name] = time_graph_us(stream, lambda i: launch.enqueue(stream), repeats=args.repeats)
            f16 = gemv_launch(kernels, QWeight(qs, scales, n, k), x, k, c, n, tokens)   # the q8_mma_f16 default
            f16_us = time_graph_us(stream, lambda i: f16.enqueue(stream), repeats=args.repeats)
            best = min(results, key=results.get)
            measured[(tokens, n, k)] = best
            default = choose_gemm_tile(tokens, n, k, arch=device.arch).name
            for name, us in results.items():
                rows.append({"model": model, "op": op, "tokens": tokens, "N": n, "K": k, "kernel": name,
                             "us": round(us, 2), "tflops": round(flops / us / 1e6, 1),
                             "best": "*" if name == best else "", "rule": "r" if name == default else ""})
            rows.append({"model": model, "op": op, "tokens": tokens, "N": n, "K": k, "kernel": f16.name,
                         "us": round(f16_us, 2), "tflops": round(flops / f16_us / 1e6, 1), "best": "", "rule": ""})
            print(f"{model} {op} {tokens}x{n}x{k}: best {best} {results[best]:.1f} us "
                  f"({flops / results[best] / 1e6:.1f} TFLOP/s); rule {default} {results[default]:.1f}; "
                  f"{f16.name} {f16_us:.1f} us", flush=True)
            for ptr in (qs, scales, a, c, x):
                arena.free(ptr)
    line = "MEASURED_GEMM = {" + ", ".join(f"{key}: {name!r}" for key, name in sorted(measured.items())) + "}"
    print(line)
    env = environment()
    env.update(machine=driver.detect())
    notes = (f"GEMM alone, A fp16 in memory, C fp32 [tokens, N]; best per shape '*', the rule's pick 'r' "
             f"(dense_gemm.choose_gemm_tile without MEASURED_GEMM); last row per shape: "
             f"{mma_variants.__name__}'s fp16 tile that gemv_launch picks (x fp32, its own rounding). {line}")
    path = write_results("h200-q8-gemm", env, rows, ["model", "op", "tokens", "N", "K", "kernel", "us", "tflops",
                                                     "best", "rule"], notes, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
