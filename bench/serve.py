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
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")     # before numpy loads, here and in the daemon

import anyio  # noqa: E402
import numpy as np  # noqa: E402

import kestrel_stream as ks  # noqa: E402
from kestrel_stream.cli.bench import environment  # noqa: E402
from kestrel_stream.loading.presets import ensure_preset  # noqa: E402
from kestrel_stream.serve import protocol as wire  # noqa: E402

from .daemon_latency import stop_daemon  # noqa: E402
from .report import write_results  # noqa: E402


def start_daemon(model, args, socket_path: Path, step_tokens: int) -> subprocess.Popen:
    log = open(socket_path.with_suffix(f".s{step_tokens}.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "kestrel_stream", "serve", "--model", str(model), "--device",
                             args.device, "--mode", args.mode, "--socket", str(socket_path),
                             "--max-batch", str(args.max_batch), "--step-tokens", str(step_tokens),
                             "--max-sessions", str(max(args.client_counts) + 4),
                             "--max-seq-len", str(args.prompt_tokens + args.new_tokens + 8)],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while "listening on" not in Path(log.name).read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"daemon did not start: {Path(log.name).read_text()}")
        time.sleep(0.05)
    return proc


def daemon_vocab_size(socket_path: Path) -> int:
    """The vocabulary size the daemon's hello answer names (the model is loaded there, not here)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(str(socket_path))
        sock.sendall(wire.encode_frame({"op": "hello", "id": 0, "v": wire.VERSION}))
        data = b""
        while True:
            chunk = sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the daemon closed the connection before its hello answer")
            data += chunk
            if len(data) >= wire.PREFIX_BYTES:
                header_bytes, payload_bytes = wire.parse_prefix(data[:wire.PREFIX_BYTES], wire.MAX_RESPONSE_BYTES)
                end = wire.PREFIX_BYTES + header_bytes + payload_bytes
                if len(data) >= end:
                    frame = wire.parse_body(data[wire.PREFIX_BYTES:wire.PREFIX_BYTES + header_bytes],
                                            data[wire.PREFIX_BYTES + header_bytes:end])
                    return int(frame.header["vocab_size"])


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


async def serve_run(socket_path: Path, clients: int, prompt_tokens: int, new_tokens: int, vocab: int,
                    seed: int) -> dict:
    """One round: every client's time to first token (s) and the aggregate generated tok/s."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, prompt_tokens) for _ in range(clients)]
    opened, go = [0], anyio.Event()
    ttft_s: list[float] = []
    finished: list[float] = []

    async def one(i: int) -> None:
        async with ks.AsyncClient(str(socket_path)) as client, await client.new_session() as s:
            opened[0] += 1
            if opened[0] == clients:
                go.set()
            await go.wait()
            sent = time.perf_counter()
            token = await s.prefill(prompts[i], want="token")
            ttft_s.append(time.perf_counter() - sent)
            for _ in range(new_tokens - 1):
                token = await s.decode(token, want="token")
            finished.append(time.perf_counter())

    async with anyio.create_task_group() as tg:
        for i in range(clients):
            tg.start_soon(one, i)
        await go.wait()
        started = time.perf_counter()
    return {"tok_s": clients * new_tokens / (max(finished) - started), "ttft_s": ttft_s}


def rows_for_budget(model, args, socket_path: Path, step_tokens: int) -> list[dict]:
    rows = []
    proc = start_daemon(model, args, socket_path, step_tokens)
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
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--model", default=None, help="checkpoint directory or .gguf (default: make --preset)")
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--mode", default="auto")
    parser.add_argument("--clients", default="1,16,32")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64, help="generated tokens per client, the first "
                                                                   "from the prompt")
    parser.add_argument("--step-tokens", default="256", help="comma list: one daemon per token budget")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", default=None)
    parser.add_argument("--label", default="", help="appended to the result file name (e.g. the machine)")
    args = parser.parse_args()
    args.client_counts = [int(c) for c in args.clients.split(",")]
    budgets = [int(b) for b in args.step_tokens.split(",")]
    if min(args.client_counts) < 1 or args.prompt_tokens < 1 or args.new_tokens < 1 or min(budgets) < 1:
        parser.error("--clients, --prompt-tokens, --new-tokens and --step-tokens must be >= 1")
    model = args.model or ensure_preset(args.preset)
    with tempfile.TemporaryDirectory(prefix="kestrel-serve-") as tmp:
        socket_path = Path(tmp) / "ks.sock"
        rows = [row for budget in budgets for row in rows_for_budget(model, args, socket_path, budget)]
    name = f"serve-{args.model and Path(args.model).name or args.preset}-{args.device}"
    name += f"-{args.label}" if args.label else ""
    path = write_results(name, environment(), rows,
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
