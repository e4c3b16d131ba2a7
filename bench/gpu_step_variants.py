"""Which single-token GEMV layout and whether programmatic launch: the whole decode step, measured.

    PYTHONPATH=. python3 -m bench.gpu_step_variants [--out DIR] [--commit HASH]

On the qwen3-1.7b shape (random Q8_0 weights, batch 1, 128 tokens of context), for
each GEMV variant policy (kestrel_stream/cuda/gemv_variants.py: the shape-based
default, or one variant forced for every single-token GEMV) with programmatic
dependent launch on and off: GPU µs per step (back-to-back graph replays timed
with events) and ms per step end to end through forward().
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from kestrel_stream.cli.bench import environment
from kestrel_stream.cuda import driver
from kestrel_stream.cuda import gemv_variants
from kestrel_stream.run.compat import GpuExecutor

from .gpu_decode import HBM_READ_GB_S, random_weights, replay_us
from .report import write_results


def measure(gpu: GpuExecutor, kv, policy: str, programmatic: bool, context: int, steps: int) -> dict:
    gpu.steps.kernels.gemv_m1 = None if policy == "default" else policy     # as KESTREL_GEMV_M1=policy
    gpu.steps.programmatic = programmatic
    for graphs in (gpu.steps._graphs, gpu.steps.chain._graphs):   # recapture with this layout and launch mode
        for graph in graphs.values():
            graph.destroy()
        graphs.clear()
    gpu.steps._launches.clear()
    token = np.array([17])
    gpu.forward_greedy([(kv, token, context)])      # capture the greedy graph too
    t0 = time.perf_counter()
    for step in range(steps):
        gpu.forward_greedy([(kv, token, context)])
    greedy_ms = (time.perf_counter() - t0) / steps * 1e3
    gpu.generate_greedy([(kv, token, context)], 2)   # capture the chain graph
    t0 = time.perf_counter()
    gpu.generate_greedy([(kv, token, context)], steps)
    chained_ms = (time.perf_counter() - t0) / steps * 1e3
    gpu.forward([(kv, token, context)])             # capture
    t0 = time.perf_counter()
    for step in range(steps):
        gpu.forward([(kv, token, context)])
    e2e_ms = (time.perf_counter() - t0) / steps * 1e3
    gpu_us = float(np.median([replay_us(gpu, 1) for _ in range(5)]))
    prompt = np.arange(64) % 1000
    gpu.forward([(kv, prompt, 0)])                  # builds the 64-token launch list
    t0 = time.perf_counter()
    for _ in range(3):
        gpu.forward([(kv, prompt, 0)])              # eager: 170 launches, one sync, logits of 64 rows
    prefill_tok_s = 3 * len(prompt) / (time.perf_counter() - t0)
    label = policy if policy else "base"
    return {"gemv_m1": label, "programmatic": programmatic, "gpu_us_per_step": round(gpu_us, 1),
            "ms_per_step": round(e2e_ms, 3), "tok_s": round(1000 / e2e_ms, 1),
            "greedy_tok_s": round(1000 / greedy_ms, 1), "chained_tok_s": round(1000 / chained_ms, 1),
            "prefill_tok_s": round(prefill_tok_s, 1),
            "frac_hbm_read_gpu_only": round(gpu.weights.quantized_bytes() / gpu_us / 1e3 / HBM_READ_GB_S, 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default=os.environ.get("KESTREL_COMMIT"))
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    gpu = GpuExecutor(random_weights(np.random.default_rng(0)), max_seq_len=1024, max_batch=1, max_sessions=2,
                      prefill_chunk=64)
    kv = gpu.alloc_kv(1024)
    gpu.forward([(kv, np.arange(args.context) % 1000, 0)])
    rows = []
    for policy in ["default", *gemv_variants.VARIANTS]:
        for programmatic in (False, True):
            rows.append(measure(gpu, kv, policy, programmatic, args.context, args.steps))
            print(rows[-1], flush=True)
    env = environment()
    env.update(machine=driver.detect(), commit=args.commit or env["commit"])
    notes = (f"qwen3-1.7b shape, random Q8_0 weights, batch 1 at position {args.context}; gpu_us_per_step: "
             f"median of 5 x 20 back-to-back graph replays; ms_per_step: {args.steps} forward() calls end to end "
             f"(replay, one sync, logits to host); greedy_tok_s: forward_greedy() (argmax on the device); chained_tok_s: "
             f"{args.steps} greedy steps chained on the device, one sync; "
             f"prefill_tok_s: 3 eager 64-token steps (q8_matmul). gemv_m1: the single-token GEMV layout "
             f"(default = by shape; base = 128 threads x 2 rows x 2).")
    path = write_results("h200-step-variants", env, rows, ["gemv_m1", "programmatic", "gpu_us_per_step",
                                                           "ms_per_step", "tok_s", "greedy_tok_s", "chained_tok_s",
                                                           "prefill_tok_s",
                                                           "frac_hbm_read_gpu_only"],
                         notes=notes, out_dir=args.out)
    print(f"wrote {path}")
    gpu.close()


if __name__ == "__main__":
    main()
