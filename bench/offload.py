"""Mode offload beside llama.cpp at the same VRAM for weights, with this machine's host memory pool and the
roofline of each row, in one run.

    python3 -m bench.offload FILE.gguf [FILE2.gguf ...] [--fractions 0.5 0.25] [--threads 16]
        [--llama-bench PATH/llama-bench] [--sessions 16] [--out DIR]

Per file and fraction f: llama.cpp runs `llama-bench -m FILE -ngl N -t T -p 0 -n NEW -r 3` with N = f x the
layers; ours gets the weight bytes llama.cpp's -ngl N puts in VRAM (ngl_weight_bytes), on top of what mode
offload's KV pool (one session of --max-seq-len) and activations take, and decodes --new-tokens greedy tokens
after one (medians of --repeats after a warm-up). Beside each row: the placement (R resident, S streamed, H host
per layer), its predicted step time and the roofline (scheduler/offload.py: the non-resident bytes at the pool's
best rate plus the resident GPU time), the measured step as a fraction of each, and the window alone (gpu mode,
KESTREL_OFFLOAD=stream) at the same budget. The pool figures come from `calibrate` forced at the start
(measure_pool). --sessions S adds decode of S sessions at once (ours: greedy decode_batch, each session's next
token taken where lm_head ran, as the daemon's decode steps take it; with the placement of an S-token step and its
predicted time beside the measured one; the window alone under the same budget, sessions and lengths; llama.cpp:
llama-batched-bench -ngl N -npp 32 -ntg 32 -npl S when --llama-batched-bench is given).
"""
from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import re
import statistics
import subprocess
import time

import numpy as np

import kestrel_stream as ks
from kestrel_stream.errors import CapacityError
from scheduler.window import WindowBudgetError
from kestrel_stream.cli.bench import environment

from .report import write_results


def ngl_weight_bytes(config, ngl: int) -> int:
    """The weight bytes llama.cpp's -ngl `ngl` puts in VRAM, from the step program.  llama.cpp counts its output
    layer as one of the N (llama-model.cpp: i_gpu_start = L + 1 - N, the output layer assigned as layer L): -ngl
    N <= L holds N - 1 decoder layers and the output (lm_head, a tied embedding copied), -ngl 0 nothing, -ngl
    > L everything."""
    from scheduler import offload
    per_layer, _, head = offload._layer_items(config)
    layers = len(per_layer) if ngl > len(per_layer) else max(ngl - 1, 0)
    return sum(sum(groups.values()) for groups in per_layer[:layers]) + (head if ngl >= 1 else 0)


@functools.lru_cache(maxsize=None)
def config_of(path: str):
    """A file's ModelConfig (read once: every row asks for it several times)."""
    engine = ks.load(path, device="cpu")
    config = engine.config
    engine.close()
    return config


def weight_budget_of(path: str, ngl: int) -> tuple[int, int]:
    """(ngl_weight_bytes of a GGUF file, its layer count)."""
    config = config_of(path)
    return ngl_weight_bytes(config, ngl), config.num_hidden_layers


def offload_budget(path: str, weight_bytes: int, max_seq_len: int, profile, max_batch: int | None = None) -> int:
    """The --vram-budget that leaves `weight_bytes` for weights after mode offload's KV pool and activations, for
    an engine loaded with this max_seq_len and max_batch (None: ks.load's default, as the rows load it: the KV
    pool's floor holds a block for each session of a full batch, so the two must agree)."""
    from kestrel_stream.run.device.budget import ALIGN, plan_offload_memory, weight_items
    from kestrel_stream.run.step_executor import DEFAULTS
    c = config_of(path)
    max_batch = max_batch or inspect.signature(ks.load).parameters["max_batch"].default
    needs = plan_offload_memory(c, budget_bytes=1 << 50, free_bytes=1 << 51, profile=profile,
                                max_tokens=max(max_batch, DEFAULTS[False][2]), max_sessions=256,
                                max_seq_len=max_seq_len, attention_splits=16, max_batch=max_batch).needs
    return needs.total + 2 * ALIGN * (len(weight_items(c)) + 8) + weight_bytes


POOL_FIGURES = ("host_weight_GBps", "h2d_GBps", "host_joint_GBps", "h2d_joint_GBps", "host_call_us", "host_format_GBps",
                "host_gflops", "round_trip_us", "gpu_weight_GBps")


def measured_pool(threads: int):
    """(this machine's profile, measured now with `threads` host threads, and its pool figures, printed)."""
    from kestrel_stream.options import Options
    from kestrel_stream.run.calibrate import calibrate
    profile = calibrate(force=True, options=Options.from_env(host_threads=threads))
    pool = {k: getattr(profile, k) for k in POOL_FIGURES}
    print("pool:", pool, flush=True)
    return profile, pool


def decode_rate(engine, new_tokens: int, repeats: int) -> tuple[float, float]:
    """(median tok/s, median ms per step) of greedy decode after one token."""
    rates = []
    for r in range(repeats + 1):
        s = engine.new_session()
        token = s.decode_greedy(1)
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            token = s.decode_greedy(token)
        elapsed = time.perf_counter() - t0
        s.close()
        if r:
            rates.append(new_tokens / elapsed)
    rate = statistics.median(rates)
    return rate, 1e3 / rate


