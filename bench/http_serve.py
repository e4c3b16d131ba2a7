"""Serving over HTTP: N clients x (prompt + generated tokens) against any OpenAI-compatible /v1 endpoint.

    python3 -m bench.http_serve [--preset tiny | --model PATH] [--device cpu|cuda] [--mode auto]
                                [--clients 1,16,32] [--prompt-tokens 128] [--new-tokens 64] [--out DIR] [--label NAME]
    python3 -m bench.http_serve --base-url http://127.0.0.1:8080/v1 --served-model NAME --vocab-size V --label llama-server
    # staggered mixed-length arrivals (bench/http_load.py), ours and then llama-server on the same file, one
    # JSON row each (throughput, TTFT p50/p99, refused and lost requests):
    #   python3 -m bench.http_serve --workload staggered --model qwen3-1.7b-q8_0.gguf --device cuda \
    #       --clients 64 --requests 200 --max-sessions 64 --prompt-range 32,2048 --new-range 16,256 \
    #       --llama-server /tmp/llama/llama.cpp/build/bin/llama-server --client-processes 4 --label h200
    #   (--client-processes: the clients over 4 event loops, so the load generator's own parsing of ~1,600
    #   chunks a second does not delay what it measures; our rows also carry the daemon's and the app's own TTFT)
    # speculative decoding: the daemon's own flags after --serve-args, text prompts (client i takes prompt i mod n)
    #   python3 -m bench.http_serve --model M.gguf --device cuda --serve-args "-md D.gguf --vram-budget 1GB" \
    #       --prompt-file bench/speculative_prompts.txt --clients 1,32
    # on the H200, ours then llama-server's on the same GGUF:
    #   python3 -m bench.http_serve --model qwen3-1.7b-q8_0.gguf --device cuda --label h200
    #   llama-server -m qwen3-1.7b-q8_0.gguf -ngl 99 -np 32 -c 8192 --port 8080 &
    #   python3 -m bench.http_serve --base-url http://127.0.0.1:8080/v1 --vocab-size 151936 --label h200-llama-server
    # replicas (serve --devices): the same clients against one GPU, then against two replicas, one row each with
    # its speedup over the first set's (issue 36: >= 1.9x at 64 clients):
    #   python3 -m bench.http_serve --model qwen3-1.7b-q8_0.gguf --devices 0 0,1 --clients 64 --label h200x2
    #   python3 -m bench.http_serve --preset tiny --devices cpu cpu,cpu --clients 4     # the same here, on CPU engines

Without --base-url a daemon is started here with ``serve --http 127.0.0.1:0``;
with --llama-server BIN, llama-server is started after it on the same file
(``-ngl 99 -np CLIENTS -fa on``, each slot the context of the longest
request) and measured with the same requests.  ``--workload burst`` (the
default): each client sends one streaming ``/v1/completions`` request at the same
moment as the others: a prompt of random token ids (a list of ids, which
both this server and llama-server take; a different prompt per client),
``max_tokens`` = --new-tokens, greedy, ``ignore_eos`` so every client gets
exactly that many tokens.  Time to first token is from sending the request
to its first streamed choice; aggregate tok/s is every client's generated
tokens (the usage chunk's count where the server sends one) over the time
from the start to the last client's last chunk.  The load generator is one
asyncio loop in this process: on a machine with few cores it competes with
the server.  ``--devices SET [SET ...]`` starts our daemon once per set
(``serve --devices SET``) and measures each with the same requests; every row
names its set and its tok/s over the first set's at the same clients
(``speedup``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")     # before numpy loads, here and in the daemon

import httpx  # noqa: E402

from kestrel_stream.cli.bench import environment  # noqa: E402
from kestrel_stream.loading.presets import ensure_preset  # noqa: E402
from kestrel_stream.serve.devices import parse_devices  # noqa: E402

from . import daemons  # noqa: E402
from .daemons import (add_daemon_args, client_counts, daemon_vocab_size, percentile, random_prompts,  # noqa: E402
                      result_name, stop_daemon)
from .http_load import completion_body, one_request, plan_requests, staggered_in_processes, summary  # noqa: E402
from .http_records import save_requests, traced  # noqa: E402
from .llama_load import free_port  # noqa: E402
from .daemon_metrics import daemon_figures, step_columns  # noqa: E402
from .report import write_results  # noqa: E402

BURST_COLUMNS = ["server", "clients", "run", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "tokens", "expected_tokens",
                 "short_streams", "error"]
STAGGERED_COLUMNS = ["server", "clients", "requests", "completed", "refused", "lost", "tok_s", "ttft_p50_ms",
                     "ttft_p99_ms", "generated_tokens", "prompt_tokens", "duration_s", "steps", "mean_step_ms",
                     "tokens_per_step", "daemon_prompts", "daemon_ttft_p50_ms", "daemon_ttft_p99_ms",
                     "daemon_ttft_steps_p50", "daemon_ttft_steps_p99", "step_p50_ms", "step_p99_ms",
                     "server_ttft_p50_ms", "server_ttft_p99_ms", "server_queue_p50_ms", "server_queue_p99_ms", "error"]


def longest_request(args) -> int:
    """The most positions one request may take: its prompt and its tokens."""
    if args.workload == "staggered":
        return args.prompt_range[1] + args.new_range[1]
    return args.prompt_tokens + args.new_tokens


def start_daemon(model, args, tmp: Path, devices: str | None = None):
    """``serve --http 127.0.0.1:0`` (and --serve-args; on ``devices``, a --devices list) and the base URL it logs."""
    sessions = args.max_sessions or max(args.client_counts) + (0 if args.workload == "staggered" else 4)
    # sessions a step: llama-server decodes its -np CLIENTS slots in one batch; ours gets as many unless told
    max_batch = args.max_batch or max(args.client_counts)
    where = ["--device", args.device] if devices is None else [
        "--devices", devices, "--device", "cpu" if devices.split(",")[0] == "cpu" else "cuda"]
    return daemons.start_daemon(model, tmp / "daemon.log", *where, "--mode", args.mode,
                                "--socket", str(tmp / "ks.sock"), "--http", "127.0.0.1:0",
                                "--served-model-name", "bench", "--max-batch", str(max_batch),
                                "--max-sessions", str(sessions),
                                *(["--max-seq-len", str(longest_request(args) + 8)]
                                  if args.prompt_texts is None else []),
                                *(["--trace-dir", str(tmp / "traces"), "--trace-max-events", str(4_000_000)]
                                  if args.trace else []), *shlex.split(args.serve_args),
                                listening=r"http listening on (http://\S+/v1)")


def start_llama_server(model, args, log_path: Path) -> tuple[subprocess.Popen, str]:
    """llama-server on ``model`` (one slot a client, each holding the longest request; --llama-args after) once
    /health answers 200, and its /v1 URL.  Its host-memory prompt cache is off (`--cache-ram 0`): on by default,
    it saves a slot's whole KV (224 MiB at 64 slots of the 1.7B) each time a request takes a slot another left,
    ~120 ms apiece on the H100's host, and the staggered workload did not finish in 150 s (its log: "making room
    for prompt cache entry" after every request); off, it served the same run at 864 tok/s."""
    slots = max(args.client_counts)
    port = free_port()
    command = [args.llama_server, "-m", str(model), "-ngl", "99", "-np", str(slots), "-fa", "on",
               "-c", str(slots * (longest_request(args) + 16)), "--cache-ram", "0", "--host", "127.0.0.1",
               "--port", str(port), *shlex.split(args.llama_args)]
    print("#", " ".join(shlex.quote(c) for c in command), flush=True)
    proc = subprocess.Popen(command, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + daemons.START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, f"http://127.0.0.1:{port}/v1"
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"llama-server did not become healthy: {log_path.read_text()[-2000:]}")


