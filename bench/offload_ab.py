"""A/B of one setting in one process: mode offload with one placement, loaded once per value of a KESTREL_*
switch, greedy decodes and steps of a few tokens alternated between the engines (runs on these hosts spread
widely: the alternation is what makes two values comparable).

    python3 -m bench.offload_ab FILE.gguf --fraction 0.25 --homes HSHRSH...:resident \\
        [--switch KESTREL_RING_GRAPHS --values 1 0] [--reps 8] [--new-tokens 64] [--step-tokens 9] [--out DIR]

The VRAM budget is the one bench/offload.py gives the row of that fraction (what llama.cpp's -ngl N holds for
weights); --homes is KESTREL_OFFLOAD_HOMES (every engine runs the same placement).  Per value: the decode's
tok/s and the step's ms, median and each run, host syncs a step and graph replays; the first value's ratio over
each other one (decode tok/s, and step time the other way round).  What 2026-12-05's ring-graph A/B measured.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import kestrel_stream as ks
from kestrel_stream.cli.bench import environment

from .offload import decode_rate, offload_budget, weight_budget_of
from .report import write_results


def step_ms(engine, tokens: int, repeats: int) -> float:
    """Median ms of a fresh session's prompt of `tokens` tokens (one step), after three warm-ups."""
    times = []
    for r in range(repeats + 3):
        s = engine.new_session()
        start = time.perf_counter()
        s.prefill(list(range(100, 100 + tokens)), logits="last")
        elapsed = time.perf_counter() - start
        s.close()
        if r >= 3:
            times.append(elapsed * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python3 -m bench.offload_ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--fraction", type=float, required=True)
    parser.add_argument("--homes", required=True, help="KESTREL_OFFLOAD_HOMES: a letter a layer, [:host|:resident]")
    parser.add_argument("--switch", default="KESTREL_RING_GRAPHS")
    parser.add_argument("--values", nargs="+", default=["1", "0"])
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--step-tokens", type=int, default=9)
    parser.add_argument("--step-repeats", type=int, default=6)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not args.switch.startswith("KESTREL_") or len(args.values) < 2 or args.reps < 1:
        parser.error("--switch names a KESTREL_* setting, --values gives two or more, --reps >= 1")
    from kestrel_stream.options import Options
    from kestrel_stream.run.calibrate import calibrate
    profile = calibrate(options=Options.from_env(host_threads=args.threads))
    _, layers = weight_budget_of(args.path, 0)
    weights, _ = weight_budget_of(args.path, round(layers * args.fraction))
    budget = offload_budget(args.path, weights, args.max_seq_len, profile)
    saved = {name: os.environ.get(name) for name in ("KESTREL_OFFLOAD", "KESTREL_OFFLOAD_HOMES", args.switch)}
    engines = {}
    try:
        os.environ.update({"KESTREL_OFFLOAD": "place", "KESTREL_OFFLOAD_HOMES": args.homes})
        for value in args.values:
            os.environ[args.switch] = value
            engines[value] = ks.load(args.path, mode="offload", vram_budget=budget, max_seq_len=args.max_seq_len,
                                     cpu_threads=args.threads)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    try:
        runs = {value: {"tok_s": [], "step_ms": []} for value in engines}
        for _ in range(args.reps):
            for value, engine in engines.items():
                runs[value]["tok_s"].append(round(decode_rate(engine, args.new_tokens, 1)[0], 2))
                runs[value]["step_ms"].append(round(step_ms(engine, args.step_tokens, args.step_repeats), 2))
        first = engines[args.values[0]]
        row = {"file": os.path.basename(args.path), "homes": args.homes, "switch": args.switch,
               "predicted_ms": round(first.executor.placement.predicted.total_us / 1e3, 2),
               "predicted_step_ms": round(first.executor.placement_for(args.step_tokens).predicted.total_us / 1e3, 2),
               "roofline_ms": round(first.executor.placement.roofline_us / 1e3, 2)}
        for value, engine in engines.items():
            stats = engine.executor.stats
            row[value] = {"tok_s": statistics.median(runs[value]["tok_s"]), "tok_s_runs": runs[value]["tok_s"],
                          "step_ms": statistics.median(runs[value]["step_ms"]), "step_ms_runs": runs[value]["step_ms"],
                          "syncs_per_step": round(stats["syncs"] / max(stats["steps"], 1), 2),
                          "graph_replays": stats.get("graph_replays") or 0}
        a = row[args.values[0]]
        for value in args.values[1:]:
            row[f"decode_{args.values[0]}_over_{value}"] = round(a["tok_s"] / row[value]["tok_s"], 3)
            row[f"step_{args.values[0]}_over_{value}"] = round(row[value]["step_ms"] / a["step_ms"], 3)
    finally:
        for engine in engines.values():
            engine.close()
    print(row, flush=True)
    if args.out:
        write_results("offload-ab", environment(), [row], list(row), out_dir=args.out)
    return row


if __name__ == "__main__":
    main()
