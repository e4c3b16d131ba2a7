"""Batched greedy decode (bench/prefill.py's batched rows) with the few-token GEMMs on the split sweep's
winners, against the default choice, in one run; and where a decode step's GPU time goes.

    PYTHONPATH=. python3 -m bench.fewtok_decode [--winners DIR/DATE-h200-mma-split-winners.json]
        [--shape qwen3-1.7b|qwen3-8b] [--sessions 9,16,32,64] [--prompt-len 128] [--new-tokens 64]
        [--ops] [--split-blocks 1024,4096] [--out DIR]

choice "default": mma_variants.choose_variant as committed.  "winners": for a GEMM of T tokens whose
(rows, K) is a shape of bench/mma.py's SPLIT_SHAPES, the winner of `--winners` (bench/mma.py --sweep
splits' JSON) at the smallest swept token count >= T, where it is valid for K and fits the split
scratch the executor allocates for it (mma_variants.scratch_bound with the winners' tiles counted);
the default elsewhere.  Each choice gets its own executor (graphs captured per bucket with it).
--ops: GPU µs per op of one decode step of each session count, each launch between two timing events.
--split-blocks: split-key attention's target blocks per step (cuda/flash_attention.SPLIT_TARGET_BLOCKS;
the splits of a step come from it), one executor per value; rows say which.
"""
from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager

import numpy as np

from kestrel_stream.cli.bench import environment
from kestrel_stream.cuda import driver, flash_attention, mma_variants
from bench.synthetic import random_q8_weights
from kestrel_stream.run.compat import GpuExecutor

from .mma import SPLIT_SHAPES
from .report import write_results


def winners_table(rows: list[dict], model: str) -> dict[tuple[int, int], list[tuple[int, str]]]:
    """(rows, K) -> [(tokens, best variant)] ascending in tokens, from the split sweep's winner rows of `model`."""
    table: dict[tuple[int, int], list[tuple[int, str]]] = {}
    for row in rows:
        if row["model"] == model and (model, row["op"]) in SPLIT_SHAPES:
            table.setdefault(SPLIT_SHAPES[(model, row["op"])], []).append((int(row["tokens"]), row["best"]))
    return {shape: sorted(entries) for shape, entries in table.items()}


def table_choice(table, fallback, max_tokens: int = 64):
    """choose_variant's signature: the table's variant where it applies, else fallback's."""
    bound_floats, bound_tickets = mma_variants.scratch_bound(max_tokens)

    def choose(tokens: int, rows: int, k: int) -> str:
        entries = [variant for swept, variant in table.get((rows, k), []) if swept >= tokens]
        if not entries:
            return fallback(tokens, rows, k)
        tile, splits = mma_variants.parse_variant(entries[0])
        floats, tickets = mma_variants.scratch_floats(tokens, rows, tile, splits)
        if not mma_variants.split_is_valid(k, mma_variants.TILES[tile], splits) or floats > bound_floats \
                or tickets > bound_tickets:
            return fallback(tokens, rows, k)
        return entries[0]
    return choose


@contextmanager
def installed(table):
    """mma_variants.choose_variant answering from `table` (None: as committed), its tiles counted in the
    split scratch bound; restored after."""
    saved = mma_variants.choose_variant, mma_variants.SMALL_STEP_TILES
    if table is not None:
        tiles = {mma_variants.parse_variant(v)[0] for entries in table.values() for _, v in entries}
        mma_variants.SMALL_STEP_TILES = tuple(sorted(set(saved[1]) | tiles))
        mma_variants.choose_variant = table_choice(table, saved[0])
    try:
        yield
    finally:
        mma_variants.choose_variant, mma_variants.SMALL_STEP_TILES = saved


def decode_ops(gpu: GpuExecutor, sessions, tokens, position: int) -> dict:
    """GPU µs per op (summed over layers) of one decode step of these sessions, eagerly, launch by launch."""
    rows = gpu.steps._rows([(kv, np.array([int(t)]), position) for kv, t in zip(sessions, tokens)])
    bucket = next(b for b in gpu.steps.buckets if b >= len(rows))
    gpu.steps.stage(rows, bucket)
    driver.h2d_async(gpu.steps.step_params.device.ptr, gpu.steps.step_params.host, gpu.steps.step_params.host.nbytes, gpu.steps.stream)
    launches = gpu.steps.step_launches(bucket)
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
    return {op: round(us, 1) for op, us in totals.items()}


