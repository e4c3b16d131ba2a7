"""What the serving benchmarks share: their common flags, a `kestrel-stream serve` process started and stopped,
its vocabulary asked over the socket, concurrent socket clients in one anyio loop, and the figures they report.

Used by bench.serve, bench.daemon_latency, bench.daemon_floor and bench.http_serve.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import numpy as np

import kestrel_stream as ks
from kestrel_stream.wire import protocol as wire

START_TIMEOUT_S = 900       # a large GGUF converted on first use, then preloaded to the device


def add_daemon_args(parser, clients: str = "1,16,32") -> None:
    """The flags of every benchmark that starts a daemon: the model, where it runs, the client counts, results."""
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--model", default=None, help="checkpoint directory or .gguf (default: make --preset)")
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--mode", default="auto")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--clients", default=clients, help="comma list of concurrent client counts")
    parser.add_argument("--out", default=None)
    parser.add_argument("--label", default="", help="appended to the result file name (e.g. the machine)")


def client_counts(parser, args) -> list[int]:
    counts = [int(c) for c in args.clients.split(",")] if args.clients else []
    if counts and min(counts) < 1:
        parser.error(f"--clients {args.clients}: every count must be >= 1")
    return counts


def result_name(kind: str, args, *parts: str) -> str:
    """``kind-MODEL-PARTS...[-LABEL]``: MODEL is --model's file name or --preset."""
    model = Path(args.model).name if args.model else args.preset
    return "-".join([kind, model, *parts] + ([args.label] if args.label else []))


def start_daemon(model, log_path: Path, *flags: str, source: str | None = None,
                 listening: str = r"listening on \S+") -> tuple[subprocess.Popen, str]:
    """``kestrel-stream serve --model MODEL FLAGS...`` logging to log_path, once its log matches ``listening``
    (the socket file exists a moment before the daemon listens); the process and the matched text's first group
    (else the whole match).  ``source``: run the package from that source tree instead of this one."""
    log = open(log_path, "w")
    env = dict(os.environ, PYTHONPATH=source) if source else None
    proc = subprocess.Popen([sys.executable, "-m", "kestrel_stream", "serve", "--model", str(model), *flags],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=source)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        found = re.search(listening, log_path.read_text())
        if found:
            return proc, found.group(1) if found.groups() else found.group(0)
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"daemon did not start: {log_path.read_text()}")
        time.sleep(0.05)


def stop_daemon(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    if proc.wait(60) != 0:
        raise RuntimeError(f"daemon exited {proc.returncode}")


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


async def clients_round(socket_path: Path, prompts: list, decodes: int, prefill_first: bool) -> dict:
    """One socket client per prompt, all started together: each opens a session, prefills its prompt
    (want=token), then decodes ``decodes`` greedy tokens.

    The clock starts at a barrier every client reaches: after opening its
    session (``prefill_first`` False: the prompts run inside the clock, each
    one's round trip is its time to first token) or after its prefill (True:
    decode alone is timed).  tok_s is the tokens generated inside the clock
    (the prompt's token included when it is inside) over the time from the
    barrier to the last client's last token."""
    clients, arrived, go = len(prompts), [0], anyio.Event()
    ttft_s: list[float] = []
    finished: list[float] = []

    async def barrier() -> None:
        arrived[0] += 1
        if arrived[0] == clients:
            go.set()
        await go.wait()

    async def one(prompt) -> None:
        async with ks.AsyncClient(str(socket_path)) as client, await client.new_session() as s:
            if not prefill_first:
                await barrier()
            sent = time.perf_counter()
            token = await s.prefill(prompt, want="token")
            ttft_s.append(time.perf_counter() - sent)
            if prefill_first:
                await barrier()
            for _ in range(decodes):
                token = await s.decode(token, want="token")
            finished.append(time.perf_counter())

    async with anyio.create_task_group() as tg:
        for prompt in prompts:
            tg.start_soon(one, prompt)
        await go.wait()
        started = time.perf_counter()
    generated = clients * (decodes + (0 if prefill_first else 1))
    return {"tok_s": generated / (max(finished) - started), "ttft_s": ttft_s}


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def random_prompts(vocab: int, clients: int, tokens: int, seed: int) -> list[np.ndarray]:
    """A different prompt of random ids per client (no prefix shared: the prefix cache finds nothing)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, tokens) for _ in range(clients)]
