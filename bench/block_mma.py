"""The block-format GEMM (kernels_ptx/q4_mma.cu) at few-token and prefill step sizes: each token tile and K
split, and for Q4_K / Q6_K weights each fp16 tensor-core GEMV layout (q4k_ / q6k_gemv_hmma.cu, 2..16 tokens),
beside the default choice, µs per projection, for tuning cuda/block_kernels.py and gemv_variants.hmma_q4k_*.

    PYTHONPATH=. python3 -m bench.block_mma [--formats Q4_K,Q6_K,Q4_0,Q4_K+Q6_K] [--repeats 20]
        [--models qwen2.5-1.5b,qwen3-1.7b,qwen3-8b] [--tokens 2,4,8,9,11,16,17,32,64,65,128,512]
        [--splits 1,2,4,8,16] [--out DIR]

Each (format, model, projection, tokens) runs: the default launch (gemv_launch as a step makes it: the
tensor-core GEMV, a GEMV layout or block_kernels' tile and split), the tensor-core layouts, the 16-token tile with each split
count of --splits valid for K (up to 64 tokens), and the 64-token tile unsplit and with its default
split, each with the epilogue the step gives that projection (bench/block_gemv.py's), timed as
bench/block_gemv.py times the GEMV (REPEATS launches in a CUDA graph over rotating weight copies).
The summary names the fastest variant per shape and tokens beside the default.
"""
from __future__ import annotations

import argparse

import numpy as np

from kestrel_stream.cli.bench import environment
from kestrel_stream.cuda import block_kernels, driver, gemv_variants, kernels as kernel_module, mma_variants
from kestrel_stream.cuda.block_kernels import weight_bytes
from kestrel_stream.cuda.kernels import gemv_launch
from kestrel_stream.run.device.block_weights import block_image, device_qweight

from .block_gemv import COLD_BYTES, EPILOGUES, FORMATS, MODELS as GEMV_MODELS, gb_s, make_weight
from .gpu_kernels import time_graph_us
from .report import write_results

MODELS = {"qwen2.5-1.5b": {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960),
                           "lm_head": (151936, 1536), "qkv_v": 256}, **GEMV_MODELS}
TOKENS = "2,4,8,9,11,16,17,32,64,65,128,512"
REPEATS = 20


class Buffers:
    """Activations for up to `tokens` tokens of the widest shape, and the split scratch of an executor."""

    def __init__(self, arena, width: int, tokens: int, rng):
        self.x, self.y, self.xn = (arena.alloc(4 * tokens * width) for _ in range(3))
        self.normw, self.inv_rms_in, self.inv_rms = (arena.alloc(4 * width), arena.alloc(4 * tokens),
                                                     arena.alloc(4 * tokens))
        self.counter = arena.alloc(256)
        driver.h2d_sync(self.x, rng.standard_normal(tokens * width).astype(np.float32))
        driver.h2d_sync(self.y, np.zeros(tokens * width, np.float32))
        driver.h2d_sync(self.normw, np.ones(width, np.float32))
        driver.h2d_sync(self.inv_rms_in, np.ones(tokens, np.float32))
        driver.h2d_sync(self.counter, np.zeros(64, np.uint32))
        floats, tickets = mma_variants.scratch_bound(max(tokens, mma_variants.MMA_MIN_TOKENS))
        partials, ticket_ptr = arena.alloc(4 * floats), arena.alloc(4 * tickets)
        driver.h2d_sync(ticket_ptr, np.zeros(tickets, np.uint32))
        self.scratch = mma_variants.SplitScratch(partials, floats, ticket_ptr, tickets)

    def epilogue(self, epilogue: str, rows: int) -> tuple[int, dict]:
        if epilogue == "silu_pairs":
            return rows // 2, dict(silu_pairs=True, inv_rms_in=self.inv_rms_in)
        if epilogue == "residual_xn_rms":
            return rows, dict(res=self.y, normw_out=self.normw, xn_out=self.xn, inv_rms_out=self.inv_rms,
                              counter=self.counter)
        return rows, dict(inv_rms_in=self.inv_rms_in)


def variants(tokens: int, k: int, splits: list[int], fmt: str = "Q4_0") -> list[str | None]:
    """None (the default launch), a Q4_K / Q6_K weight's fp16 tensor-core layouts (2..16 tokens), the 16-token
    tile's splits (up to 64 tokens), the 64-token tile's."""
    out: list[str | None] = [None]
    if fmt in gemv_variants.HMMA_BLOCK_VARIANTS and k % 256 == 0 and \
            gemv_variants.HMMA_Q4K_MIN_TOKENS <= tokens <= gemv_variants.HMMA_MAX_TOKENS:
        out += list(gemv_variants.HMMA_BLOCK_VARIANTS[fmt])
    if tokens <= block_kernels.SMALL_TILE_MAX_TOKENS:
        out += [f"mma16s{s}" for s in splits if block_kernels.split_is_valid(k, s)] + ["mma16"]
    return out + ["mmas1", "mma"]


