"""Per-kernel GPU timings at the qwen3-1.7b shapes: time and GB/s of the q8 mat-vec, plus the others.

    PYTHONPATH=. python3 -m bench.gpu_kernels [--out DIR] [--commit HASH] [--multi-only]

Each kernel is captured `REPEATS` times into one CUDA graph and timed with
events around replays, so Python launch overhead is out of the figure.  Weight
copies rotate so the bytes read per replay exceed the 50 MB L2: the numbers are
HBM numbers, as they are inside a real step where every layer's weight is cold.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from kestrel_stream.cli.bench import environment
from kestrel_stream.cuda import driver
from kestrel_stream.cuda import gemv_variants
from kestrel_stream.cuda.kernels import KernelSet, QWeight, attention_launch, gemv_launch

from .report import write_results

GEMV_SHAPES = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144),
               "6144x2048": (6144, 2048), "lm_head": (151936, 2048)}
REPEATS = 40
COLD_BYTES = 400 << 20


def time_graph_us(stream, enqueue, repeats: int = REPEATS, replays: int = 5) -> float:
    """Median µs per enqueue() call, from `replays` replays of a graph holding `repeats` calls."""
    with driver.capture(stream) as captured:
        for i in range(repeats):
            enqueue(i)
    start, stop = driver.Event(timing=True), driver.Event(timing=True)
    captured.graph.launch(stream)   # warm-up
    times = []
    for _ in range(replays):
        start.record(stream)
        captured.graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
        times.append(stop.elapsed_ms(start) * 1000 / repeats)
    captured.graph.destroy()
    return float(np.median(times))


def measure_copy_bandwidth(arena, stream, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy, GB/s counting read + write."""
    from cuda.bindings import driver as cu
    src, dst = arena.alloc(nbytes), arena.alloc(nbytes)
    us = time_graph_us(stream, lambda i: driver.check(cu.cuMemcpyDtoDAsync(dst, src, nbytes, stream.handle)),
                       repeats=4, replays=3)
    arena.free(src)
    arena.free(dst)
    return 2 * nbytes / us / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default=os.environ.get("KESTREL_COMMIT"))
    parser.add_argument("--multi-only", action="store_true",
                        help="the steps of 2..16 tokens (and each shape's default one-token layout, programmatic)")
    args = parser.parse_args()
    device = driver.Device(0)
    kernels, stream = KernelSet(device), driver.Stream()
    arena = driver.Arena(6 << 30)
    rng = np.random.default_rng(0)
    copy_gb_s = measure_copy_bandwidth(arena, stream)
    hbm_read_gb_s = 4460.0   # read-only 16-byte loads over 2 GiB, CUDA_NOTES.md
    rows = []
    for label, (n, k) in GEMV_SHAPES.items():
        weight_bytes = n * k + n * k // 32 * 2
        copies = max(1, min(REPEATS, -(-COLD_BYTES // weight_bytes)))
        qs = arena.alloc(n * k * copies)
        scales = arena.alloc(n * k // 32 * 2 * copies)
        driver.h2d_sync(qs, rng.integers(-127, 128, n * k * copies, dtype=np.int8))
        driver.h2d_sync(scales, np.full(n * k // 32 * copies, 0.01, np.float16))
        x, y = arena.array((64, max(k, n)), np.float32), arena.array((64, n), np.float32)
        xn, rms, counter = arena.array((64, n), np.float32), arena.array((64,), np.float32), arena.alloc(64)
        driver.h2d_sync(x.ptr, rng.standard_normal((64, max(k, n))).astype(np.float32))
        driver.h2d_sync(counter, np.zeros(16, np.uint32))
        cases = [(1, variant, epilogue, programmatic) for variant in gemv_variants.VARIANTS
                 for epilogue in ("plain", "silu", "residual+xn+rms") for programmatic in (False, True)
                 if not args.multi_only or (variant == gemv_variants.m1_variant(n, k) and programmatic)]
        cases += [(m, variant, "plain", programmatic) for m in (2, 4, 8) for variant in gemv_variants.MULTI_VARIANTS
                  for programmatic in (False, True) if not args.multi_only or programmatic]
        # the fp16 tensor-core GEMV of 2..16 tokens (q8_gemv_hmma.cu), every layout; the int8 mma at 16
        cases += [(m, variant, "plain", True) for m in (2, 4, 8, 16) for variant in gemv_variants.HMMA_VARIANTS]
        cases += [(16, "16x64", "plain", False)] if args.multi_only else [(64, None, "plain", False)]
        for m, variant, epilogue, programmatic in cases:
            extra = {"plain": {}, "silu": dict(silu_pairs=True, inv_rms_in=x.ptr),
                     "residual+xn+rms": dict(res=y.ptr, normw_out=x.ptr, xn_out=xn.ptr, inv_rms_out=rms.ptr,
                                             counter=counter)}[epilogue]
            launches = [gemv_launch(kernels, QWeight(qs + i * n * k, scales + i * n * k // 16, n, k),
                                    x.ptr, k, y.ptr, n, m, variant=variant, **extra)
                        for i in range(copies)]
            for launch in launches:
                launch.programmatic = programmatic
            us = time_graph_us(stream, lambda i: launches[i % copies].enqueue(stream))
            gb_s = weight_bytes / us / 1e3
            name = f"{launches[0].name} {epilogue}"
            rows.append({"kernel": name, "shape": f"{label} {n}x{k}", "M": m, "pdl": programmatic,
                         "us": round(us, 2), "weight_GB_s": round(gb_s, 1),
                         "TFLOP_s": round(2 * n * k * m / us / 1e6, 2),
                         "frac_hbm_read": round(gb_s / hbm_read_gb_s, 3),
                         "frac_d2d_copy": round(gb_s / copy_gb_s, 3)})
            print(rows[-1], flush=True)
        for ptr in (qs, scales, x.ptr, y.ptr, xn.ptr, rms.ptr, counter):
            arena.free(ptr)
    best = best_variants(rows)
    print("\n".join(best), flush=True)
    rows += [] if args.multi_only else other_kernels(kernels, arena, stream, rng)
    env = environment()
    env["machine"] = driver.detect()
    env["commit"] = args.commit or env["commit"]
    env["d2d_copy_GB_s"] = round(copy_gb_s, 1)
    notes = (f"Device-to-device copy measured here: {copy_gb_s:.0f} GB/s (read + write). "
             f"frac_hbm_read is against 4460 GB/s, the read-only HBM figure in CUDA_NOTES.md. "
             f"Epilogues: plain; silu (RMSNorm scale + SiLU·mul of gate/up row pairs); residual+xn+rms (residual add, "
             f"next norm's input, per-token sums of squares, last-block 1/rms). Kernel suffixes: the "
             f"single-token layouts of kestrel_stream/cuda/gemv_variants.py (wTrRuU: T threads, R rows per block, "
             f"U chunks per thread in flight; none: 128x2x2; r4: 128x4x2). pdl: launched with programmatic "
             f"stream serialization, so consecutive launches of the graph overlap as in a real step. GB/s counts "
             f"weight bytes (int8 + fp16 scales) only. Fastest single-token layout per shape, epilogue and pdl: " + "; ".join(best))
    path = write_results("h200-gpu-kernels", env, rows, ["kernel", "shape", "M", "pdl", "us", "weight_GB_s",
                                                         "frac_hbm_read", "frac_d2d_copy", "TFLOP_s"],
                         notes=notes, out_dir=args.out)
    print(f"wrote {path}")


def best_variants(rows: list[dict]) -> list[str]:
    """'shape epilogue pdl: fastest kernel us (frac)' for every single-token case."""
    best: dict[tuple, dict] = {}
    for row in rows:
        if row["M"] != 1:
            continue
        key = (row["shape"], row["kernel"].split()[-1], row["pdl"])
        if key not in best or row["us"] < best[key]["us"]:
            best[key] = row
    return [f"{shape} {epilogue} pdl={pdl}: {row['kernel'].split()[0]} {row['us']} us ({row['frac_hbm_read']})"
            for (shape, epilogue, pdl), row in best.items()]


def other_kernels(kernels, arena, stream, rng) -> list[dict]:
    """The step's other kernels at the qwen3-1.7b shape (16 q heads, 8 kv heads, D 128, 28 layers)."""
    heads, kv_heads, d, layers, hidden, vocab = 16, 8, 128, 28, 2048, 151936
    rows = []
    splits = 16
    partials = arena.alloc(heads * splits * (d + 2) * 4)
    counters = arena.alloc(4 * kv_heads)
    driver.h2d_sync(counters, np.zeros(kv_heads, np.uint32))
    for context in (128, 1024, 4096):
        pool = arena.alloc(context * layers * 2 * kv_heads * d * 4)
        q, out = arena.alloc(heads * d * 4), arena.alloc(heads * d * 4)
        base, pos = arena.alloc(8), arena.alloc(4)
        driver.h2d_sync(base, np.zeros(1, np.int64))
        driver.h2d_sync(pos, np.array([context - 1], np.int32))
        launch = attention_launch(kernels, q, pool, base, pos, out, partials, counters, 1, 0, layers, heads,
                                  kv_heads, d, splits)
        us = time_graph_us(stream, lambda i: launch.enqueue(stream))
        kv_bytes = context * 2 * kv_heads * d * 4
        rows.append({"kernel": "attention_split_d128", "shape": f"context {context}, 16 splits",
                     "M": 1, "us": round(us, 2), "weight_GB_s": round(kv_bytes / us / 1e3, 1)})
        print(rows[-1], flush=True)
        arena.free(pool)
    qkv, qout = arena.alloc((heads + 2 * kv_heads) * d * 4), arena.alloc(heads * d * 4)
    pool = arena.alloc(64 * layers * 2 * kv_heads * d * 4)
    launch = kernels.launch("qkv_norm_rope_append", (heads + 2 * kv_heads, 1), (32,), "ppppppppfiiiii",
                            [qkv, qout, pool, base, pos, qkv, qkv, qkv, 1e-6, 0, layers, heads, kv_heads, d])
    driver.h2d_sync(pos, np.array([5], np.int32))
    rows.append({"kernel": "qkv_norm_rope_append", "shape": "1 token", "M": 1,
                 "us": round(time_graph_us(stream, lambda i: launch.enqueue(stream)), 2)})
    logits, result = arena.alloc(vocab * 4), arena.alloc(4)
    launch = kernels.launch("argmax_rows", (1,), (1024,), "pip", [logits, vocab, result])
    rows.append({"kernel": "argmax_rows", "shape": f"1x{vocab}", "M": 1,
                 "us": round(time_graph_us(stream, lambda i: launch.enqueue(stream)), 2)})
    table_qs, table_scales, x = arena.alloc(vocab * hidden), arena.alloc(vocab * hidden // 16), arena.alloc(hidden * 4)
    ids, inv_rms = arena.alloc(4), arena.alloc(4)
    driver.h2d_sync(ids, np.array([1234], np.int32))
    launch = kernels.launch("embed_q8", (1,), (256,), "pppppppfi", [table_qs, table_scales, ids, x, x, x, inv_rms,
                                                                   1e-6, hidden])
    rows.append({"kernel": "embed_q8", "shape": f"1x{hidden}", "M": 1,
                 "us": round(time_graph_us(stream, lambda i: launch.enqueue(stream)), 2)})
    for row in rows[-3:]:
        print(row, flush=True)
    return rows


if __name__ == "__main__":
    main()
