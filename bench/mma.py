"""The tensor-core Q8_0 GEMM (q8_mma.cu): its tiles against the fp32 SIMT q8_matmul.cu, and its K splits
at batched-decode token counts.

    PYTHONPATH=. python3 -m bench.mma [--sweep tiles|splits|all] [--out DIR] [--repeats N] [--tiles A,B]
                                     [--models qwen3-1.7b,qwen3-8b]

tiles: tokens x rows x K of the qwen3-1.7b projections (o / qkv-ish 2048x2048, 6144x2048, down
2048x6144) at prefill (512) and batched-decode (16, 32, 64) token counts; every tile of
mma_variants.TILES plus the default choice, unsplit.  Each kernel is captured REPEATS times into one
graph and timed with events around replays (bench/gpu_kernels.py's method; weights are 4-25 MB, so
mostly L2-resident: a compute figure, not an HBM one).

splits: the four projections of qwen3-1.7b and qwen3-8b (and 1.7b's lm_head) at 9, 16, 32 and 64 tokens, with the
residual + next-norm epilogue on o/down and SiLU·mul on gate_up as the step runs them; every tile
compiled with split K (q8_mma.cu's 16-token tiles, q8_mma_pipe.cu's pipelined ones) with every valid
split count of SPLIT_COUNTS.  Launches rotate over copies of the weight
spanning more than the L2 (a decode step reads each weight once from HBM).  The winner per shape is
marked; choose_variant's pick is the default.  --tiles keeps the split sweep to some tiles (the default
pick is always timed), --models to some models.
"""
from __future__ import annotations

import argparse
from math import prod

import numpy as np

from kestrel_stream.cli.bench import environment
from kestrel_stream.cuda import driver, mma_variants
from kestrel_stream.cuda.kernels import KernelSet, QWeight, gemv_launch

from .gpu_kernels import time_graph_us
from .report import write_results

SHAPES = [(512, 2048, 2048), (512, 6144, 2048), (512, 2048, 6144), (512, 12288, 2048), (128, 4096, 2048),
          (16, 2048, 2048), (32, 2048, 2048), (64, 2048, 2048), (16, 4096, 2048), (16, 12288, 2048),
          (16, 2048, 6144), (32, 12288, 2048), (64, 12288, 2048), (64, 2048, 6144), (32, 151936, 2048)]

# (model, op): (rows, K) of the fused projections
SPLIT_SHAPES = {("qwen3-1.7b", "qkv"): (4096, 2048), ("qwen3-1.7b", "o"): (2048, 2048),
                ("qwen3-1.7b", "gate_up"): (12288, 2048), ("qwen3-1.7b", "down"): (2048, 6144),
                ("qwen3-8b", "qkv"): (6144, 4096), ("qwen3-8b", "o"): (4096, 4096),
                ("qwen3-8b", "gate_up"): (24576, 4096), ("qwen3-8b", "down"): (4096, 12288),
                # the vocabulary projection of a decode step: every 16-token tile of a 32-token step reads
                # the 311 MB weight again from HBM; a 32- or 64-token tile reads it once
                ("qwen3-1.7b", "lm_head"): (151936, 2048)}
SPLIT_TOKENS = (9, 16, 32, 64)
SPLIT_COUNTS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
ROTATE_BYTES = 256 << 20          # weight copies a timed graph cycles through: beyond the H200's 50 MB L2