BATCH_PROMPT = 32       # each session's prompt in the batch rows
BATCH_WARMUP = 3        # batch steps before the timed ones: a step size's graphs are replayed from the third on


def batch_group(engine, sessions: int, greedy: bool = True) -> list:
    """decode_batch's (session, token) pairs of `sessions` new sessions, a random BATCH_PROMPT-token prompt each,
    stepped together BATCH_WARMUP times (the first step of a size runs segment by segment, the second is
    captured: the timed ones replay).  The caller closes the sessions."""
    rng = np.random.default_rng(0)
    group = [engine.new_session() for _ in range(sessions)]
    tokens = [(s, 1) for s in group]
    try:
        for s in group:
            s.prefill([int(t) for t in rng.integers(0, engine.config.vocab_size, BATCH_PROMPT)], logits="last")
        for _ in range(BATCH_WARMUP):
            engine.decode_batch(tokens, greedy=greedy)
    except BaseException:
        for s in group:
            s.close()
        raise
    return tokens


def batch_rate(engine, sessions: int, new_tokens: int) -> float:
    """Tokens/s of `sessions` sessions decoding together (after a BATCH_PROMPT-token prompt each)."""
    tokens = batch_group(engine, sessions)
    try:
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            engine.decode_batch(tokens, greedy=True)
        elapsed = time.perf_counter() - t0
    finally:
        for s, _ in tokens:
            s.close()
    return sessions * new_tokens / elapsed


