"""A prompt chunk's attention on the host: the native tiled kernel against numpy's batched matmul on
one BLAS thread (the CPU engine's path for chunks before it).

    python3 -m bench.chunk_attention [--queries 16,64,512] [--keys 512,2048] [--threads 1,2]
                                     [--repeats 15] [--kv f32|f16]

qwen3-1.7b's heads (16 query heads, 8 kv heads, D 128); the chunk is the last `queries` positions of
`keys` (causal).  The two are timed in turn, round after round; each figure is the median in ms.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kestrel_stream import native
from kestrel_stream.run import host
from kestrel_stream.run.blas_threads import set_cpu_threads


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", default="16,64,512")
    ap.add_argument("--keys", default="512,2048")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--kv", choices=("f32", "f16"), default="f32")
    args = ap.parse_args()
    set_cpu_threads(1)
    heads, n_kv, d = 16, 8, 128
    rng = np.random.default_rng(0)
    print("| queries | keys | threads | numpy, 1 BLAS thread (ms) | native tiled (ms) | numpy / tiled |")
    print("|---:|---:|---:|---:|---:|---:|")
    for keys in map(int, args.keys.split(",")):
        k = rng.standard_normal((keys, n_kv, d)).astype(np.float32)
        v = rng.standard_normal((keys, n_kv, d)).astype(np.float32)
        kv = (k, v) if args.kv == "f32" else (k.astype(np.float16), v.astype(np.float16))
        for n in map(int, args.queries.split(",")):
            if n > keys:
                continue
            q = rng.standard_normal((n, heads, d)).astype(np.float32)
            start = keys - n
            kv32 = (kv[0].astype(np.float32), kv[1].astype(np.float32))
            for threads in map(int, args.threads.split(",")):
                kernels = native.load(threads=threads)
                out = np.empty((n, heads * d), np.float32)
                runs = {"numpy": lambda: host.attention(q, kv32[0], kv32[1], start),
                        "tiled": lambda: kernels.attention(q, kv[0], kv[1], start, out=out, tiled=True)}
                times = {name: [] for name in runs}
                for name, call in runs.items():
                    call()
                for _ in range(args.repeats):
                    for name, call in runs.items():
                        t0 = time.perf_counter()
                        call()
                        times[name].append(time.perf_counter() - t0)
                m = {name: median_ms(t) for name, t in times.items()}
                print(f"| {n} | {keys} | {threads} | {m['numpy']:.2f} | {m['tiled']:.2f} | "
                      f"{m['numpy'] / m['tiled']:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
