"""A mixture-of-experts model in mode offload beside llama.cpp with its experts on the CPU, in one run.

    python3 -m bench.make_gguf --preset qwen3-30b-a3b --mix q8_0 --vocab PATH/ggml-vocab-qwen2.gguf -o /tmp/q30a3b.gguf
    python3 -m bench.moe_offload /tmp/q30a3b.gguf [--budgets attention 0.5] [--threads 16] [--sessions 16]
        [--llama-bench PATH/llama-bench] [--llama-batched-bench PATH/llama-batched-bench] [--ncmoe 48] [--out DIR]

Per file and budget: ours loads the file in mode offload with a --vram-budget whose weight part is every
non-expert weight ("attention": each layer's qkv and o, lm_head; llama.cpp's -ngl 99 --n-cpu-moe 48) or a
fraction of it (some layers' qkv and o then stream or run on the host), on top of mode offload's KV pool
(one session of --max-seq-len) and activations; the routers and experts run on the host (the native host
kernels, --threads).  It measures greedy decode after one token (medians of --repeats after a warm-up), a
--prompt-token prefill (logits of the last row) and, with --sessions S, S sessions decoding together.  Beside
each row: the placement (A: qkv and o resident, the MLP on the host; M: qkv and o streamed; H: all on the
host), the predicted step, the roofline (scheduler/offload.py: the experts a step is expected to read, and
any other non-resident bytes, at the host memory pool's best rate, plus the resident GPU time) and the
measured step as a fraction of it.  The pool figures come from `calibrate` forced at the start.
llama.cpp: `llama-bench -m FILE -ngl 99 -ncmoe N -t T -p PROMPT -n NEW -r 3` for each N of --ncmoe, and
`llama-batched-bench -ngl 99 -ncmoe N -npp 32 -ntg 32 -npl S` where given.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time

import numpy as np

import kestrel_stream as ks
from kestrel_stream.cli.bench import environment
from kestrel_stream.cli.plan import read_config

from .offload import batch_rate, decode_rate
from .report import write_results


def non_expert_bytes(config) -> int:
    """VRAM of every weight but the routers and experts: each layer's projections and lm_head."""
    from scheduler import offload
    per_layer, _, head_bytes = offload._layer_items(config)
    return sum(sum(groups.values()) for groups in per_layer) + head_bytes


def offload_budget(config, weight_bytes: int, max_seq_len: int, max_batch: int, profile) -> int:
    """The --vram-budget leaving `weight_bytes` for weights after mode offload's KV pool and activations."""
    from kestrel_stream.run.device.budget import ALIGN, plan_offload_memory, weight_items
    from kestrel_stream.run.step_executor import DEFAULTS
    needs = plan_offload_memory(config, budget_bytes=1 << 50, free_bytes=1 << 51, profile=profile,
                                max_tokens=max(max_batch, DEFAULTS[False][2]), max_sessions=256,
                                max_seq_len=max_seq_len, attention_splits=16, max_batch=max_batch).needs
    return needs.total + 2 * ALIGN * (len(weight_items(config)) + 8) + weight_bytes


def prefill_rate(engine, tokens: int, repeats: int) -> float:
    """Median tokens/s of a `tokens`-token prefill (the last row's logits), after a warm-up."""
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(0, engine.config.vocab_size, tokens)]
    rates = []
    for r in range(repeats + 1):
        with engine.new_session() as s:
            t0 = time.perf_counter()
            s.prefill(prompt, logits="last")
            elapsed = time.perf_counter() - t0
        if r:
            rates.append(tokens / elapsed)
    return float(np.median(rates))