def batch_row(path: str, weight_bytes: int, profile, args, stream: bool = False) -> dict:
    """--sessions sessions decoding together in mode offload, the weights' VRAM that of the batch-1 row: an
    engine whose KV pool's floor (one session of max_seq_len and a block for each other of a full batch) holds
    every session's prompt and tokens, as llama-batched-bench's -c gives each of its sessions.  The row's
    figures: ours_batch_tok_s, the step's placement, its measured and predicted time (a step decodes every
    session: --sessions tokens).  stream: the window alone (mode gpu, KESTREL_OFFLOAD=stream) under the same
    VRAM budget and the same max_seq_len and max_batch, the pure-streaming side: stream_batch_tok_s."""
    per_session = -(-(BATCH_PROMPT + args.new_tokens + 2) // 16) * 16
    seq = per_session * args.sessions
    budget = offload_budget(path, weight_bytes, seq, profile, args.sessions)
    if stream:
        engine = ks.load(path, mode="gpu", vram_budget=budget, max_seq_len=seq, max_batch=args.sessions)
    else:
        engine = ks.load(path, mode="offload", vram_budget=budget, max_seq_len=seq, max_batch=args.sessions,
                         cpu_threads=args.threads)
    try:
        rate = batch_rate(engine, args.sessions, args.new_tokens)
        if stream:
            return {"stream_batch_tok_s": round(rate, 1)}
        from scheduler.offload import HOME_LETTERS
        placement = engine.executor.placement_for(args.sessions)
        predicted = placement.predicted.total_us / 1e3
        step_ms = args.sessions / rate * 1e3
        return {"ours_batch_tok_s": round(rate, 1),
                "batch_placement": "".join(HOME_LETTERS[h] for h in placement.homes) + f" head {placement.head}",
                "batch_step_ms": round(step_ms, 2), "batch_predicted_ms": round(predicted, 2),
                "batch_predicted_error": round(predicted / step_ms - 1, 3)}
    finally:
        engine.close()


def llama_tg(binary: str, path: str, layers: int, threads: int, new_tokens: int) -> float:
    out = subprocess.run([binary, "-m", path, "-ngl", str(layers), "-t", str(threads), "-p", "0",
                          "-n", str(new_tokens), "-r", "3", "-o", "json"], capture_output=True, text=True, check=True)
    return round(float(json.loads(out.stdout)[0]["avg_ts"]), 2)


def llama_batched(binary: str, path: str, layers: int, threads: int, sessions: int) -> float:
    out = subprocess.run([binary, "-m", path, "-ngl", str(layers), "-t", str(threads), "-c", str(sessions * 80),
                          "-npp", "32", "-ntg", "32", "-npl", str(sessions)], capture_output=True, text=True,
                         check=True)
    rows = [line for line in out.stdout.splitlines() if line.strip().startswith("|") and re.search(r"\d", line)]
    cells = [c.strip() for c in rows[-1].strip("|").split("|")]
    return float(cells[7])          # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | ...


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--sessions", type=int, default=0)
    parser.add_argument("--no-stream", action="store_true", help="skip the window-alone rows")
    parser.add_argument("--homes", nargs="*", default=[],
                        help="placements to run beside the chosen one (KESTREL_OFFLOAD_HOMES's form, per fraction "
                             "as FRACTION=LETTERS[:head])")
    parser.add_argument("--llama-bench", default=None)
    parser.add_argument("--llama-batched-bench", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    profile, pool = measured_pool(args.threads)
    rows = []
    for path in args.files:
        for fraction in args.fractions:
            _, layer_count = weight_budget_of(path, 0)
            ngl = round(layer_count * fraction)
            weights, _ = weight_budget_of(path, ngl)
            budget = offload_budget(path, weights, args.max_seq_len, profile)
            row = {"file": os.path.basename(path), "ngl": ngl, "weight_MB": round(weights / 1e6, 1),
                   "budget_MB": round(budget / 1e6, 1)}
            os.environ["KESTREL_OFFLOAD"] = "place"
            for given in [h.split("=", 1)[1] for h in args.homes if float(h.split("=", 1)[0]) == fraction]:
                os.environ["KESTREL_OFFLOAD_HOMES"] = given
                engine = ks.load(path, mode="offload", vram_budget=budget, max_seq_len=args.max_seq_len,
                                 cpu_threads=args.threads)
                p = engine.executor.placement
                given_rate, given_ms = decode_rate(engine, args.new_tokens, args.repeats)
                engine.close()
                print({"given": given, "tok_s": round(given_rate, 2), "step_ms": round(given_ms, 2),
                       "predicted_ms": round(p.predicted.total_us / 1e3, 2)}, flush=True)
                row.setdefault("given", []).append(f"{given} {given_rate:.1f} tok/s "
                                                   f"(predicted {1e6 / p.predicted.total_us:.1f})")
            os.environ.pop("KESTREL_OFFLOAD_HOMES", None)
            engine = ks.load(path, mode="offload", vram_budget=budget, max_seq_len=args.max_seq_len,
                             cpu_threads=args.threads)
            placement = engine.executor.placement
            rate, step_ms = decode_rate(engine, args.new_tokens, args.repeats)
            from scheduler.offload import HOME_LETTERS
            letters = "".join(HOME_LETTERS[h] for h in placement.homes)
            row.update({"placement": f"{letters} head {placement.head}", "ours_tok_s": round(rate, 2),
                        "held_MB": round((placement.resident_bytes + placement.ring_bytes) / 1e6, 1),
                        "step_ms": round(step_ms, 2), "predicted_ms": round(placement.predicted.total_us / 1e3, 2),
                        "roofline_ms": round(placement.roofline_us / 1e3, 2),
                        "of_roofline": round(placement.roofline_us / 1e3 / step_ms, 3),
                        "predicted_error": round(placement.predicted.total_us / 1e3 / step_ms - 1, 3)})
            engine.close()
            if args.sessions:
                row.update(batch_row(path, weights, profile, args))
            if not args.no_stream:
                os.environ["KESTREL_OFFLOAD"] = "stream"
                try:
                    engine = ks.load(path, mode="gpu", vram_budget=budget, max_seq_len=args.max_seq_len)
                except Exception as e:              # noqa: BLE001  (the window alone may not fit: say so)
                    row["stream_tok_s"] = f"refused: {str(e).split(':')[0][:60]}"
                else:
                    row["stream_tok_s"] = round(decode_rate(engine, args.new_tokens, args.repeats)[0], 2)
                    engine.close()
                if args.sessions:           # on an engine loaded as the batch row's, the same VRAM
                    try:
                        row.update(batch_row(path, weights, profile, args, stream=True))
                    except (CapacityError, WindowBudgetError) as e:
                        row["stream_batch_tok_s"] = f"refused: {str(e)[:80]}"
            if args.llama_bench:
                row["llama_tok_s"] = llama_tg(args.llama_bench, path, ngl, args.threads, args.new_tokens)
                row["ratio"] = round(row["ours_tok_s"] / row["llama_tok_s"], 3)
            if args.sessions and args.llama_batched_bench:
                row["llama_batch_tok_s"] = llama_batched(args.llama_batched_bench, path, ngl, args.threads,
                                                         args.sessions)
                row["batch_ratio"] = round(row["ours_batch_tok_s"] / row["llama_batch_tok_s"], 3)
            print(row, flush=True)
            rows.append(row)
    columns = ["file", "ngl", "weight_MB", "held_MB", "budget_MB", "placement", "ours_tok_s", "stream_tok_s",
               "llama_tok_s", "ratio", "step_ms", "predicted_ms", "predicted_error", "roofline_ms", "of_roofline",
               "ours_batch_tok_s", "stream_batch_tok_s", "llama_batch_tok_s", "batch_ratio", "batch_placement",
               "batch_step_ms", "batch_predicted_ms", "batch_predicted_error", "given"]
    out = write_results("offload", environment(), rows, [c for c in columns if any(c in r for r in rows)],
                        out_dir=args.out,
                        notes=(f"host memory pool (calibrate, this run): {pool}. Ours: mode offload with the weight "
                               "bytes llama.cpp's -ngl N puts in VRAM (N-1 layers and the output layer); llama.cpp "
                               f"-ngl N. {args.new_tokens} greedy tokens after one, medians of {args.repeats}; "
                               "llama-bench -r 3 averages."))
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