async def model_name(http: httpx.AsyncClient, base_url: str) -> str:
    response = await http.get(f"{base_url}/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def round_of(base_url: str, model: str, clients: int, args, vocab: int, seed: int) -> dict:
    prompts = ([args.prompt_texts[i % len(args.prompt_texts)] for i in range(clients)] if args.prompt_texts else
               [prompt.tolist() for prompt in random_prompts(vocab, clients, args.prompt_tokens, seed)])
    bodies = [completion_body(model, prompt, args.new_tokens) for prompt in prompts]
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=headers) as http:
        started = time.perf_counter()
        results = await asyncio.gather(*(one_request(http, base_url, b) for b in bodies))
    ttft_s = [r[0] for r in results]
    tokens = sum(r[2] for r in results)
    errors = [r[3] for r in results if r[3] is not None or r[2] < args.new_tokens]
    return {"tok_s": tokens / (max(r[1] for r in results) - started), "ttft_s": ttft_s, "tokens": tokens,
            "short_streams": len(errors), "error": next((e for e in errors if e), "")}


def rows_at(base_url: str, args, vocab: int, server: str, log_path: Path | None = None) -> list[dict]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    async def name() -> str:
        async with httpx.AsyncClient(timeout=60, headers=headers) as http:
            return args.served_model or await model_name(http, base_url)
    model = asyncio.run(name())
    warm = argparse.Namespace(**{**vars(args), "prompt_tokens": min(args.prompt_tokens, 16), "new_tokens": 4})
    asyncio.run(round_of(base_url, model, 2, warm, vocab, 0))
    if args.workload == "staggered":
        # every client at once with the longest prompt: each server meets the step sizes and batches the run will
        # (ours compiles a kernel the first time a shape needs it: the first run after a start was the slowest)
        longest = argparse.Namespace(**{**vars(args), "prompt_tokens": args.prompt_range[1], "new_tokens": 4,
                                        "prompt_texts": None})
        asyncio.run(round_of(base_url, model, max(args.client_counts), longest, vocab, 1))
        return staggered_rows(base_url, model, args, vocab, server, headers, log_path)
    rows = []
    for clients in args.client_counts:
        for repeat in range(args.repeat):
            run = asyncio.run(round_of(base_url, model, clients, args, vocab, 1000 * clients + repeat))
            ttft_ms = [t * 1e3 for t in run["ttft_s"]]
            rows.append({"server": server, "clients": clients, "run": repeat, "tok_s": round(run["tok_s"], 1),
                         "ttft_p50_ms": round(statistics.median(ttft_ms), 2),
                         "ttft_p99_ms": round(percentile(ttft_ms, 0.99), 2),
                         "tokens": run["tokens"], "expected_tokens": clients * args.new_tokens,
                         "short_streams": run["short_streams"], "error": run["error"]})
            print(rows[-1], flush=True)
    return rows


