"""Every block-format GEMV layout at the qwen3-1.7b and qwen3-8b layer shapes: µs, weight GB/s, the winner.

    PYTHONPATH=. python3 -m bench.block_gemv [--out DIR] [--commit HASH] [--formats Q4_K,Q6_K,Q4_0,Q4_K+Q6_K]
                                             [--tokens 1,2,4,8] [--models qwen3-1.7b,qwen3-8b]
                                             [--layouts d,p64r8u1]

For each format (and the Q4_K + Q6_K stack of a Q4_K_M file's QKV), each layer shape and each token
count, every layout of cuda/q4_gemv_variants.variants(M) (the original kernel "" included) runs with
the epilogue the step gives that projection (qkv, lm_head: the RMSNorm scale; o, down: residual + next
norm's input + 1/rms; gate_up: RMSNorm scale + SiLU·mul pairs), launched programmatic as in a step,
and is timed as bench/gpu_kernels.py times the Q8_0 GEMV: REPEATS launches in one CUDA graph over
rotating weight copies, so a replay reads more than the L2 holds.  The Q8_0 GEMV at the same shape
and token count (its default layout) is the row `Q8_0`.  The summary names the fastest layout per
(format, shape, M) with its speed-up over the original kernel and prints a `MEASURED = {...}` line for
cuda/q4_gemv_variants.MEASURED.  GB/s counts the weight's bytes (block_kernels.weight_bytes).
--layouts times only the layouts named or of the families given by their letter (d: the dp4a ones), beside
the original kernel and the layout choose picks now (a shorter sweep: `--tokens 1 --layouts d,p64r8u1`).
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from kestrel_stream.cuda import driver, kernels as kernel_module, q4_gemv_variants as qv
from kestrel_stream.cuda.block_kernels import weight_bytes
from kestrel_stream.cuda.kernels import GEMV_COUNTER_BYTES, gemv_launch
from kestrel_stream.model.quant4 import BlockTensor, fuse_rows
from bench.synthetic import random_blocks
from kestrel_stream.run.device.block_weights import block_image, device_qweight

from .gpu_kernels import time_graph_us

# projection → (rows, cols) per model; qkv_v: the v rows of QKV (the Q6_K tail of the stack)
MODELS = {"qwen3-1.7b": {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144),
                         "lm_head": (151936, 2048), "qkv_v": 1024},
          "qwen3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
                       "lm_head": (151936, 4096), "qkv_v": 1024}}
FORMATS = ("Q4_K", "Q6_K", "Q4_0", "Q4_K+Q6_K")
EPILOGUES = {"qkv": "rmsnorm", "lm_head": "rmsnorm", "o": "residual_xn_rms", "down": "residual_xn_rms",
             "gate_up": "silu_pairs"}
REPEATS = 40
COLD_BYTES = 400 << 20


def make_weight(fmt: str, rows: int, cols: int, v_rows: int, rng):
    """A random weight of `fmt` (Q4_K+Q6_K: v_rows Q6_K rows under Q4_K ones)."""
    if fmt == "Q4_K+Q6_K":
        return fuse_rows([BlockTensor("Q4_K", random_blocks(rng, "Q4_K", rows - v_rows, cols, 0.02), cols),
                          BlockTensor("Q6_K", random_blocks(rng, "Q6_K", v_rows, cols, 0.02), cols)])
    return BlockTensor(fmt, random_blocks(rng, fmt, rows, cols, 0.02), cols)


def gb_s(nbytes: int, us: float) -> float:
    return round(nbytes / us / 1e3, 1) if us > 0 else 0.0     # an emulated device's clock does not move


class Buffers:
    """Activations for up to 8 tokens of the widest shape: x, y (also the residual), xn, norm weights, scratch."""

    def __init__(self, arena, width: int, rng):
        self.x, self.y, self.xn = (arena.alloc(4 * 8 * width) for _ in range(3))
        self.normw, self.inv_rms_in, self.inv_rms, self.counter = (arena.alloc(4 * width), arena.alloc(64),
                                                                   arena.alloc(64), arena.alloc(GEMV_COUNTER_BYTES))
        driver.h2d_sync(self.x, rng.standard_normal(8 * width).astype(np.float32))
        driver.h2d_sync(self.y, np.zeros(8 * width, np.float32))
        driver.h2d_sync(self.normw, np.ones(width, np.float32))
        driver.h2d_sync(self.inv_rms_in, np.ones(16, np.float32))
        driver.h2d_sync(self.counter, np.zeros(GEMV_COUNTER_BYTES // 4, np.uint32))

    def epilogue(self, epilogue: str, rows: int) -> tuple[int, dict]:
        """(ldy, gemv_launch keywords) of an epilogue for a weight of `rows` rows."""
        if epilogue == "silu_pairs":
            return rows // 2, dict(silu_pairs=True, inv_rms_in=self.inv_rms_in)
        if epilogue == "residual_xn_rms":
            return rows, dict(res=self.y, normw_out=self.normw, xn_out=self.xn, inv_rms_out=self.inv_rms,
                              counter=self.counter)
        return rows, dict(inv_rms_in=self.inv_rms_in)


def wanted(variant: str, chosen: str, layouts) -> bool:
    """Whether a sweep restricted to `layouts` (names or family letters; None: all) times `variant`."""
    return (layouts is None or variant in (qv.LEGACY, chosen) or variant in layouts
            or any(len(f) == 1 and variant.startswith(f) for f in layouts))


def bench_shape(kernels, arena, stream, buffers: Buffers, fmt: str, model: str, shapes: dict, projection: str,
                tokens_list, rng, repeats: int = REPEATS, layouts=None) -> list[dict]:
    """Rows of every layout for one weight shape (shapes: one entry of MODELS)."""
    n, k = shapes[projection]
    w = make_weight(fmt, n, k, shapes["qkv_v"], rng)
    image = block_image(w, interleave=False)     # timing only: gate/up order does not change the bytes read
    copies = max(1, min(repeats, -(-COLD_BYTES // image.nbytes)))
    ptrs = [arena.alloc(image.nbytes) for _ in range(copies)]
    for ptr in ptrs:
        driver.h2d_sync(ptr, image)
    weights = [device_qweight(ptr, w) for ptr in ptrs]
    nbytes = weight_bytes(weights[0])
    epilogue = EPILOGUES[projection]
    code = weights[0].fmt.lower() + (f"_{weights[0].tail.fmt.lower()}" if weights[0].tail else "")
    if epilogue == "silu_pairs" and not qv.has_tiled(code, True):
        epilogue = "rmsnorm"                       # no tiled SiLU kernel for this format: compare the plain ones
    ldy, extra = buffers.epilogue(epilogue, n)
    rows = []
    for tokens in tokens_list:
        m = qv.gemv_m(tokens)
        chosen = qv.choose(code, weights[0].fmt, n, k, tokens, epilogue == "silu_pairs")
        for variant in qv.variants(m):
            if variant != qv.LEGACY and not qv.has_tiled(code, epilogue == "silu_pairs"):
                continue
            if not wanted(variant, chosen, layouts):
                continue
            launches = [gemv_launch(kernels, qw, buffers.x, k, buffers.y, ldy, tokens, variant=variant, **extra)
                        for qw in weights]
            for launch in launches:
                launch.programmatic = True
            us = time_graph_us(stream, lambda i: launches[i % copies].enqueue(stream), repeats)
            rows.append({"model": model, "projection": projection, "format": fmt, "shape": f"{n}x{k}",
                         "epilogue": epilogue, "M": tokens, "variant": variant or "legacy",
                         "default": "*" if variant == chosen else "", "us": round(us, 2),
                         "weight_GB_s": gb_s(nbytes, us), "kernel": launches[0].name})
            print(rows[-1], flush=True)
    for ptr in ptrs:
        arena.free(ptr)
    return rows


def bench_q8(kernels, arena, stream, buffers: Buffers, model: str, shapes: dict, projection: str, tokens_list, rng,
             repeats: int = REPEATS) -> list[dict]:
    """The Q8_0 GEMV (its default layout) at the same shape, for reference."""
    n, k = shapes[projection]
    qs_bytes, scale_bytes = n * k, n * k // 32 * 2
    copies = max(1, min(repeats, -(-COLD_BYTES // (qs_bytes + scale_bytes))))
    qs, scales = arena.alloc(qs_bytes * copies), arena.alloc(scale_bytes * copies)
    driver.h2d_sync(qs, rng.integers(-127, 128, qs_bytes * copies, dtype=np.int8))
    driver.h2d_sync(scales, np.full(scale_bytes // 2 * copies, 0.01, np.float16))
    ldy, extra = buffers.epilogue(EPILOGUES[projection], n)
    rows = []
    for tokens in tokens_list:
        launches = [gemv_launch(kernels, kernel_module.QWeight(qs + i * qs_bytes, scales + i * scale_bytes, n, k),
                                buffers.x, k, buffers.y, ldy, tokens, **extra) for i in range(copies)]
        for launch in launches:
            launch.programmatic = True
        us = time_graph_us(stream, lambda i: launches[i % copies].enqueue(stream), repeats)
        rows.append({"model": model, "projection": projection, "format": "Q8_0", "shape": f"{n}x{k}",
                     "epilogue": EPILOGUES[projection], "M": tokens, "variant": "default", "default": "*",
                     "us": round(us, 2), "weight_GB_s": gb_s(qs_bytes + scale_bytes, us),
                     "kernel": launches[0].name})
        print(rows[-1], flush=True)
    arena.free(qs)
    arena.free(scales)
    return rows


def winners(rows: list[dict]) -> tuple[list[str], dict]:
    """Summary lines per (model, projection, format, M) and the MEASURED table of the winners."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["format"] != "Q8_0":
            groups.setdefault((row["model"], row["projection"], row["format"], row["M"]), []).append(row)
    lines, measured = [], {}
    for (model, projection, fmt, tokens), group in groups.items():
        best = min(group, key=lambda r: r["us"])
        legacy = next(r for r in group if r["variant"] == "legacy")
        default = next((r for r in group if r["default"]), legacy)
        lines.append(f"{model} {projection} {fmt} {best['shape']} M={tokens}: {best['variant']} {best['us']} us "
                     f"{best['weight_GB_s']} GB/s, x{legacy['us'] / max(best['us'], 1e-9):.2f} over legacy "
                     f"({legacy['weight_GB_s']} GB/s); default {default['variant']} {default['weight_GB_s']} GB/s")
        code, m = best["kernel"].partition("_gemv_m")[0], qv.gemv_m(tokens)
        rows_n, cols = (int(v) for v in best["shape"].split("x"))
        if m == tokens:
            measured[(code, m, rows_n, cols)] = "" if best["variant"] == "legacy" else best["variant"]
    return lines, measured


