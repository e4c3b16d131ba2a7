"""Modes compared on one GPU, and the calibrated gate against every group choice (measured).

    PYTHONPATH=. python3 -m bench.modes [--preset qwen3-1.7b] [--out DIR]

Part 1, batch 1: cpu, gated (calibrated cost model), gated with
KESTREL_MINFLOP=1e7 (the seed's threshold), gpu without graphs, gpu with
graphs (one step, one sync per token), gpu with graphs and generate()'s
greedy steps chained on the device (256 steps per sync): decode tok/s,
ms/token, syncs/token, launches/token.

Part 2: the gate's plan against the best of all 32 on/off choices of the
groups {qkv, o, gate_up, down, lm_head} (same choice in every layer), each
choice *timed* at M = 1 (one session) and M = 32 (32 sessions, one batched
step), next to the cost model's prediction for it.

Weights are random Q8_0 drawn directly (bench/synthetic.py random_q8_weights): the
arithmetic and bytes are those of the real shapes, without minutes of
checkpoint writing and quantization on the device.
"""
from __future__ import annotations

import argparse
import itertools
import os
import time

import numpy as np

import scheduler
from kestrel_stream.cli.bench import environment
from kestrel_stream.run.engine import Engine
from bench.synthetic import random_q8_weights

from .report import write_results


def decode_rate(engine: Engine, new_tokens: int, prompt_len: int = 16) -> dict:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, engine.config.vocab_size, prompt_len).tolist()
    engine.generate(prompt[:4], 3)                      # warm-up: dequant caches, graph capture
    result = engine.generate(prompt, new_tokens)
    return {"decode_tok_s": round(result.decode_tok_s, 1),
            "ms_per_token": round(1000 / result.decode_tok_s, 3) if result.decode_tok_s else None,
            "prefill_tok_s": round(result.prefill_tok_s, 1),
            "syncs_per_token": round(result.stats["syncs_per_token"], 2),
            "launches_per_token": round(result.stats["launches_per_token"], 1)}


def step_ms(engine: Engine, batch: int, steps: int) -> float:
    """Median ms of one decode step of `batch` sessions (each prefilled with 8 tokens)."""
    sessions = [engine.new_session(max_seq_len=64) for _ in range(batch)]
    for i, s in enumerate(sessions):
        s.prefill([1 + i, 2, 3, 4, 5, 6, 7, 8])
    engine.decode_batch([(s, 9) for s in sessions])     # warm-up (launch lists, plans)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        engine.decode_batch([(s, 10 + step) for s in sessions])
        times.append(time.perf_counter() - start)
    for s in sessions:
        s.close()
    return float(np.median(times)) * 1e3


def compare_modes(weights, new_tokens: int) -> list[dict]:
    rows = []
    # (label, device, mode, environment, CUDA graphs, greedy steps chained on the device)
    runs = [("cpu", "cpu", "cpu", {}, True, False), ("gated (calibrated)", "cuda", "gated", {}, True, False),
            ("gated KESTREL_MINFLOP=1e7", "cuda", "gated", {"KESTREL_MINFLOP": "1e7"}, True, False),
            ("gpu, no graphs", "cuda", "gpu", {}, False, False), ("gpu, graphs", "cuda", "gpu", {}, True, False),
            ("gpu, graphs, chained greedy", "cuda", "gpu", {}, True, True)]
    for label, device, mode, env, graphs, chained in runs:
        os.environ.update(env)
        try:
            engine = Engine(weights, device=device, mode=mode, max_seq_len=512, max_batch=32)
            engine.chain_greedy = chained
            if not graphs:
                engine.executor.use_graphs = False
            row = {"mode": label, **decode_rate(engine, 8 if device == "cpu" else new_tokens)}
            engine.close()
        finally:
            for key in env:
                os.environ.pop(key)
        print(row, flush=True)
        rows.append(row)
    return rows


def search_groups(weights, steps: int) -> tuple[list[dict], dict]:
    engine = Engine(weights, device="cuda", mode="gated", max_seq_len=64, max_batch=32)
    hybrid, profile = engine.executor, engine.executor.profile
    gate = {m: hybrid.plan(m).groups_on_gpu() for m in (1, 32)}
    rows = []
    for bits in itertools.product((False, True), repeat=len(scheduler.PROJECTION_GROUPS)):
        choice = dict(zip(scheduler.PROJECTION_GROUPS, bits))
        hybrid.set_group_choice(choice)
        row = {"gpu_groups": "+".join(g for g in choice if choice[g]) or "(none)"}
        for m in (1, 32):
            row[f"M{m}_ms"] = round(step_ms(engine, m, steps), 3)
            row[f"M{m}_predicted_ms"] = round(hybrid.plan(m).predicted_step_us(profile) / 1e3, 3)
        rows.append(row)
        print(row, flush=True)
    hybrid.set_group_choice(None)
    summary = {}
    for m in (1, 32):
        best = min(rows, key=lambda r: r[f"M{m}_ms"])
        label = "+".join(g for g in gate[m] if gate[m][g]) or "(none)"
        gate_row = next(r for r in rows if r["gpu_groups"] == label)
        summary[m] = {"gate_choice": label, "gate_ms": gate_row[f"M{m}_ms"], "best_choice": best["gpu_groups"],
                      "best_ms": best[f"M{m}_ms"], "gate_over_best": round(gate_row[f"M{m}_ms"] / best[f"M{m}_ms"], 3)}
    summary["profile"] = profile.to_dict()
    engine.close()
    return rows, summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--search-steps", type=int, default=5)
    parser.add_argument("--skip-search", action="store_true")
    parser.add_argument("--search-only", action="store_true", help="only part 2, the gate against every choice")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    weights = random_q8_weights(args.preset)
    env = environment()
    from kestrel_stream.cuda import driver
    env["machine"] = driver.detect() if driver.gpu_available() else env["machine"]
    if not args.search_only:
        mode_rows = compare_modes(weights, args.new_tokens)
        write_results(f"modes-{args.preset}", env, mode_rows,
                      ["mode", "decode_tok_s", "ms_per_token", "prefill_tok_s", "syncs_per_token",
                       "launches_per_token"],
                      notes=f"batch 1, preset {args.preset}, random Q8_0 weights, generate() of {args.new_tokens} "
                            "tokens after a 16-token prompt (greedy; in gpu mode the argmax runs on the device); "
                            "target: gpu >= 800 tok/s (llama.cpp: 541 tok/s on this shape and machine).",
                      out_dir=args.out)
    if args.skip_search:
        return
    search_rows, summary = search_groups(weights, args.search_steps)
    notes = "\n".join(f"- M={m}: gate chose {s['gate_choice']} = {s['gate_ms']} ms; best {s['best_choice']} = "
                      f"{s['best_ms']} ms; gate/best = {s['gate_over_best']} (target <= 1.05)"
                      for m, s in summary.items() if m != "profile")
    notes += f"\n- calibrated profile: {summary['profile']}"
    path = write_results(f"gate-search-{args.preset}", env, search_rows,
                         ["gpu_groups", "M1_ms", "M1_predicted_ms", "M32_ms", "M32_predicted_ms"],
                         notes=notes, out_dir=args.out)
    print(notes)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
