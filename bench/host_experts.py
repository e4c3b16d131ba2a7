"""One routed layer's chosen experts on the host kernels (host_moe.c's ks_experts, the op mode offload and the CPU
engine run for a mixture-of-experts layer), at a preset's shape: µs a layer and the GB/s of the chosen experts'
bytes, beside a dense matmul of the layer's gate|up shape in the same format at the same token count (copies of
it cycled to the experts' bytes, so both read a pool of the same size: a last-level cache can hold a few copies).

    python3 -m bench.host_experts [--preset qwen3-30b-a3b] [--format Q8_0|Q4_K] [--tokens 1,2,4] [--threads 1,2]
        [--isa amx] [--seconds 2] [--out DIR]

Every expert of the layer in --format (random levels and scales; Q4_K: random blocks, repacked as prepared), each
a bound gate|up Linear (SiLU·mul) and down Linear; each call routes its tokens to k distinct experts drawn at random (64 routes cycled, the experts' bytes
mostly from memory: the layer's experts are more than the caches hold).  GB/s counts the experts a call ran
(distinct over its tokens).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from kestrel_stream import native
from kestrel_stream.cli.bench import environment
from kestrel_stream.loading.presets import PRESETS
from kestrel_stream.native.routed import Experts

from .report import write_results


BYTES_PER_32 = {"Q8_0": 34, "Q4_K": 18}       # a format's bytes per 32 values


def weight(kernels, rng, rows: int, cols: int, fmt: str = "Q8_0"):
    if fmt == "Q8_0":
        return kernels.prepare_q8_0(rng.integers(-127, 128, (rows, cols), dtype=np.int8),
                                    np.full((rows, cols // 32), 0.01, np.float16))
    from bench.synthetic import random_blocks
    return kernels.prepare_blocks(fmt, random_blocks(rng, fmt, rows, cols, 0.02), cols)


def timed(call, count: int, seconds: float) -> float:
    """Seconds a call of call(i) for i cycling over `count`, after one warm pass."""
    for i in range(count):
        call(i)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        call(calls % count)
        calls += 1
    return (time.perf_counter() - start) / calls


def layer_rows(preset: str, tokens: list[int], threads: int, isa: str | None, seconds: float, seed: int = 0,
               fmt: str = "Q8_0") -> list[dict]:
    cfg = PRESETS[preset]
    H, I, E, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    kernels = native.load(threads=threads, isa=isa)
    rng = np.random.default_rng(seed)
    experts = Experts(kernels, [kernels.linear(weight(kernels, rng, 2 * I, H, fmt), glu=True) for _ in range(E)],
                      [kernels.linear(weight(kernels, rng, H, I, fmt)) for _ in range(E)], np.ones(H, np.float32),
                      cfg.rms_norm_eps, k)
    expert_bytes = 3 * I * H * BYTES_PER_32[fmt] // 32
    dense_bytes = 2 * I * k * H * BYTES_PER_32[fmt] // 32
    # as many dense copies as the experts' bytes (cycled: the same pool to read from, past the caches alike)
    dense = [kernels.linear(weight(kernels, rng, 2 * I * k, H, fmt))
             for _ in range(max(2, -(-E * expert_bytes // dense_bytes)))]
    rows = []
    for t in tokens:
        x = rng.standard_normal((t, H)).astype(np.float32)
        routes, used = [], []
        for _ in range(64):
            ids = np.stack([rng.choice(E, k, replace=False) for _ in range(t)]).astype(np.float32)
            routes.append(np.concatenate([ids, np.full((t, k), 1.0 / k, np.float32)], axis=1))
            used.append(len(np.unique(ids)))
        seconds_a_layer = timed(lambda i: experts(x.copy(), routes[i]), len(routes), seconds)
        dense_s = timed(lambda i: dense[i](x), len(dense), seconds)
        chosen = float(np.mean(used))
        rows.append({"preset": preset, "format": fmt, "isa": kernels.isa, "threads": threads, "tokens": t,
                     "experts_run": round(chosen, 1), "us": round(seconds_a_layer * 1e6, 1),
                     "GB_s": round(chosen * expert_bytes / seconds_a_layer / 1e9, 2),
                     "dense_us": round(dense_s * 1e6, 1),
                     "dense_GB_s": round(dense_bytes / dense_s / 1e9, 2)})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--format", default="Q8_0", choices=sorted(BYTES_PER_32))
    parser.add_argument("--tokens", default="1,2,4")
    parser.add_argument("--threads", default=None, help="comma list (default: the physical cores)")
    parser.add_argument("--isa", default=None)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    threads = [int(n) for n in args.threads.split(",")] if args.threads else [native.physical_cores()]
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = [row for n in threads for row in layer_rows(args.preset, tokens, n, args.isa, args.seconds, fmt=args.format)]
    notes = (f"One routed layer's chosen experts (ks_experts), random routes, {args.format}: µs a layer, GB/s of the experts it "
             "ran; dense: one matmul of k experts' gate|up rows at once (2 I k x H), the same tokens, copies "
             "cycled to the experts' bytes.")
    path = write_results(f"host-experts-{args.preset}-{args.format.lower()}", environment(), rows,
                         ["preset", "format", "isa", "threads", "tokens", "experts_run", "us", "GB_s", "dense_us", "dense_GB_s"],
                         notes, args.out)
    print(path.read_text())


if __name__ == "__main__":
    main()