# a Q4_K_M file's GEMVs per token: projection → [(format, share of the layers)] (llama.cpp's mix: Q6_K for
# attn_v and ffn_down in about half the layers, and for the output)
Q4_K_M_MIX = {"qkv": [("Q4_K+Q6_K", 0.5), ("Q4_K", 0.5)], "o": [("Q4_K", 1.0)], "gate_up": [("Q4_K", 1.0)],
              "down": [("Q6_K", 0.5), ("Q4_K", 0.5)]}
LAYERS = {"qwen3-1.7b": 28, "qwen3-8b": 36}


def mix_estimates(rows: list[dict]) -> list[str]:
    """Per model and M: the GEMV µs of one Q4_K_M decode step (every layer's projections + lm_head in Q6_K)
    with the original kernel, the default layouts and the fastest ones, from the rows measured."""
    def us(model, projection, fmt, tokens, pick) -> float | None:
        group = [r for r in rows if (r["model"], r["projection"], r["format"], r["M"]) == (model, projection, fmt,
                                                                                         tokens)]
        chosen = {"best": group, "legacy": [r for r in group if r["variant"] == "legacy"],
                  "default": [r for r in group if r["default"]]}[pick]
        return min(r["us"] for r in chosen) if chosen else None

    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for tokens in dict.fromkeys(r["M"] for r in rows):
            totals = {}
            for pick in ("legacy", "default", "best"):
                parts = [us(model, p, fmt, tokens, pick) for p, mix in Q4_K_M_MIX.items() for fmt, _ in mix]
                head = us(model, "lm_head", "Q6_K", tokens, pick)
                if any(v is None for v in parts) or head is None:
                    break
                shares = [share for mix in Q4_K_M_MIX.values() for _, share in mix]
                totals[pick] = LAYERS.get(model, 1) * sum(v * s for v, s in zip(parts, shares)) + head
            if len(totals) == 3:
                lines.append(f"{model} Q4_K_M step GEMVs M={tokens}: legacy {totals['legacy']:.0f} us, default "
                             f"{totals['default']:.0f} us, fastest {totals['best']:.0f} us "
                             f"(x{totals['legacy'] / max(totals['best'], 1e-9):.2f})")
    return lines