def server_ttft(log_path: Path, requests: int) -> dict:
    """The time to first token of the latest `requests` completions as our daemon's access log has them (from
    the request's arrival in the app to its first token, before the chunk is written): the client's TTFT less
    it is the time in transit, in the HTTP server and in the client's own loop; and the part of it spent in
    the admission queue waiting for a session (`queue=`).  A line is written once its
    response is sent: the last ones may trail the client's end by a moment."""
    for _ in range(40):
        lines = [m for line in log_path.read_text(errors="replace").splitlines()
                 if '"POST /v1/completions" 200' in line
                 and (m := re.search(r" queue=([0-9.]+)s ttft=([0-9.]+)s", line))]
        if len(lines) >= requests:
            queue = [float(m.group(1)) * 1e3 for m in lines[-requests:]]
            ttft = [float(m.group(2)) * 1e3 for m in lines[-requests:]]
            return {"server_ttft_p50_ms": round(statistics.median(ttft), 1),
                    "server_ttft_p99_ms": round(percentile(ttft, 0.99), 1),
                    "server_queue_p50_ms": round(statistics.median(queue), 1),
                    "server_queue_p99_ms": round(percentile(queue, 0.99), 1)}
        time.sleep(0.05)
    return {}


def staggered_rows(base_url: str, model: str, args, vocab: int, server: str, headers: dict,
                   log_path: Path | None = None) -> list[dict]:
    """One row per client count; with our daemon's access log (`log_path`), the app's own TTFT beside."""
    rows = []
    for clients in args.client_counts:
        planned = plan_requests(args.requests, vocab, args.prompt_range, args.new_range, args.rate, args.seed)
        before = daemon_figures(base_url, headers) if server == "kestrel-stream" else None
        tracing = traced(args, log_path, server, clients)
        try:
            outcomes, started = staggered_in_processes(base_url, model, planned, clients, headers, args.timeout_s,
                                                       args.client_processes, args.temperature)
        finally:
            if tracing is not None:
                tracing()
        rows.append(summary(server, clients, outcomes, started))
        save_requests(args, server, clients, outcomes, started, log_path)
        if before is not None:
            rows[-1].update(step_columns(before, daemon_figures(base_url, headers)))
        if log_path is not None:
            rows[-1].update(server_ttft(log_path, args.requests))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def speedups(rows: list[dict]) -> None:
    """Each row's tok/s over the first --devices set's at the same clients and run (``speedup``)."""
    first = {}
    for row in rows:
        key = (row["clients"], row.get("run", 0))
        first.setdefault(key, row["tok_s"])
        row["speedup"] = round(row["tok_s"] / first[key], 3) if first[key] else None