def llama_bench(binary: str, path: str, ncmoe: int, threads: int, prompt: int, new_tokens: int) -> tuple[float, float]:
    """(pp tok/s, tg tok/s) of llama-bench -ngl 99 -ncmoe N."""
    out = subprocess.run([binary, "-m", path, "-ngl", "99", "-ncmoe", str(ncmoe), "-t", str(threads), "-p",
                          str(prompt), "-n", str(new_tokens), "-r", "3", "-o", "json"],
                         capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    pp = next(float(r["avg_ts"]) for r in rows if r["n_prompt"] and not r["n_gen"])
    tg = next(float(r["avg_ts"]) for r in rows if r["n_gen"] and not r["n_prompt"])
    return round(pp, 1), round(tg, 2)


def llama_batched(binary: str, path: str, ncmoe: int, threads: int, sessions: int) -> float:
    out = subprocess.run([binary, "-m", path, "-ngl", "99", "-ncmoe", str(ncmoe), "-t", str(threads),
                          "-c", str(sessions * 80), "-npp", "32", "-ntg", "32", "-npl", str(sessions)],
                         capture_output=True, text=True, check=True)
    rows = [line for line in out.stdout.splitlines() if line.strip().startswith("|") and re.search(r"\d", line)]
    cells = [c.strip() for c in rows[-1].strip("|").split("|")]
    return float(cells[7])          # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | ...


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--budgets", nargs="*", default=["attention"],
                        help="'attention' (every non-expert weight resident) or a fraction of it; none: llama.cpp "
                             "alone")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--max-batch", type=int, default=32, help="tokens of a step: max(this, 64)")
    parser.add_argument("--sessions", type=int, default=0)
    parser.add_argument("--ncmoe", type=int, nargs="+", default=[],
                        help="llama.cpp's layers with experts on the CPU (default: every layer)")
    parser.add_argument("--llama-bench", default=None)
    parser.add_argument("--llama-batched-bench", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from scheduler.offload import HOME_LETTERS, PoolRates
    from .offload import measured_pool
    profile, pool = measured_pool(args.threads)
    rows = []
    for path in args.files:
        config = read_config(path)
        for which in args.budgets:
            fraction = 1.0 if which == "attention" else float(which)
            weight_bytes = int(fraction * non_expert_bytes(config))
            budget = offload_budget(config, weight_bytes, args.max_seq_len, args.max_batch, profile)
            engine = ks.load(path, mode="offload", vram_budget=budget, max_seq_len=args.max_seq_len,
                             max_batch=args.max_batch, cpu_threads=args.threads)
            p = engine.executor.placement
            rate, step_ms = decode_rate(engine, args.new_tokens, args.repeats)
            row = {"file": os.path.basename(path), "budget": which, "weight_MB": round(weight_bytes / 1e6, 1),
                   "budget_MB": round(budget / 1e6, 1),
                   "placement": "".join(HOME_LETTERS[h] for h in p.homes) + f" head {p.head}",
                   "ours_tg_tok_s": round(rate, 2), "step_ms": round(step_ms, 2),
                   "predicted_ms": round(p.predicted.total_us / 1e3, 2), "roofline_ms": round(p.roofline_us / 1e3, 2),
                   "of_roofline": round(p.roofline_us / 1e3 / step_ms, 3),
                   "experts_read_MB": round(p.routed_read_bytes / 1e6, 1),
                   "host_roofline_tok_s": round(1e6 / PoolRates.of(profile).best_us(p.routed_read_bytes), 1),
                   "ours_pp_tok_s": round(prefill_rate(engine, args.prompt, 1), 1)}
            if args.sessions:
                row["ours_batch_tok_s"] = round(batch_rate(engine, args.sessions, 32), 1)
            engine.close()
            print(row, flush=True)
            rows.append(row)
        for ncmoe in (args.ncmoe or [config.num_hidden_layers]) if args.llama_bench else []:
            pp, tg = llama_bench(args.llama_bench, path, ncmoe, args.threads, args.prompt, args.new_tokens)
            row = {"file": os.path.basename(path), "budget": f"llama.cpp -ngl 99 -ncmoe {ncmoe}",
                   "llama_pp_tok_s": pp, "llama_tg_tok_s": tg}
            if args.sessions and args.llama_batched_bench:
                row["llama_batch_tok_s"] = llama_batched(args.llama_batched_bench, path, ncmoe, args.threads,
                                                         args.sessions)
            print(row, flush=True)
            rows.append(row)
    columns = ["file", "budget", "weight_MB", "budget_MB", "placement", "ours_tg_tok_s", "llama_tg_tok_s",
               "ours_pp_tok_s", "llama_pp_tok_s", "ours_batch_tok_s", "llama_batch_tok_s", "step_ms", "predicted_ms",
               "roofline_ms", "of_roofline", "experts_read_MB", "host_roofline_tok_s"]
    out = write_results("moe-offload", environment(), rows, [c for c in columns if any(c in r for r in rows)],
                        out_dir=args.out,
                        notes=(f"host memory pool (calibrate, this run): {pool}. Ours: mode offload, the routers and "
                               f"experts on the host ({args.threads} threads); {args.new_tokens} greedy tokens after "
                               f"one, medians of {args.repeats}; pp: a {args.prompt}-token prompt in steps of "
                               f"{max(args.max_batch, 64)} tokens. llama-bench -r 3 averages."))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
