"""Where a mixture-of-experts model's decode token goes: a few traced decode steps per budget, the trace's GPU
slices (kernels, copies) and host spans summed by name, per token and per call.

    KESTREL_PDL=0 python3 -m bench.moe_trace FILE.gguf [--budgets all experts:0.1] [--steps 6] [--threads 16]
                                             [--out DIR]

`all`: gpu mode with every expert in VRAM, its steps launched eagerly (no graph), so each kernel is timed
alone between two events (with KESTREL_PDL=0 no kernel overlaps the next; with programmatic launch a kernel's
span includes its wait for the one before).  `experts:F`: mode offload as bench.moe_offload builds it (a
traced mixed step runs segment by segment, op by op).  Tracing adds host time to every launch: the per-call
GPU figures are what to read, the host spans only relative to each other.  --out keeps each trace
(`trace-<budget>.json.gz`, for the timeline tool) and the tables as JSON.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import types
from pathlib import Path

import numpy as np

from .moe_offload import budget_of, engine_for

WARM_STEPS = 4


def summed(trace_path: Path, steps: int) -> dict[str, list[dict]]:
    """{"gpu": rows, "host": rows} of a trace: per name (and category) the calls and µs a token and µs a call,
    largest first."""
    events = json.load(gzip.open(trace_path) if str(trace_path).endswith(".gz") else open(trace_path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    totals = {"gpu": collections.defaultdict(lambda: [0, 0.0]), "host": collections.defaultdict(lambda: [0, 0.0])}
    for e in events:
        if e.get("ph") == "X":
            side = totals["gpu" if e["pid"] >= 100 else "host"][(e.get("cat", ""), e["name"])]
            side[0] += 1
            side[1] += e.get("dur", 0.0)
    return {side: [{"cat": cat, "name": name, "calls_a_token": round(n / steps, 2), "us_a_token": round(us / steps, 1),
                    "us_a_call": round(us / max(n, 1), 2)}
                   for (cat, name), (n, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])]
            for side, rows in totals.items()}


def traced(weights, which: str, args, out: Path) -> Path:
    from kestrel_stream.obs import trace
    budget, _ = budget_of(which, weights.config, args, None)
    engine = engine_for(weights, which, budget, args)
    if which == "all":
        engine.executor.steps.use_graphs = False        # each kernel launched, and timed, alone
    try:
        with engine.new_session() as s:
            token = int(np.argmax(s.prefill(list(range(1, 17)))[-1]))
            for _ in range(WARM_STEPS):                  # launch lists, plans, the first graphs of a mixed step
                token = int(np.argmax(s.decode(token)))
            trace.start(out / f"trace-{which.replace(':', '')}.json.gz", budget=which)
            try:
                for _ in range(args.steps):
                    token = int(np.argmax(s.decode(token)))
            finally:
                path = trace.stop()
    finally:
        engine.close()
    return path


def main(argv=None) -> dict:
    import tempfile
    from kestrel_stream.loading.loader import load_weights
    from kestrel_stream.run.blas_threads import set_cpu_threads
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--budgets", nargs="+", default=["all"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=16, help="rows of each table printed")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    set_cpu_threads(args.threads)
    engine_args = types.SimpleNamespace(threads=args.threads, max_seq_len=args.max_seq_len, max_batch=32,
                                        stream_chunk=512, steps=args.steps)
    weights = load_weights(args.file)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    tables = {}
    for which in args.budgets:
        tables[which] = summed(traced(weights, which, engine_args, out), args.steps)
        for side, rows in tables[which].items():
            print(f"== {which}, {side}: {sum(r['us_a_token'] for r in rows):.1f} µs a token")
            for r in rows[:args.rows]:
                print(f"   {r['cat']:8s} {r['name'][:56]:56s} {r['calls_a_token']:7.1f} a token "
                      f"{r['us_a_token']:9.1f} µs a token {r['us_a_call']:8.2f} µs a call")
    if args.out:
        (out / "moe-trace.json").write_text(json.dumps(tables, indent=1))
    return tables


if __name__ == "__main__":
    main()