def notes(args) -> str:
    head = f"HTTP, streaming /v1/completions; {os.cpu_count()} cores; serve {args.serve_args}. "
    if args.devices:
        head += (f"Our daemon once per --devices set ({', '.join(args.devices)}), the same requests each; speedup = "
                 f"tok_s over the first set's at the same clients. ")
    if args.workload == "staggered":
        return head + (
            f"llama-server -np CLIENTS -fa on {args.llama_args}. {args.requests} requests (seed {args.seed}), prompts "
            f"of {args.prompt_range[0]}..{args.prompt_range[1]} random ids (log-uniform), max_tokens "
            f"{args.new_range[0]}..{args.new_range[1]} (uniform), "
            + ("greedy" if args.temperature <= 0 else f"sampled (temperature {args.temperature:g}, top_p 0.95, seed = "
               f"the request's index)")
            + f" with ignore_eos, Poisson arrivals at "
            f"{args.rate:g}/s taken by CLIENTS connections. completed: every token streamed; refused: HTTP 429/503; "
            f"lost: any other failure or a short stream. tok_s = completed tokens / (first send -> last finish); "
            f"ttft = request sent -> first streamed choice (completed requests).")
    return head + ("Each client: " + (f"a prompt of {args.prompt_file}" if args.prompt_file else
                                      f"a {args.prompt_tokens}-token prompt (random ids)")
                   + f", {args.new_tokens} greedy tokens with ignore_eos. tok_s = generated tokens of all clients / "
                     f"(last chunk - start); ttft = request sent -> first streamed choice; short_streams: requests "
                     f"that ended with fewer tokens than asked (error: the first in-stream error message).")


