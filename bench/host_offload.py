"""The host side of every offload beside llama.cpp on the same files: the CPU engine's decode (tg) and
64-token prefill (pp64), and `--mode layers=N` and `layers=N-1+head` decode, against `llama-bench -ngl 0` /
`-ngl N` with the same threads, in one run.  llama.cpp's -ngl N counts its output layer as one of the N: on
a 28-layer model -ngl 14 holds 13 layers and the output (lm_head, 330 MB of the 1.7B's Q8_0 file) in VRAM,
which is layers=13+head here; layers=14 holds 14 layers and leaves the output on the host (less VRAM, more
host bytes a token).

    python3 -m bench.host_offload FILE.gguf [FILE2.gguf ...] [--threads 16] [--layers 14]
        [--llama-bench PATH/llama-bench] [--blas-threads N] [--ops] [--out DIR]
    python3 -m bench.host_offload FILE.gguf --base TREE [--tree TREE] [--rounds 5] [--threads 2]
        [--llama-bench PATH/llama-bench] [--llama-prompt 0]

Ours: ks.load(FILE, device="cpu", cpu_threads=T) (and device="cuda", mode="layers=N"); a session decodes
--new-tokens tokens after one token (llama-bench's tg from an empty context) and prefills --prompt tokens in
one step (pp), medians of --repeats after a warm-up; each row's weights in VRAM, ours (the device cache) and
llama.cpp's (-ngl N: N-1 layers and the output layer).  llama.cpp: `llama-bench -m FILE -ngl 0|N -t T -p 64
-n 32 -r 3 -o json` (avg_ts).  --ops: also the CPU engine's decode step op by op, native and numpy
(bench/host_step.py's table, written beside).  --blas-threads: numpy's BLAS threads in ours (ks.load's
blas_threads; default: its policy, 1 on the CPU engine over the native kernels, --threads in layers=N).

--base TREE: the CPU engine's rows A/B, this tree's (or --tree's: a `git archive` copy pins what runs)
against TREE's, beside llama-bench: each of --rounds runs both trees' `ours` in fresh processes started
in / (neither tree shadows the other; the order alternating round by round), then llama-bench
(-p --llama-prompt: 0 for its decode alone); medians of the rounds, and every round's figure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import kestrel_stream as ks
from kestrel_stream.cli.bench import environment
from kestrel_stream.run.blas_threads import cpu_threads_now

from . import host_step
from .offload import weight_budget_of
from .report import write_results


def ours(path: str, device: str, mode: str, threads: int, prompt: int, new_tokens: int, repeats: int,
         blas_threads: int | None = None) -> dict:
    engine = ks.load(path, device=device, mode=mode, cpu_threads=threads, max_seq_len=max(prompt, new_tokens) + 8,
                     blas_threads=blas_threads)
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(0, engine.config.vocab_size, prompt)]
    decode, prefill = [], []
    for r in range(repeats + 1):                     # the first round warms the caches and is left out
        s = engine.new_session()
        t0 = time.perf_counter()
        s.prefill(ids, logits="last")
        pp = time.perf_counter() - t0
        s.reset()
        token = s.decode_greedy(1)
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            token = s.decode_greedy(token)
        tg = time.perf_counter() - t0
        s.close()
        if r:
            prefill.append(prompt / pp)
            decode.append(new_tokens / tg)
    backend = engine.executor.backend
    vram = backend.window.resident_bytes if backend is not None else 0
    engine.close()
    return {"pp_tok_s": round(statistics.median(prefill), 2), "tg_tok_s": round(statistics.median(decode), 2),
            "vram_MB": round(vram / 1e6, 1)}


def llama(binary: str, path: str, layers: int, threads: int, prompt: int, new_tokens: int) -> dict:
    out = subprocess.run([binary, "-m", path, "-ngl", str(layers), "-t", str(threads), "-p", str(prompt),
                          "-n", str(new_tokens), "-r", "3", "-o", "json"], capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    result = {}
    for row in rows:
        key = "pp_tok_s" if row.get("n_prompt") else "tg_tok_s"
        result[key] = round(float(row["avg_ts"]), 2)
    return result


def ours_in(tree: str, path: str, threads: int, prompt: int, new_tokens: int, repeats: int,
            blas_threads: int | None) -> dict:
    """`ours` in cpu mode as the source tree `tree` runs it, in a fresh process started in /."""
    code = ("import json; from bench.host_offload import ours; "
            f"print(json.dumps(ours({path!r}, 'cpu', 'cpu', {threads}, {prompt}, {new_tokens}, {repeats}, "
            f"{blas_threads!r})))")
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=tree), cwd="/",
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def ab_rows(args) -> list[dict]:
    """--base: per file, this tree (--tree) against --base in alternating fresh processes, and llama-bench."""
    trees = {"new": args.tree or str(Path(__file__).resolve().parents[1]), "base": args.base}
    rows = []
    for path in args.files:
        runs: dict[str, list] = {"new": [], "base": [], "llama": []}
        for r in range(args.rounds):
            for name in ("new", "base") if r % 2 == 0 else ("base", "new"):
                runs[name].append(ours_in(trees[name], path, args.threads, args.prompt, args.new_tokens, args.repeats,
                                          args.blas_threads))
            if args.llama_bench:
                runs["llama"].append(llama(args.llama_bench, path, 0, args.threads, args.llama_prompt, args.new_tokens))
            print(path, r, {name: got[-1] for name, got in runs.items() if got}, flush=True)
        row = {"file": path.rsplit("/", 1)[-1], "threads": args.threads, "rounds": args.rounds}
        for name, got in runs.items():
            for key in ("pp_tok_s", "tg_tok_s"):
                values = [g[key] for g in got if key in g]
                if values:
                    row[f"{name}_{key}"] = round(statistics.median(values), 2)
                    row[f"{name}_{key}_runs"] = values
        row["new/base_tg"] = round(row["new_tg_tok_s"] / row["base_tg_tok_s"], 3)
        if "llama_tg_tok_s" in row:
            row["new/llama_tg"] = round(row["new_tg_tok_s"] / row["llama_tg_tok_s"], 3)
        rows.append(row)
    return rows


def main_ab(args) -> None:
    rows = ab_rows(args)
    columns = ["file", "threads", "rounds", "base_tg_tok_s", "new_tg_tok_s", "llama_tg_tok_s", "new/base_tg",
               "new/llama_tg", "base_pp_tok_s", "new_pp_tok_s"]
    path = write_results("host-offload-ab", environment(), rows, [c for c in columns if any(c in r for r in rows)],
                         out_dir=args.out,
                         notes=f"new: {args.tree or 'this tree'}; base: {args.base}. tg: {args.new_tokens} greedy "
                               f"tokens after a {args.prompt}-token prefill (pp), ours medians of {args.repeats} after "
                               f"a warm-up a process; llama-bench -p {args.llama_prompt} -n {args.new_tokens} -r 3; "
                               f"medians of {args.rounds} rounds (the JSON beside has every round's).")
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=14, help="layers on the GPU for the layers=N rows")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench built on this machine")
    parser.add_argument("--no-gpu", action="store_true", help="only the CPU rows")
    parser.add_argument("--blas-threads", type=int, default=None,
                        help="numpy's BLAS threads in ours (default: ks.load's policy: 1 on the CPU engine over the "
                             "native kernels, else --threads); a token tree's attention runs in numpy, and idle "
                             "BLAS workers spin on the cores the host kernels use")
    parser.add_argument("--ops", action="store_true", help="also the host decode step op by op (bench.host_step)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--base", default=None, help="a source tree: the CPU rows A/B against it (see above)")
    parser.add_argument("--tree", default=None, help="with --base: the tree of the new side (default: this one)")
    parser.add_argument("--rounds", type=int, default=5, help="with --base: alternating rounds")
    parser.add_argument("--llama-prompt", type=int, default=0, help="with --base: llama-bench's -p")
    args = parser.parse_args()
    if args.base:
        main_ab(args)
        return
    rows = []
    configs = [("cpu", "cpu", 0)] + ([] if args.no_gpu else [("cuda", f"layers={args.layers}", args.layers)])
    if not args.no_gpu and args.layers >= 1:     # llama.cpp's -ngl N: N-1 layers and its output layer
        configs.append(("cuda", f"layers={args.layers - 1}+head", args.layers))
    for path in args.files:
        for device, mode, ngl in configs:
            row = {"file": path.rsplit("/", 1)[-1], "ours": f"{device} {mode}", "llama.cpp": f"-ngl {ngl}",
                   "threads": args.threads}
            mine = ours(path, device, mode, args.threads, args.prompt, args.new_tokens, args.repeats, args.blas_threads)
            row["blas_threads"] = max(cpu_threads_now(), default=None)
            row.update({f"ours_{k}": v for k, v in mine.items()})
            if args.llama_bench:
                theirs = llama(args.llama_bench, path, ngl, args.threads, args.prompt, args.new_tokens)
                theirs["vram_MB"] = round(weight_budget_of(path, ngl)[0] / 1e6, 1)
                row.update({f"llama_{k}": v for k, v in theirs.items()})
                for k in ("pp_tok_s", "tg_tok_s"):
                    if k in theirs:
                        row[f"ratio_{k.split('_')[0]}"] = round(mine[k] / theirs[k], 3)
            print(row, flush=True)
            rows.append(row)
    columns = ["file", "ours", "llama.cpp", "threads", "blas_threads", "ours_vram_MB", "llama_vram_MB", "ours_pp_tok_s",
               "llama_pp_tok_s", "ratio_pp", "ours_tg_tok_s", "llama_tg_tok_s", "ratio_tg"]
    path = write_results("host-offload", environment(), rows, [c for c in columns if any(c in r for r in rows)],
                         out_dir=args.out,
                         notes=f"pp: one step of {args.prompt} tokens; tg: {args.new_tokens} greedy tokens after one; "
                               f"ours medians of {args.repeats} after a warm-up, llama-bench -r 3 averages.")
    print(f"wrote {path}")
    if args.ops:
        host_step.main_for(args.files, args.threads, args.out)


if __name__ == "__main__":
    main()