def run_choice(weights, args, counts, choice: str) -> list[dict]:
    seq = args.prompt_len + args.new_tokens + 1
    gpu = GpuExecutor(weights, max_seq_len=seq, max_batch=max(counts), max_sessions=max(counts) + 1)
    rng = np.random.default_rng(0)
    out = []
    for n in counts:
        sessions = [gpu.alloc_kv(seq) for _ in range(n)]
        prompts = [rng.integers(0, weights.config.vocab_size, args.prompt_len) for _ in range(n)]
        tokens = gpu.forward_greedy([(kv, p, 0) for kv, p in zip(sessions, prompts)])
        step = lambda pos, toks: [(kv, np.array([int(t)]), pos) for kv, t in zip(sessions, toks)]
        tokens = gpu.forward_greedy(step(args.prompt_len, tokens))        # captures this bucket's graph
        t0 = time.perf_counter()
        for i in range(args.new_tokens):
            tokens = gpu.forward_greedy(step(args.prompt_len + 1 + i, tokens))
        decode_s = time.perf_counter() - t0
        row = {"choice": choice, "sessions": n, "tok_s": round(n * args.new_tokens / decode_s, 1),
               "ms": round(decode_s / args.new_tokens * 1e3, 3)}
        if args.ops:
            ops = decode_ops(gpu, sessions, tokens, args.prompt_len + 1 + args.new_tokens - 1)
            row["ops_us"] = ops
            row["gpu_ms"] = round(sum(ops.values()) / 1e3, 3)
        print(row, flush=True)
        out.append(row)
        for kv in sessions:
            gpu.free_kv(kv)
    gpu.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--winners", default=None, help="bench/mma.py --sweep splits' *-split-winners.json")
    parser.add_argument("--shape", default="qwen3-1.7b", choices=["qwen3-1.7b", "qwen3-8b"])
    parser.add_argument("--sessions", default="9,16,32,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--ops", action="store_true", help="GPU time per op of one decode step")
    parser.add_argument("--split-blocks", default="", help="comma-separated SPLIT_TARGET_BLOCKS values to run")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    counts = [int(n) for n in args.sessions.split(",")]
    if min(counts) < 1 or args.prompt_len < 1 or args.new_tokens < 1:
        parser.error("--sessions, --prompt-len and --new-tokens must be positive")
    table = None
    if args.winners:
        table = winners_table(json.loads(open(args.winners).read())["rows"], args.shape)
        if not table:
            parser.error(f"--winners {args.winners}: no rows of {args.shape} shapes")
    weights = random_q8_weights(args.shape, seed=0)
    rows = []
    default_blocks = flash_attention.SPLIT_TARGET_BLOCKS
    for blocks in [int(b) for b in args.split_blocks.split(",") if b] or [default_blocks]:
        flash_attention.SPLIT_TARGET_BLOCKS = blocks
        try:
            for choice, chosen in [("default", None)] + ([("winners", table)] if table else []):
                with installed(chosen):
                    rows += [dict(row, split_blocks=blocks) for row in run_choice(weights, args, counts, choice)]
        finally:
            flash_attention.SPLIT_TARGET_BLOCKS = default_blocks
    env = environment()
    env.update(machine=driver.detect(), model=f"random {args.shape}")
    notes = (f"random Q8_0 weights, {args.shape} shape; {args.prompt_len}-token prompts, then {args.new_tokens} "
             f"greedy steps of all sessions (graph replays); tok_s = aggregate, ms = per step. winners: "
             f"{args.winners or '-'}; gpu_ms / ops_us: one step eagerly, launch by launch (no overlap).")
    path = write_results(f"h200-fewtok-decode-{args.shape}", env, rows,
                         ["choice", "split_blocks", "sessions", "tok_s", "ms", "gpu_ms", "ops_us"], notes, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