def int_pair(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    pair = (int(low), int(high or low))
    if not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LOW,HIGH with 1 <= LOW <= HIGH")
    return pair


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default=None, help="an OpenAI-compatible /v1 URL (default: start our daemon)")
    parser.add_argument("--served-model", default=None, help="the request's 'model' (default: /v1/models' first)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer key ($OPENAI_API_KEY)")
    parser.add_argument("--vocab-size", type=int, default=None, help="prompt ids are drawn below it (with "
                                                                     "--base-url; else the model's)")
    add_daemon_args(parser, clients="")
    parser.set_defaults(max_batch=None)         # our daemon's --max-batch: the most clients (start_daemon)
    parser.add_argument("--workload", choices=["burst", "staggered"], default="burst",
                        help="burst: every client at once, same lengths; staggered: mixed lengths, Poisson arrivals "
                             "(bench/http_load.py)")
    parser.add_argument("--requests", type=int, default=200, help="staggered: requests in all")
    parser.add_argument("--prompt-range", type=int_pair, default=(32, 2048), help="staggered: prompt tokens, "
                                                                                   "log-uniform in LOW,HIGH")
    parser.add_argument("--new-range", type=int_pair, default=(16, 256), help="staggered: max_tokens, uniform "
                                                                             "in LOW,HIGH")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="staggered: spread the clients over this many processes, each with its own event loop "
                             "(one loop parsing every stream can delay what it measures)")
    parser.add_argument("--rate", type=float, default=16.0, help="staggered: arrivals per second (Poisson)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="staggered: sample each request at this temperature (top_p 0.95, its index as seed); "
                             "0: greedy")
    parser.add_argument("--seed", type=int, default=0, help="staggered: the requests' seed (same for every server)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="a request not done by then is lost")
    parser.add_argument("--trace", action="store_true",
                        help="staggered, with --out: our daemon's trace of each run (steps, and the calls on its step "
                             "thread with how long each waited there), written beside the rows as .json.gz")
    parser.add_argument("--max-sessions", type=int, default=None,
                        help="our daemon's --max-sessions (default: the clients, +4 for burst)")
    parser.add_argument("--llama-server", default=None, metavar="BIN",
                        help="then start this llama-server on the same model and measure it the same way")
    parser.add_argument("--llama-args", default="", help="more llama-server flags, e.g. \"-ub 2048\"")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--serve-args", default="", help="more flags for our daemon's serve, e.g. "
                                                         "\"-md DRAFT.gguf --vram-budget 1GB\"")
    parser.add_argument("--devices", nargs="+", default=None, metavar="SET",
                        help="our daemon once per set, each a serve --devices list (0 0,1: one GPU, then two "
                             "replicas; cpu cpu,cpu here), rows with their set and speedup over the first set's")
    parser.add_argument("--prompt-file", default=None, help="text prompts separated by lines of --- instead of "
                                                            "random ids (client i sends prompt i mod n)")
    args = parser.parse_args()
    args.prompt_texts = ([t for t in Path(args.prompt_file).read_text().split("\n---\n") if t.strip()]
                         if args.prompt_file else None)
    args.client_counts = client_counts(parser, args) or ([64] if args.workload == "staggered" else [1, 16, 32])
    if min(args.prompt_tokens, args.new_tokens, args.requests, args.client_processes) < 1 or args.rate <= 0:
        parser.error("--prompt-tokens, --new-tokens, --requests, --client-processes and --rate must be >= 1 "
                     "(--rate > 0)")
    if args.devices and args.base_url:
        parser.error("--devices starts our daemon once per set: give it --model or --preset, not --base-url")
    for devices in args.devices or []:
        try:
            parse_devices(devices)
        except ValueError as e:
            parser.error(str(e))
    if args.llama_server and args.base_url:
        parser.error("--llama-server starts its own server: give it --model, not --base-url")
    if args.base_url:
        if args.vocab_size is None:
            parser.error("--base-url needs --vocab-size (prompt ids are drawn below it)")
        rows = rows_at(args.base_url.rstrip("/"), args, args.vocab_size, args.base_url)
        name = "-".join(["http-serve", args.served_model or "endpoint"] + ([args.label] if args.label else []))
    else:
        model = args.model or ensure_preset(args.preset)
        with tempfile.TemporaryDirectory(prefix="kestrel-http-") as tmp:
            rows = []
            for devices in args.devices or [None]:
                proc, base_url = start_daemon(model, args, Path(tmp), devices)
                try:
                    vocab = args.vocab_size or daemon_vocab_size(Path(tmp) / "ks.sock")
                    ours = rows_at(base_url, args, vocab, "kestrel-stream", Path(tmp) / "daemon.log")
                    rows += [dict(row, devices=devices) if devices else row for row in ours]
                finally:
                    stop_daemon(proc)
            if args.devices:
                speedups(rows)
            if args.llama_server:           # after ours has stopped: the device is the other server's alone
                proc, base_url = start_llama_server(model, args, Path(tmp) / "llama-server.log")
                try:
                    rows += rows_at(base_url, args, vocab, "llama-server")
                finally:
                    proc.terminate()
                    proc.wait(60)
        name = result_name("http-serve" + ("-staggered" if args.workload == "staggered" else ""), args,
                           *(["devices-" + "-".join(d.replace(",", "+") for d in args.devices)] if args.devices
                             else [args.device]))
    columns = STAGGERED_COLUMNS if args.workload == "staggered" else BURST_COLUMNS
    if args.devices:
        columns = columns[:1] + ["devices"] + columns[1:] + ["speedup"]
    path = write_results(name, environment(), rows, columns, out_dir=args.out, notes=notes(args))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
