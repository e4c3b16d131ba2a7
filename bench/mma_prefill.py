"""The tensor-core Q8_0 GEMMs -- int8 q8_mma.cu and fp16 q8_mma_f16_ws.cu -- against the fp32 SIMT
q8_matmul.cu, in TFLOP/s.

    PYTHONPATH=. python3 -m bench.mma_prefill [--out DIR] [--repeats N] [--only decode|prefill]
                                              [--f16-tiles SUBSTRING]

decode: tokens x rows x K of the qwen3-1.7b projections at batched-decode token counts (16, 32, 64)
and a 512-token prefill, every int8 tile of mma_variants.TILES plus simt.  prefill: the layer shapes
of qwen3-1.7b and qwen3-8b (qkv, o, gate_up, down) at 64..2048 tokens, every fp16 tile of
mma_variants.F16_TILES beside the int8 tiles a prefill could use (and the launcher's default, if it
is neither); the winner per shape is printed,
and the smallest token count from which fp16 wins every shape (mma_variants.F16_MIN_TOKENS's
measure).  Each kernel is captured `repeats` times into one graph (fewer for the largest shapes)
and timed with events around replays (bench/gpu_kernels.py's method).
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
# (model, projection, rows N, K) of one layer: qkv = q + 2 kv heads x 128, gate_up = 2 x intermediate
LAYER_SHAPES = [("qwen3-1.7b", "qkv", 4096, 2048), ("qwen3-1.7b", "o", 2048, 2048),
                ("qwen3-1.7b", "gate_up", 12288, 2048), ("qwen3-1.7b", "down", 2048, 6144),
                ("qwen3-8b", "qkv", 6144, 4096), ("qwen3-8b", "o", 4096, 4096),
                ("qwen3-8b", "gate_up", 24576, 4096), ("qwen3-8b", "down", 4096, 12288)]
PREFILL_TOKENS = (64, 128, 256, 512, 2048)
INT8_PREFILL_TILES = ("64x128", "64x64", "32x64")
GRAPH_FLOPS = 1e12          # at most this much work per captured graph: the largest shapes get fewer repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--only", choices=("decode", "prefill"), default=None)
    parser.add_argument("--f16-tiles", default=None, metavar="SUBSTRING",
                        help="prefill: only the fp16 tiles whose name contains this (e.g. _ws; !_ws: those without), "
                             "beside the default")
    args = parser.parse_args()
    def wanted(name: str) -> bool:
        if args.f16_tiles is None:
            return True
        return args.f16_tiles[1:] not in name if args.f16_tiles.startswith("!") else args.f16_tiles in name
    f16_tiles = [name for name in mma_variants.F16_TILES if wanted(name)]
    if not f16_tiles:
        parser.error(f"--f16-tiles {args.f16_tiles!r}: no tile of {', '.join(mma_variants.F16_TILES)}")
    device = driver.Device(0)
    bench = Bench(KernelSet(device), driver.Stream(), driver.Arena(4 << 30), args.repeats)
    if args.only != "prefill":
        for tokens, n, k in SHAPES:
            default = default_variant(tokens, n, k)
            variants = ["simt", *mma_variants.TILES]
            bench.shape("", "", tokens, n, k, variants + ([default] if default not in variants else []), default)
    if args.only != "decode":
        for model, projection, n, k in LAYER_SHAPES:
            for tokens in PREFILL_TOKENS:
                default = default_variant(tokens, n, k)
                variants = [*f16_tiles, *INT8_PREFILL_TILES]
                variants += [default] if default not in variants else []
                bench.shape(model, projection, tokens, n, k, variants, default)
        print_winners(bench.rows)
    notes = ("q8_mma (int8) and q8_f16mma (fp16) tiles vs q8_matmul (simt); default = the launcher's pick "
             f"(F16_MIN_TOKENS {mma_variants.F16_MIN_TOKENS}). Up to {args.repeats} launches per graph, "
             "median of 5 replays; weights are 4-200 MB, partly L2-resident.")
    name = "h200-mma" + (f"-{args.only}" if args.only else "")
    path = write_results(name, environment(), bench.rows,
                         ["model", "op", "tokens", "rows", "k", "kernel", "default", "us", "tflop_s"], notes, args.out)
    print(f"results: {path}")


def default_variant(tokens: int, n: int, k: int = 0) -> str:
    """What gemv_launch picks for a tokens x n output with no variant given."""
    if mma_variants.uses_f16(tokens):
        return mma_variants.choose_f16_tile(tokens, n, k=k)
    return mma_variants.choose_tile(tokens, n)


class Bench:
    def __init__(self, kernels, stream, arena, repeats: int):
        self.kernels, self.stream, self.arena, self.repeats = kernels, stream, arena, repeats
        self.rng = np.random.default_rng(0)
        self.rows: list[dict] = []

    def shape(self, model: str, op: str, tokens: int, n: int, k: int, variants, default: str) -> None:
        arena, rng = self.arena, self.rng
        qs, scales = arena.alloc(n * k), arena.alloc(n * k // 32 * 2)
        driver.h2d_sync(qs, rng.integers(-127, 128, n * k, dtype=np.int8))
        driver.h2d_sync(scales, np.full(n * k // 32, 0.01, np.float16))
        x, y = arena.array((tokens, k), np.float32), arena.array((tokens, n), np.float32)
        driver.h2d_sync(x.ptr, rng.standard_normal((tokens, k)).astype(np.float32))
        w = QWeight(qs, scales, n, k)
        flops = 2 * tokens * n * k
        repeats = max(2, min(self.repeats, int(GRAPH_FLOPS // flops)))
        for variant in variants:
            launch = gemv_launch(self.kernels, w, x.ptr, k, y.ptr, n, tokens, variant=variant)
            us = time_graph_us(self.stream, lambda i: launch.enqueue(self.stream), repeats=repeats)
            tflops = flops / us / 1e6
            self.rows.append({"model": model, "op": op, "tokens": tokens, "rows": n, "k": k, "kernel": launch.name,
                              "default": variant == default, "us": round(us, 2), "tflop_s": round(tflops, 2)})
            print(f"{model:11s}{op:8s}{tokens:5d} x {n:6d} x {k:5d}  {launch.name:26s}"
                  f"{' *' if variant == default else '  '}  {us:10.2f} us  {tflops:7.2f} TFLOP/s", flush=True)
        for ptr in (qs, scales, x.ptr, y.ptr):
            arena.free(ptr)


def print_winners(rows: list[dict]) -> None:
    """The fastest kernel per prefill shape beside the default's time, then per token count whether
    an fp16 tile beats every int8 one on every shape."""
    shapes: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["model"]:
            shapes.setdefault((row["model"], row["op"], row["tokens"], row["rows"], row["k"]), []).append(row)
    print("\nwinner per shape (default's time beside it):")
    f16_wins: dict[int, bool] = {}
    for (model, op, tokens, n, k), group in shapes.items():
        best = min(group, key=lambda r: r["us"])
        default = next(r for r in group if r["default"])
        best_f16 = min(r["us"] for r in group if r["kernel"].startswith("q8_f16mma_"))
        best_int8 = min(r["us"] for r in group if r["kernel"].startswith("q8_mma_"))
        f16_wins[tokens] = f16_wins.get(tokens, True) and best_f16 < best_int8
        print(f"  {model:11s}{op:8s}{tokens:5d} x {n:6d} x {k:5d}  {best['kernel']:26s}{best['tflop_s']:7.2f} TFLOP/s"
              f"   default {default['kernel']} {default['tflop_s']:.2f}")
    print("fp16 beats int8 on every shape at tokens: "
          + ", ".join(f"{t}: {'yes' if won else 'no'}" for t, won in sorted(f16_wins.items())))


if __name__ == "__main__":
    main()
