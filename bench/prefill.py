"""`gpu` mode prefill (pp512) and batched greedy decode, in the shape of llama-bench / llama-batched-bench.

    PYTHONPATH=. python3 -m bench.prefill [--model F.gguf | --shape qwen3-1.7b|qwen3-8b] [--out DIR]
        [--sessions 1,4,8,16,32] [--prompt-len 128] [--new-tokens 64] [--pp 512] [--repeats 3]
        [--attention auto|split|flash] [--ops] [--gemm all|cublas|builtin|q8] [--pp-sweep 128,256]

pp: one session prefills `--pp` tokens with logits="last" (lm_head on the last row only); tok/s of
the best of `--repeats` (llama-bench's pp512 is a mean over its repetitions, after a warm-up).
Batched decode: N sessions each prefill a `--prompt-len` prompt, then `--new-tokens` greedy steps of
all N together through forward_greedy (one graph replay per bucket, argmax on the device, 4 bytes per
session back); aggregate tok/s = N * new tokens / decode time (llama-batched-bench's S_TG).
The pp row's attention_ms is the GPU time of the pp step's attention launches (every layer), each
between two timing events; --attention split|flash forces that kernel for the pp step (default: the
step's own choice, cuda/flash_attention.py), so one run each gives the A/B.
--gemm all (or both) runs each pp step once per GEMM: the dense path of steps of >=
scheduler.dense.default_min_tokens tokens on cuBLAS (when the `cublas` extra is installed) and on the
built-in q8_gemm_f16 (the default without cuBLAS), then the q8_mma tensor-core kernels (the path off);
gemm_ms / gemm_tflops are the GPU time and rate of the step's projections (each projection between two
timing events, the input rounding, the cuBLAS path's weight expansion and the epilogues included).
--pp-sweep adds shorter pp steps (e.g. 64,128,256) to find where cuBLAS starts to win.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from kestrel_stream.cli.bench import environment
from kestrel_stream.cuda import driver
from kestrel_stream.cuda.flash_attention import AttentionChoice
from bench.synthetic import random_q8_weights
from kestrel_stream.options import Options
from kestrel_stream.run.compat import GpuExecutor
from scheduler.dense import default_min_tokens
from scheduler.ops import PROJECTION_GROUPS

from .report import write_results


def load(args):
    if args.model:
        from kestrel_stream.loading.loader import load_weights
        return load_weights(args.model)
    return random_q8_weights(args.shape, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a .gguf file (default: random weights of --shape)")
    parser.add_argument("--shape", default="qwen3-1.7b", choices=["qwen3-1.7b", "qwen3-8b"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--sessions", default="1,4,8,16,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--pp", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ops", action="store_true", help="also print GPU time per op of one pp step")
    parser.add_argument("--attention", default="auto", choices=["auto", "split", "flash"],
                        help="the pp step's attention kernel (default: the step's own choice)")
    parser.add_argument("--gemm", default="all", choices=["all", "both", "cublas", "builtin", "q8"],
                        help="the pp step's projections: cuBLAS, the built-in dense GEMM, q8_mma, or one run of each")
    parser.add_argument("--pp-sweep", default="", help="more pp lengths, comma-separated (e.g. 64,128,256)")
    parser.add_argument("--cublas-min-tokens", type=int, default=None,
                        help="the executor's threshold (default scheduler.dense.default_min_tokens)")
    args = parser.parse_args()
    counts = [int(n) for n in args.sessions.split(",")]
    weights = load(args)
    c = weights.config
    seq = max(args.pp, args.prompt_len + args.new_tokens + 1)
    # the sweep's shorter steps must reach the library path too: its threshold at most the shortest
    lengths = [args.pp] + [int(n) for n in args.pp_sweep.split(",") if n]
    min_tokens = args.cublas_min_tokens if args.cublas_min_tokens is not None else (
        min([default_min_tokens(c)] + lengths) if args.pp_sweep else None)
    gpu = GpuExecutor(weights, max_seq_len=seq, max_batch=max(counts), max_sessions=max(counts) + 1,
                      prefill_chunk=max(args.pp, 64), options=Options.from_env().with_(cublas_min_tokens=min_tokens))
    scratch = gpu.backend.state.dense            # the dense path: cuBLAS's, or the built-in GEMM's (fused)
    every = ["cublas", "builtin", "q8"]
    gemms = {"all": every, "both": every, "cublas": ["cublas"], "builtin": ["builtin"], "q8": ["q8"]}[args.gemm]
    if (scratch is None or scratch.fused) and "cublas" in gemms:
        print("cuBLAS path off (see the line above): no cuBLAS rows")
        gemms = [g for g in gemms if g != "cublas"]
    scratches = {"cublas": scratch, "q8": None,
                 "builtin": None if scratch is None else dataclasses.replace(scratch, blas=None, weights=0)}
    rng = np.random.default_rng(0)
    rows = []
    kv = gpu.alloc_kv(seq)
    for pp in lengths:
        prompt = rng.integers(0, c.vocab_size, pp)
        for gemm in gemms:
            use_gemm(gpu, scratches[gemm])
            row = pp_row(gpu, kv, prompt, args, gemm)
            print(row, flush=True)
            rows.append(row)
    gpu.free_kv(kv)
    use_gemm(gpu, scratch)
    if scratch is not None and args.cublas_min_tokens is None:     # decode rows: the default threshold
        scratch.min_tokens = gpu.backend.dense_min_tokens = default_min_tokens(c)

    for n in counts:
        sessions = [gpu.alloc_kv(seq) for _ in range(n)]
        prompts = [rng.integers(0, c.vocab_size, args.prompt_len) for _ in range(n)]
        t0 = time.perf_counter()
        tokens = gpu.forward_greedy([(kv, p, 0) for kv, p in zip(sessions, prompts)])
        prefill_s = time.perf_counter() - t0
        step = lambda pos, toks: [(kv, np.array([int(t)]), pos) for kv, t in zip(sessions, toks)]
        gpu.forward_greedy(step(args.prompt_len, tokens))        # captures this bucket's graph
        t0 = time.perf_counter()
        for i in range(args.new_tokens):
            tokens = gpu.forward_greedy(step(args.prompt_len + i, tokens))
        decode_s = time.perf_counter() - t0
        row = {"test": f"pp{args.prompt_len}+tg{args.new_tokens}", "sessions": n,
               "tok_s": round(n * args.new_tokens / decode_s, 1), "ms": round(decode_s / args.new_tokens * 1e3, 2),
               "prefill_tok_s": round(n * args.prompt_len / prefill_s, 1)}
        print(row, flush=True)
        rows.append(row)
        for kv in sessions:
            gpu.free_kv(kv)
    env = environment()
    env.update(machine=driver.detect(), model=args.model or f"random {args.shape}")
    notes = (f"{args.model or 'random Q8_0 weights, ' + args.shape + ' shape'}. pp rows: one session, "
             f"logits of the last row only, best of {args.repeats}. Batched rows: tok_s = aggregate greedy "
             f"decode (sessions x {args.new_tokens} tokens / decode time), ms = per step; prefill_tok_s = "
             f"the {args.prompt_len}-token prompts of all sessions in one step.")
    path = write_results(f"h200-prefill-{args.shape if not args.model else 'gguf'}", env, rows,
                         ["test", "gemm", "sessions", "tok_s", "ms", "gemm_ms", "gemm_tflops", "attention_ms",
                          "prefill_tok_s"], notes, args.out)
    print(f"wrote {path}")
    gpu.close()


def use_gemm(gpu: GpuExecutor, scratch) -> None:
    """Projections of later steps on cuBLAS (`scratch`: the executor's DenseScratch) or, None, on the
    built-in kernels: the launch lists are rebuilt."""
    gpu.backend.state.dense = scratch
    gpu.steps.clear_launches()


def pp_row(gpu: GpuExecutor, kv, prompt, args, gemm: str) -> dict:
    """One session prefilling `prompt` with logits="last": the best of args.repeats after a warm-up."""
    pp = len(prompt)
    gpu.forward([(kv, prompt, 0)], logits="last")       # warm-up: module loads, launch lists
    choices = [launch for launch in gpu.steps.step_launches(pp, (pp - 1, 1)) if isinstance(launch, AttentionChoice)]
    for launch in choices:
        launch.kernel = args.attention
    if args.attention != "auto" and not choices:
        print(f"--attention {args.attention}: this model's attention has one kernel only (the split kernel)")
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        gpu.forward([(kv, prompt, 0)], logits="last")
        times.append(time.perf_counter() - t0)
    ops, flops = op_breakdown(gpu, kv, prompt)
    if args.ops:
        print(gemm, ops, flush=True)
    gemm_us = sum(us for op, us in ops.items() if op in PROJECTION_GROUPS)
    return {"test": f"pp{pp}" + (f" ({args.attention} attention)" if choices and args.attention != "auto" else ""),
            "gemm": {"cublas": "cuBLAS", "builtin": "built-in", "q8": "q8_mma"}[gemm], "sessions": 1,
            "tok_s": round(pp / min(times), 1), "ms": round(min(times) * 1e3, 2),
            "gemm_ms": round(gemm_us / 1e3, 2), "gemm_tflops": round(flops / gemm_us / 1e6, 1) if gemm_us else None,
            "attention_ms": round(ops.get("attention", 0.0) / 1e3, 2)}


def op_breakdown(gpu: GpuExecutor, kv, prompt) -> tuple[dict, float]:
    """GPU µs per op (summed over layers) of one prefill step over `prompt`, each launch between two
    timing events (so without overlap between kernels), and the FLOPs of its projections."""
    rows = gpu.steps._rows([(kv, prompt, 0)])
    gpu.steps.stage(rows, len(rows))
    driver.h2d_async(gpu.steps.step_params.device.ptr, gpu.steps.step_params.host, gpu.steps.step_params.host.nbytes, gpu.steps.stream)
    launches = gpu.steps.step_launches(len(rows), (len(rows) - 1, 1))
    events = [driver.Event(timing=True) for _ in range(len(launches) + 1)]
    events[0].record(gpu.steps.stream)
    for launch, event in zip(launches, events[1:]):
        launch.enqueue(gpu.steps.stream)
        event.record(gpu.steps.stream)
    gpu.steps.stream.synchronize()
    totals: dict = {}
    for launch, before, after in zip(launches, events, events[1:]):
        op = launch.labels.get("op", launch.name)
        totals[op] = totals.get(op, 0.0) + after.elapsed_ms(before) * 1e3
    flops = sum(launch.labels.get("flops", 0) for launch in launches if launch.labels.get("op") in PROJECTION_GROUPS)
    return {op: round(us, 1) for op, us in totals.items()}, flops


if __name__ == "__main__":
    main()