def bench_shape(kernels, arena, stream, buffers: Buffers, fmt: str, model: str, shapes: dict, projection: str,
                tokens_list, splits, rng, repeats: int = REPEATS) -> list[dict]:
    n, k = shapes[projection]
    w = make_weight(fmt, n, k, shapes["qkv_v"], rng)
    image = block_image(w, interleave=False)
    copies = max(1, min(repeats, -(-COLD_BYTES // image.nbytes)))
    ptrs = [arena.alloc(image.nbytes) for _ in range(copies)]
    for ptr in ptrs:
        driver.h2d_sync(ptr, image)
    weights = [device_qweight(ptr, w) for ptr in ptrs]
    epilogue = EPILOGUES[projection]
    if epilogue == "silu_pairs" and weights[0].tail is not None:
        epilogue = "rmsnorm"
    ldy, extra = buffers.epilogue(epilogue, n)
    rows = []
    for tokens in tokens_list:
        for variant in variants(tokens, k, splits, fmt):
            launches = [gemv_launch(kernels, qw, buffers.x, k, buffers.y, ldy, tokens, variant=variant,
                                    split_scratch=buffers.scratch, **extra) for qw in weights]
            for launch in launches:      # as a step launches them (run/device/launches.py)
                launch.programmatic = tokens <= kernel_module.GEMV_MAX_TOKENS
            us = time_graph_us(stream, lambda i: launches[i % copies].enqueue(stream), repeats)
            rows.append({"model": model, "projection": projection, "format": fmt, "shape": f"{n}x{k}",
                         "tokens": tokens, "variant": variant or "default", "kernel": launches[0].name,
                         "grid": "x".join(map(str, launches[0].grid)), "us": round(us, 2),
                         "weight_GB_s": gb_s(weight_bytes(weights[0]), us)})
            print(rows[-1], flush=True)
    for ptr in ptrs:
        arena.free(ptr)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per (format, model, projection, tokens): the default's µs, the fastest variant and its µs."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["format"], row["model"], row["projection"], row["tokens"]), []).append(row)
    out = []
    for (fmt, model, projection, tokens), entries in groups.items():
        default = next(r for r in entries if r["variant"] == "default")
        best = min(entries, key=lambda r: r["us"])
        out.append({"format": fmt, "model": model, "projection": projection, "tokens": tokens,
                    "default": f"{default['kernel']} {default['grid']}", "default_us": default["us"],
                    "best": best["variant"], "best_us": best["us"],
                    "gain": round(default["us"] / best["us"], 2) if best["us"] else 1.0})
    return out


def widest(models: dict) -> int:
    """The longest row or column of any projection: the activations' width per token."""
    return max(max(shape) for shapes in models.values() for name, shape in shapes.items() if name != "qkv_v")


def run(kernels, arena, stream, models: dict, formats, tokens_list, splits, rng, repeats: int = REPEATS):
    buffers = Buffers(arena, widest(models), max(tokens_list), rng)
    rows = []
    for model, shapes in models.items():
        for fmt in formats:
            for projection in ("qkv", "o", "gate_up", "down", "lm_head"):
                if fmt == "Q4_K+Q6_K" and projection != "qkv":
                    continue
                rows += bench_shape(kernels, arena, stream, buffers, fmt, model, shapes, projection, tokens_list,
                                    splits, rng, repeats)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--models", default="qwen2.5-1.5b,qwen3-1.7b")
    parser.add_argument("--tokens", default=TOKENS)
    parser.add_argument("--splits", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = driver.Device(0)
    device.make_current()
    kernels = kernel_module.KernelSet(device)
    models = {name: MODELS[name] for name in args.models.split(",")}
    tokens_list = [int(t) for t in args.tokens.split(",")]
    activations = 3 * 4 * max(tokens_list) * widest(models)
    arena = driver.Arena(3 * COLD_BYTES + activations + (256 << 20))
    stream = driver.Stream()
    rows = run(kernels, arena, stream, models, args.formats.split(","), tokens_list,
               [int(s) for s in args.splits.split(",")], np.random.default_rng(0), args.repeats)
    env = environment()
    columns = ["format", "model", "projection", "tokens", "default", "default_us", "best", "best_us", "gain"]
    path = write_results("block-mma", env, summary(rows), columns,
                         "Fastest variant per shape beside the default launch (bench/block_mma.py's docstring).",
                         args.out)
    write_results("block-mma-all", env, rows,
                  ["format", "model", "projection", "shape", "tokens", "variant", "kernel", "grid", "us",
                   "weight_GB_s"], "", args.out)
    print(path.read_text())


if __name__ == "__main__":
    main()