def run(kernels, arena, stream, models: dict, formats, tokens_list, rng, repeats: int = REPEATS,
        layouts=None) -> list[dict]:
    """Every row of the bench; models: name → shapes, as MODELS; layouts: as `wanted`."""
    width = max(max(shapes[p][i] for p in EPILOGUES for i in (0, 1)) for shapes in models.values())
    buffers = Buffers(arena, width, rng)
    rows = []
    for model, shapes in models.items():
        for projection in EPILOGUES:
            for fmt in formats:
                if fmt == "Q4_K+Q6_K" and projection != "qkv":
                    continue
                rows += bench_shape(kernels, arena, stream, buffers, fmt, model, shapes, projection, tokens_list,
                                    rng, repeats, layouts)
            rows += bench_q8(kernels, arena, stream, buffers, model, shapes, projection, tokens_list, rng, repeats)
    return rows


def main() -> None:
    from kestrel_stream.cli.bench import environment

    from .report import write_results
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default=os.environ.get("KESTREL_COMMIT"))
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--tokens", default="1,2,4,8")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--layouts", default=None, help="layout names or family letters to time (default: all)")
    args = parser.parse_args()
    layouts = args.layouts.split(",") if args.layouts else None
    for name in layouts or []:
        if not (len(name) == 1 and any(v.startswith(name) for v in qv.ALL_VARIANTS if v)) and name not in qv.ALL_VARIANTS:
            parser.error(f"--layouts {name!r}: not a layout of cuda/q4_gemv_variants.py nor a family letter")
    device = driver.Device(0)
    kernels, stream = kernel_module.KernelSet(device), driver.Stream()
    arena = driver.Arena(8 << 30)          # the 8B shapes' rotated copies (COLD_BYTES each) and the Q8_0 beside them
    rng = np.random.default_rng(0)
    rows = run(kernels, arena, stream, {name: MODELS[name] for name in args.models.split(",")}, args.formats.split(","),
               [int(t) for t in args.tokens.split(",")], rng, layouts=layouts)
    lines, measured = winners(rows)
    lines += mix_estimates(rows)
    print("\n".join(lines))
    print("MEASURED = " + repr(dict(sorted(measured.items()))), flush=True)
    env = environment()
    env.update(machine=driver.detect(), commit=args.commit or env["commit"])
    notes = ("Layouts of kestrel_stream/cuda/q4_gemv_variants.py (legacy: q4_gemv.cu's original kernel; tTrRuU one "
             "token, pTrRuU prefetching, dTrRuU on dp4a, oTrRuU/gTrRuU 2..8 tokens: T threads, R rows per block, U "
             "units per thread in flight); default: the "
             "layout q4_gemv_variants.choose picks now. Epilogue: the step's for that projection. GB/s: weight bytes "
             "per launch / time; Q8_0 rows: the Q8_0 GEMV at the same shape. Fastest per shape: " + "; ".join(lines)
             + f". MEASURED = {dict(sorted(measured.items()))!r}")
    path = write_results("block-gemv", env, rows, ["model", "projection", "format", "shape", "epilogue", "M",
                                                   "variant", "default", "us", "weight_GB_s", "kernel"],
                         notes=notes, out_dir=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
