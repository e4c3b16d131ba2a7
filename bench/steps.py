"""The cost of a step of k tokens on one session in `gpu` mode, for any GGUF file; pp512 / pp2048 beside
llama-bench's.

    PYTHONPATH=. python3 -m bench.steps F.gguf [F2.gguf ...] [--tokens 1,2,4,8,11,12,16,32,64,128,512]
        [--logits last,all,argmax] [--repeats 5] [--context 40] [--pp 512,2048] [--llama-bench PATH]
        [--block-mma-min-tokens N] [--cublas-min-tokens N] [--step-graphs 0,1]
        [--hmma-layouts default|pipelined|half] [--out DIR]

Step rows: one session holds `--context` tokens; each step prefills k more (Session.prefill with
logits="last" or "all") and is truncated back, the median wall time of `--repeats` after one warm-up,
in ms, and each k's time over the one-token step's (x1), with whether issue 39's bar holds (x1 <= 1.3 up
to 16 tokens, <= 2 up to 64, no k costing more than a larger one: `bar`).  pp rows: a fresh session prefills N tokens
(logits="last"), tok/s of the best of --repeats, as llama-bench's pp<N> (its mean of -r 3 after a
warm-up).  --llama-bench PATH runs `PATH -m F -ngl 99 -p 512,2048 -n 0 -r 3 -o json` on each file and
adds its tok/s and our ratio.  --block-mma-min-tokens sets KESTREL_BLOCK_MMA_MIN_TOKENS (the 4/6-bit
steps that take the tensor-core GEMM instead of the GEMV), to compare the two at 2..8 tokens.
--cublas-min-tokens sets KESTREL_CUBLAS_MIN_TOKENS (the steps whose projections run on cuBLAS, expanded to
fp16: default scheduler.dense.default_min_tokens; 0: never, so a 4/6-bit file keeps its int8 kernels), to
find the switch point (scheduler.dense.BLOCK_DENSE_MIN_TOKENS for a 4/6-bit file).
--step-graphs 0,1 measures every step row with one session's steps of up to 64 tokens launched eagerly (0)
and replaying their bucket's graph (1: run/device/step_graphs.py), one row each, on the same engine
(KESTREL_STEP_GRAPHS sets the default).  --hmma-layouts takes the tensor-core GEMVs' pipelined layouts
(bench/hmma_layouts.py) in place of the defaults, for an A/B of the layouts in whole steps.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from kestrel_stream.cli.bench import environment

from . import hmma_layouts
from .report import write_results

DEFAULT_TOKENS = "1,2,4,8,11,12,16,32,64,128,512"


def step_ms(session, ids: np.ndarray, logits: str, repeats: int) -> float:
    """Median wall ms of prefilling `ids` onto the session's context, the session truncated back after each."""
    base = session.position
    times = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        session.prefill(ids, logits=logits)
        elapsed = time.perf_counter() - started
        session.truncate(base)
        if i:                                   # the first: the warm-up
            times.append(elapsed * 1e3)
    return statistics.median(times)


def pp_tok_s(engine, ids: np.ndarray, repeats: int) -> float:
    """Best tok/s of a fresh session prefilling `ids` (logits of the last row only), after a warm-up."""
    best = 0.0
    for i in range(repeats + 1):
        session = engine.new_session()
        started = time.perf_counter()
        session.prefill(ids, logits="last")
        elapsed = time.perf_counter() - started
        session.close()
        if i:
            best = max(best, len(ids) / elapsed)
    return best


