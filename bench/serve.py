"""Serving under continuous batching: N clients, each a prompt then greedy tokens, through the daemon.

    python3 -m bench.serve [--preset tiny | --model PATH] [--device cpu|cuda] [--mode auto]
                           [--clients 1,16,32] [--prompt-tokens 128] [--new-tokens 64]
                           [--step-tokens 256[,65536]] [--max-batch 32] [--out DIR] [--label NAME]
    # on the H200:  python3 -m bench.serve --model qwen3-1.7b-q8_0.gguf --device cuda --label h200
    #               python3 -m bench.serve --preset qwen3-1.7b --device cuda --mode gpu --step-tokens 256,65536

Each client opens a session at the same moment as the others (a barrier),
sends its prompt (random ids, a different one per client) with
``want="token"`` and then decodes greedily until it holds ``--new-tokens``
tokens; time to first token is the prompt request's round trip as the client
sees it, aggregate tok/s is every client's generated tokens over the time
from the barrier to the last client's last token.  One daemon per
``--step-tokens`` value (a value at least clients x prompt tokens puts every
prompt whole into one step).  The load generator is one anyio loop in this
process: on a machine with few cores it competes with the daemon.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")     # before numpy loads, here and in the daemon

import anyio  # noqa: E402

import kestrel_stream as ks  # noqa: E402
from kestrel_stream.cli.bench import environment  # noqa: E402
from kestrel_stream.loading.presets import ensure_preset  # noqa: E402

from .daemons import (add_daemon_args, client_counts, clients_round, daemon_vocab_size, percentile,  # noqa: E402
                      random_prompts, result_name, start_daemon, stop_daemon)
from .report import write_results  # noqa: E402


def start_budget_daemon(model, args, socket_path: Path, step_tokens: int):
    proc, _ = start_daemon(model, socket_path.with_suffix(f".s{step_tokens}.log"), "--device", args.device,
                           "--mode", args.mode, "--socket", str(socket_path), "--max-batch", str(args.max_batch),
                           "--step-tokens", str(step_tokens), "--max-sessions", str(max(args.client_counts) + 4),
                           "--max-seq-len", str(args.prompt_tokens + args.new_tokens + 8))
    return proc


async def serve_run(socket_path: Path, clients: int, prompt_tokens: int, new_tokens: int, vocab: int,
                    seed: int) -> dict:
    """One round: every client's time to first token (s) and the aggregate generated tok/s."""
    prompts = random_prompts(vocab, clients, prompt_tokens, seed)
    return await clients_round(socket_path, prompts, new_tokens - 1, prefill_first=False)


def rows_for_budget(model, args, socket_path: Path, step_tokens: int) -> list[dict]:
    rows = []
    proc = start_budget_daemon(model, args, socket_path, step_tokens)
    try:
        vocab = daemon_vocab_size(socket_path)
        anyio.run(serve_run, socket_path, 2, min(args.prompt_tokens, 16), 4, vocab, 0)     # warm-up
        with ks.Client(str(socket_path)) as watcher:
            for clients in args.client_counts:
                for repeat in range(args.repeat):
                    before = watcher.stats()
                    run = anyio.run(serve_run, socket_path, clients, args.prompt_tokens, args.new_tokens, vocab,
                                    1000 * clients + repeat)
                    after = watcher.stats()
                    steps = after["steps"] - before["steps"]
                    tokens = (after["decode_tokens"] + after["prompt_tokens"]
                              - before["decode_tokens"] - before["prompt_tokens"])
                    ttft_ms = [t * 1e3 for t in run["ttft_s"]]
                    rows.append({"step_tokens": step_tokens, "clients": clients, "run": repeat,
                                 "tok_s": round(run["tok_s"], 1),
                                 "ttft_p50_ms": round(statistics.median(ttft_ms), 2),
                                 "ttft_p99_ms": round(percentile(ttft_ms, 0.99), 2),
                                 "steps": steps, "tokens_per_step": round(tokens / max(steps, 1), 1),
                                 "max_tokens_in_step": after["max_tokens_in_step"]})
                    print(rows[-1], flush=True)
    finally:
        stop_daemon(proc)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    add_daemon_args(parser)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64, help="generated tokens per client, the first "
                                                                   "from the prompt")
    parser.add_argument("--step-tokens", default="256", help="comma list: one daemon per token budget")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    args.client_counts = client_counts(parser, args)
    budgets = [int(b) for b in args.step_tokens.split(",")]
    if not args.client_counts or args.prompt_tokens < 1 or args.new_tokens < 1 or min(budgets) < 1:
        parser.error("--clients, --prompt-tokens, --new-tokens and --step-tokens must be >= 1")
    model = args.model or ensure_preset(args.preset)
    with tempfile.TemporaryDirectory(prefix="kestrel-serve-") as tmp:
        socket_path = Path(tmp) / "ks.sock"
        rows = [row for budget in budgets for row in rows_for_budget(model, args, socket_path, budget)]
    path = write_results(result_name("serve", args, args.device), environment(), rows,
                         ["step_tokens", "clients", "run", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "steps",
                          "tokens_per_step", "max_tokens_in_step"], out_dir=args.out,
                         notes=f"Unix socket; OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}; "
                               f"{os.cpu_count()} cores; mode {args.mode}. Each client: a {args.prompt_tokens}-token "
                               f"prompt (want=token), then greedy decodes up to {args.new_tokens} generated tokens. "
                               f"tok_s = generated tokens of all clients / (last token - barrier); ttft = the "
                               f"prompt request's round trip seen by the client; steps, tokens_per_step: the "
                               f"daemon's stats over the round (max_tokens_in_step since the daemon started).")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