class Bench:
    def __init__(self, repeats: int, arena_bytes: int = 4 << 30):
        self.device = driver.Device(0)
        self.kernels, self.stream = KernelSet(self.device), driver.Stream()
        self.arena = driver.Arena(arena_bytes)
        self.rng = np.random.default_rng(0)
        self.repeats = repeats

    def weights(self, n: int, k: int, copies: int) -> list[QWeight]:
        qs, scales = self.arena.alloc(copies * n * k), self.arena.alloc(copies * n * k // 16)
        driver.h2d_sync(qs, self.rng.integers(-127, 128, copies * n * k, dtype=np.int8))
        driver.h2d_sync(scales, np.full(copies * n * k // 32, 0.01, np.float16))
        return [QWeight(qs + i * n * k, scales + i * n * k // 16, n, k) for i in range(copies)]

    def vector(self, count: int, fill=None) -> int:
        ptr = self.arena.alloc(4 * count)
        values = (self.rng.standard_normal(count).astype(np.float32) if fill is None
                  else np.full(count, fill, np.float32))
        driver.h2d_sync(ptr, values)
        return ptr

    def time_us(self, launches) -> float:
        return time_graph_us(self.stream, lambda i: launches[i % len(launches)].enqueue(self.stream),
                             repeats=self.repeats)


def sweep_tiles(bench: Bench) -> list[dict]:
    rows = []
    for tokens, n, k in SHAPES:
        before = set(bench.arena._live)
        (w,) = bench.weights(n, k, 1)
        x, y = bench.vector(tokens * k), bench.vector(tokens * n, 0.0)
        default = mma_variants.choose_tile(tokens, n)
        for variant in ["simt", *mma_variants.TILES]:
            launch = gemv_launch(bench.kernels, w, x, k, y, n, tokens, variant=variant)
            us = bench.time_us([launch])
            tflops = 2 * tokens * n * k / us / 1e6
            rows.append({"tokens": tokens, "rows": n, "k": k, "kernel": launch.name,
                         "default": variant == default, "us": round(us, 2), "tflop_s": round(tflops, 2)})
            print(f"{tokens:4d} x {n:5d} x {k:5d}  {launch.name:22s}{' *' if variant == default else '  '}"
                  f"  {us:9.2f} us  {tflops:7.2f} TFLOP/s", flush=True)
        free_since(bench, before)
    return rows


def free_since(bench: Bench, before: set) -> None:
    for offset in set(bench.arena._live) - before:
        bench.arena.free(bench.arena.base + offset)


def split_candidates(tokens: int, n: int, k: int, tiles=None) -> list[str]:
    """Every split-K tile (of `tiles`, default all) with every valid split count, and choose_variant's pick;
    unsplit only where the tile alone gives SPLIT_TARGET_BLOCKS blocks."""
    out = [mma_variants.variant_name(tile, s) for tile, shape in mma_variants.TILES.items()
           if shape.splits_k and (tiles is None or tile in tiles)
           for s in SPLIT_COUNTS if mma_variants.split_is_valid(k, shape, s)
           and (s == 1 or prod(mma_variants.grid(tokens, n, tile, 1)) < mma_variants.SPLIT_TARGET_BLOCKS)]
    default = mma_variants.choose_variant(tokens, n, k)
    return out if default in out else out + [default]


def sweep_splits(bench: Bench, tiles=None, models=None) -> tuple[list[dict], list[dict]]:
    rows, winners = [], []
    for (model, op), (n, k) in SPLIT_SHAPES.items():
        if models is not None and model not in models:
            continue
        before = set(bench.arena._live)
        weight_bytes = n * k * 17 // 16
        copies = max(1, min(bench.repeats, -(-ROTATE_BYTES // weight_bytes)))
        weights = bench.weights(n, k, copies)
        tokens_max = max(SPLIT_TOKENS)
        cols = n // 2 if op == "gate_up" else n
        x, y = bench.vector(tokens_max * k), bench.vector(tokens_max * cols)
        xn, rms, counter = bench.vector(tokens_max * cols), bench.vector(tokens_max), bench.vector(16, 0.0)
        normw, inv_rms_in = bench.vector(cols, 1.0), bench.vector(tokens_max, 1.0)
        epilogue = ({"silu_pairs": True, "inv_rms_in": inv_rms_in} if op == "gate_up"
                    else {"res": y, "normw_out": normw, "xn_out": xn, "inv_rms_out": rms, "counter": counter}
                    if op in ("o", "down") else {"inv_rms_in": inv_rms_in})
        for tokens in SPLIT_TOKENS:
            default = mma_variants.choose_variant(tokens, n, k)
            results = []
            for variant in split_candidates(tokens, n, k, tiles):
                floats, tickets = mma_variants.scratch_floats(tokens, n, *mma_variants.parse_variant(variant))
                scratch = mma_variants.SplitScratch(bench.vector(max(floats, 4), 0.0), floats,
                                                    bench.vector(max(tickets, 1), 0.0), tickets)
                launches = [gemv_launch(bench.kernels, w, x, k, y, cols, tokens, variant=variant,
                                        split_scratch=scratch, **epilogue) for w in weights]
                us = bench.time_us(launches)
                results.append((us, variant, launches[0].grid))
                bench.arena.free(scratch.partials)
                bench.arena.free(scratch.tickets)
            best_us = min(us for us, _, _ in results)
            unsplit_default = mma_variants.choose_tile(tokens, n)
            for us, variant, grid in results:
                tile, splits = mma_variants.parse_variant(variant)
                rows.append({"model": model, "op": op, "tokens": tokens, "rows": n, "k": k, "variant": variant,
                             "splits": splits, "blocks": grid[0] * grid[1] * grid[2], "default": variant == default,
                             "best": us == best_us, "us": round(us, 2),
                             "weight_GB_s": round(weight_bytes / us / 1e3, 1) if us > 0 else None})
                print(f"{model:10s} {op:7s} {tokens:3d} x {n:5d} x {k:5d}  {variant:14s} blocks {rows[-1]['blocks']:5d}"
                      f"{' *' if variant == default else '  '}{' best' if us == best_us else '     '}"
                      f"  {us:8.2f} us  {rows[-1]['weight_GB_s']} GB/s", flush=True)
            by_variant = {variant: us for us, variant, _ in results}
            best = min(results)[1]
            winners.append({"model": model, "op": op, "tokens": tokens, "best": best, "best_us": round(best_us, 2),
                            "default": default, "default_us": round(by_variant[default], 2),
                            "unsplit_default_us": round(by_variant.get(unsplit_default, float("nan")), 2)})
            for family, pipelined in (("double_buffered", False), ("pipelined", True)):   # q8_mma.cu, q8_mma_pipe.cu
                mine = [(us, v) for us, v, _ in results
                        if mma_variants.TILES[mma_variants.parse_variant(v)[0]].pipelined == pipelined]
                if mine:
                    winners[-1][f"best_{family}"], winners[-1][f"best_{family}_us"] = min(mine)[1], round(min(mine)[0], 2)
        free_since(bench, before)
    return rows, winners


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", choices=("tiles", "splits", "all"), default="all")
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tiles", default=None, help="comma-separated TILES names for the split sweep (default all)")
    parser.add_argument("--models", default=None, help="comma-separated models of SPLIT_SHAPES (default all)")
    args = parser.parse_args()
    tiles = args.tiles.split(",") if args.tiles else None
    models = args.models.split(",") if args.models else None
    unknown = sorted(set(tiles or ()) - {name for name, tile in mma_variants.TILES.items() if tile.splits_k})
    if unknown:
        parser.error(f"--tiles: not split-K tiles of mma_variants.TILES: {', '.join(unknown)}")
    known_models = {model for model, _ in SPLIT_SHAPES}
    if models and set(models) - known_models:
        parser.error(f"--models: {', '.join(sorted(set(models) - known_models))} not in {', '.join(sorted(known_models))}")
    bench, env = Bench(args.repeats), environment()
    if args.sweep in ("tiles", "all"):
        rows = sweep_tiles(bench)
        notes = ("q8_mma tiles vs q8_matmul (simt); default = mma_variants.choose_tile's pick. "
                 f"{args.repeats} launches per graph, median of 5 replays.")
        print("results:", write_results("h200-mma", env, rows, ["tokens", "rows", "k", "kernel", "default", "us",
                                                                 "tflop_s"], notes, args.out))
    if args.sweep in ("splits", "all"):
        rows, winners = sweep_splits(bench, tiles, models)
        notes = ("q8_mma K splits (variant TILE[sS], S blocks per output tile merged by the last); default = "
                 f"mma_variants.choose_variant's pick; weights rotated over >= {ROTATE_BYTES >> 20} MB of copies; "
                 f"{args.repeats} launches per graph, median of 5 replays.")
        print("results:", write_results("h200-mma-splits", env, rows,
                                        ["model", "op", "tokens", "rows", "k", "variant", "splits", "blocks",
                                         "default", "best", "us", "weight_GB_s"], notes, args.out))
        print("results:", write_results("h200-mma-split-winners", env, winners,
                                        ["model", "op", "tokens", "best", "best_us", "default", "default_us",
                                         "unsplit_default_us", "best_double_buffered", "best_double_buffered_us",
                                         "best_pipelined", "best_pipelined_us"], notes, args.out))


if __name__ == "__main__":
    main()