def llama_bench(path: str, model: str, pp: list[int]) -> dict[int, float]:
    """llama-bench's pp<N> tok/s (its avg_ts) for each N of `pp` on `model`, all layers on the GPU."""
    command = [path, "-m", model, "-ngl", "99", "-p", ",".join(map(str, pp)), "-n", "0", "-r", "3", "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return {int(r["n_prompt"]): float(r["avg_ts"]) for r in json.loads(done.stdout) if int(r.get("n_gen", 0)) == 0}


def bar(ratios: dict[int, float]) -> str:
    """Issue 39's bar over {k: the k-token step over the one-token step}: "met", or what misses it."""
    misses = [f"{k}: {r}x" for k, r in ratios.items() if (k <= 16 and r > 1.3) or (k <= 64 and r > 2)]
    sizes = sorted(ratios)
    misses += [f"{a} > {b}" for a, b in zip(sizes, sizes[1:]) if ratios[a] > ratios[b]]
    return "met" if not misses else "missed (" + ", ".join(misses) + ")"


def bench_file(model: str, args) -> tuple[list[dict], list[dict]]:
    import kestrel_stream as ks
    tokens = [int(n) for n in args.tokens.split(",") if n]
    pp = [int(n) for n in args.pp.split(",") if n]
    longest = max(tokens + pp) + args.context + 1
    engine = ks.load(model, device="cuda", mode="gpu", max_seq_len=longest, max_batch=8)
    try:
        rng = np.random.default_rng(0)
        high = min(engine.weights.config.vocab_size, 32000)
        name = Path(model).name
        step_rows = []
        session = engine.new_session()
        session.prefill(rng.integers(0, high, args.context), logits="last")
        graphs = engine.executor.steps.step_graphs
        settings = [graphs.enabled] if args.step_graphs is None else [v == "1" for v in args.step_graphs.split(",")]
        for logits in args.logits.split(","):
            for enabled in settings:
                graphs.enabled = enabled
                row = {"file": name, "logits": logits, "step_graphs": int(enabled)}
                for k in tokens:
                    row[str(k)] = round(step_ms(session, rng.integers(0, high, k), logits, args.repeats), 3)
                one = row[str(tokens[0])]
                ratios = {k: round(row[str(k)] / one, 2) for k in tokens}
                step_rows.append(row)
                step_rows.append({"file": name, "logits": f"{logits} (x {tokens[0]}-token step)",
                                  "step_graphs": int(enabled), **{str(k): r for k, r in ratios.items()},
                                  "bar": bar(ratios)})
        graphs.enabled = settings[-1]
        session.close()
        pp_rows = []
        theirs = llama_bench(args.llama_bench, model, pp) if args.llama_bench else {}
        for n in pp:
            ours = pp_tok_s(engine, rng.integers(0, high, n), args.repeats)
            row = {"file": name, "test": f"pp{n}", "tok_s": round(ours, 1)}
            if n in theirs:
                row.update(llama_bench_tok_s=round(theirs[n], 1), ratio=round(ours / theirs[n], 2))
            pp_rows.append(row)
        return step_rows, pp_rows
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="+", help="GGUF files")
    parser.add_argument("--tokens", default=DEFAULT_TOKENS, help="step sizes, comma-separated (the first: the x1)")
    parser.add_argument("--logits", default="last,all", help='"last", "all", "argmax", comma-separated')
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=40, help="tokens the session holds before each step")
    parser.add_argument("--pp", default="512,2048", help="prefill lengths for the pp rows ('' for none)")
    parser.add_argument("--llama-bench", default=None, help="a llama-bench binary to run beside (optional)")
    parser.add_argument("--block-mma-min-tokens", type=int, default=None,
                        help="KESTREL_BLOCK_MMA_MIN_TOKENS for this run (2..9)")
    parser.add_argument("--cublas-min-tokens", type=int, default=None,
                        help="KESTREL_CUBLAS_MIN_TOKENS for this run (0: no cuBLAS)")
    parser.add_argument("--step-graphs", default=None, choices=("0", "1", "0,1", "1,0"), metavar="0|1|0,1",
                        help="one session's steps of up to 64 tokens eager (0) or as graphs (1): a row each")
    parser.add_argument("--hmma-layouts", default="default", choices=hmma_layouts.MODES,
                        help="the tensor-core GEMVs' layouts: the defaults or their pipelined forms")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    hmma_layouts.apply(args.hmma_layouts)
    if args.block_mma_min_tokens is not None:      # read once, when the engine's options are built
        os.environ["KESTREL_BLOCK_MMA_MIN_TOKENS"] = str(args.block_mma_min_tokens)
    if args.cublas_min_tokens is not None:
        os.environ["KESTREL_CUBLAS_MIN_TOKENS"] = str(args.cublas_min_tokens)
    tokens = [n for n in args.tokens.split(",") if n]
    step_rows, pp_rows = [], []
    for model in args.models:
        steps, pps = bench_file(model, args)
        step_rows += steps
        pp_rows += pps
    env = environment()
    notes = (f"Step of k tokens on one session holding {args.context} tokens, ms (median of {args.repeats} "
             f"after a warm-up), and over the {tokens[0]}-token step; KESTREL_BLOCK_MMA_MIN_TOKENS="
             f"{os.environ.get('KESTREL_BLOCK_MMA_MIN_TOKENS', 'default')}; KESTREL_CUBLAS_MIN_TOKENS="
             f"{os.environ.get('KESTREL_CUBLAS_MIN_TOKENS', 'default')}; hmma layouts {args.hmma_layouts}; step_graphs 1: one session's steps of "
             "up to 64 tokens replay their bucket's graph, 0: eager launches.")
    suffix = ("" if args.block_mma_min_tokens is None else f"-mma{args.block_mma_min_tokens}") + (
        "" if args.cublas_min_tokens is None else f"-cublas{args.cublas_min_tokens}") + (
        "" if args.hmma_layouts == "default" else f"-hmma-{args.hmma_layouts}")
    path = write_results(f"steps{suffix}", env, step_rows, ["file", "logits", "step_graphs"] + tokens + ["bar"],
                         notes, args.out)
    print(path.read_text())
    if pp_rows:
        pp_path = write_results(f"steps-pp{suffix}", env, pp_rows,
                                ["file", "test", "tok_s", "llama_bench_tok_s", "ratio"],
                                "pp<N>: a fresh session prefills N tokens, logits of the last row; best of "
                                f"{args.repeats} after a warm-up.", args.out)
        print(pp_path.read_text())


if __name__ == "__main__":
    main()
