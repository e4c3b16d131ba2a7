"""The CPU engine's batched greedy decode: S sessions of a P-token prompt, then steps of all S together through
the executor (continuous batching's decode step), ms a step and tok/s, for any model file.

    python3 -m bench.cpu_batch_decode FILE [--sessions 1,8] [--prompt 16] [--steps 12] [--rounds 3] [--threads 2]
        [--out DIR]

Each session count: `ks.load(FILE, device="cpu", cpu_threads=T)`'s executor, S KV caches, one forward of the S
prompts, then `--rounds` rounds of `--steps` steps after one round of warm-up; the median round's ms a step.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import kestrel_stream as ks
from kestrel_stream.cli.bench import environment

from .report import write_results


def batch_row(engine, sessions: int, prompt: int, steps: int, rounds: int, seed: int = 0) -> dict:
    executor = engine.executor
    rng = np.random.default_rng(seed)
    kvs = [executor.alloc_kv(prompt + steps * (rounds + 1) + 1) for _ in range(sessions)]
    try:
        vocab = engine.config.vocab_size
        logits = executor.forward([(kv, rng.integers(min(100, vocab // 2), min(5000, vocab), prompt), 0) for kv in kvs])
        tokens, pos, times = [int(np.argmax(row[-1])) for row in logits], prompt, []
        for round_ in range(rounds + 1):
            start = time.perf_counter()
            for _ in range(steps):
                out = executor.forward([(kv, np.array([t]), pos) for kv, t in zip(kvs, tokens)])
                tokens, pos = [int(np.argmax(row[-1])) for row in out], pos + 1
            if round_:
                times.append((time.perf_counter() - start) / steps)
    finally:
        for kv in kvs:
            executor.free_kv(kv)
    step_s = statistics.median(times)
    return {"sessions": sessions, "ms_a_step": round(step_s * 1e3, 2), "tok_s": round(sessions / step_s, 2),
            "rounds_ms": [round(t * 1e3, 2) for t in times]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--sessions", default="1,8")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    engine = ks.load(args.model, device="cpu", cpu_threads=args.threads)
    rows = []
    for sessions in [int(s) for s in args.sessions.split(",")]:
        rows.append(dict(file=args.model.rsplit("/", 1)[-1], **batch_row(engine, sessions, args.prompt, args.steps,
                                                                          args.rounds)))
        print(rows[-1], flush=True)
    notes = (f"{args.prompt}-token prompts, then batched greedy steps of every session; ms a step: the median of "
             f"{args.rounds} rounds of {args.steps} steps after one; {args.threads} threads.")
    print(write_results("cpu-batch-decode", environment(), rows, ["file", "sessions", "ms_a_step", "tok_s", "rounds_ms"],
                        notes, args.out).read_text())


if __name__ == "__main__":
    main()
