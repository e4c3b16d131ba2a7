"""The CPU engine's batch-1 decode step, op by op: where a host step's time goes, native and numpy.

    python3 -m bench.host_step FILE.gguf|MODEL_DIR [...] [--threads 16] [--context 32] [--steps 32] [--out DIR]

Per file and host kernels (native, numpy): a session prefills --context tokens, then
- per op kind, the microseconds per token of its calls through the host program one by one (HostProgram
  over a HostState: a call per op, as a traced step or a mixed-mode host segment runs them), and their sum;
- the whole step as the engine runs it (HostBackend.forward: with native kernels one library call per step,
  native_program.py), ms per token and tok/s;
medians of --repeats rounds of --steps decode steps each, after a warm-up round.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import numpy as np

from kestrel_stream.cli.bench import environment
from kestrel_stream.loading.loader import load_weights
from kestrel_stream.options import Options
from kestrel_stream.run.host import HostBackend
from kestrel_stream.run.host.backend import session_runs
from kestrel_stream.run.host.program import HostState

from .report import write_results

KINDS = ("embed", "qkv", "rope", "attention", "o", "gate_up", "down", "lm_head")


def per_op_round(backend, program, kv, start: int, steps: int) -> dict:
    """Seconds per op kind over `steps` decode steps from position `start`, one call per op."""
    spent = defaultdict(float)
    for i in range(steps):
        ids, positions, runs = session_runs([(kv, np.array([7]), start + i)])
        cos, sin = backend.rope(positions)
        state = HostState(ids, runs, cos, sin, np.array([0]))
        for op, call in zip(program.ops, program.calls):
            t0 = time.perf_counter()
            call(state)
            spent[op.group or op.kind] += time.perf_counter() - t0
    return spent


def whole_round(backend, kv, start: int, steps: int) -> float:
    """Seconds of `steps` decode steps as the engine runs them."""
    t0 = time.perf_counter()
    for i in range(steps):
        backend.forward([(kv, np.array([7]), start + i)], "last")
    return time.perf_counter() - t0


def breakdown(weights, kernels: str, threads: int, context: int, steps: int, repeats: int) -> dict:
    options = Options.from_env().with_(host_kernels=kernels, host_threads=threads)
    backend = HostBackend(weights, options=options)
    program = backend.program(backend.plan(1).segments[0].ops)
    kv = backend.alloc_kv(context + steps + 1)
    backend.forward([(kv, np.arange(1, context + 1), 0)], "last")
    ops, whole = defaultdict(list), []
    for r in range(repeats + 1):                 # round 0 warms the caches and is left out
        spent = per_op_round(backend, program, kv, context, steps)
        seconds = whole_round(backend, kv, context, steps)
        if r:
            for kind, s in spent.items():
                ops[kind].append(s / steps * 1e6)
            whole.append(seconds / steps * 1e3)
    row = {"kernels": "native" if backend.kernels is not None else "numpy", "threads": threads}
    for kind in KINDS:
        if kind in ops:
            row[f"{kind}_us"] = round(statistics.median(ops[kind]), 1)
    row["ops_sum_ms"] = round(sum(statistics.median(v) for v in ops.values()) / 1e3, 3)
    row["step_ms"] = round(statistics.median(whole), 3)
    row["tok_s"] = round(1e3 / row["step_ms"], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kernels", default="native,numpy")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    main_for(args.files, args.threads, args.out, args.context, args.steps, args.repeats, args.kernels.split(","))


def main_for(files, threads: int, out=None, context: int = 32, steps: int = 32, repeats: int = 3,
             kernels_list=("native", "numpy")) -> None:
    rows = []
    for path in files:
        weights = load_weights(path)
        for kernels in kernels_list:
            row = {"file": path.rstrip("/").rsplit("/", 1)[-1],
                   **breakdown(weights, kernels, threads, context, steps, repeats)}
            print(row, flush=True)
            rows.append(row)
    columns = ["file", "kernels", "threads", *[f"{k}_us" for k in KINDS], "ops_sum_ms", "step_ms", "tok_s"]
    path = write_results("host-step", environment(), rows, [c for c in columns if any(c in r for r in rows)],
                         out_dir=out,
                         notes=f"Batch-1 decode after {context} tokens. *_us: microseconds per token of each "
                               f"op kind called one by one (HostProgram); ops_sum_ms: their sum; step_ms: the step "
                               f"as the engine runs it (native: one library call a step). Medians of "
                               f"{repeats} rounds of {steps} steps.")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
