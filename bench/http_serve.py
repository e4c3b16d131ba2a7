"""Serving over HTTP: N clients x (prompt + generated tokens) against any OpenAI-compatible /v1 endpoint.

    python3 -m bench.http_serve [--preset tiny | --model PATH] [--device cpu|cuda] [--mode auto]
                                [--clients 1,16,32] [--prompt-tokens 128] [--new-tokens 64] [--out DIR] [--label NAME]
    python3 -m bench.http_serve --base-url http://127.0.0.1:8080/v1 --served-model NAME --vocab-size V --label llama-server
    # speculative decoding: the daemon's own flags after --serve-args, text prompts (client i takes prompt i mod n)
    #   python3 -m bench.http_serve --model M.gguf --device cuda --serve-args "-md D.gguf --vram-budget 1GB" \
    #       --prompt-file bench/speculative_prompts.txt --clients 1,32
    # on the H200, ours then llama-server's on the same GGUF:
    #   python3 -m bench.http_serve --model qwen3-1.7b-q8_0.gguf --device cuda --label h200
    #   llama-server -m qwen3-1.7b-q8_0.gguf -ngl 99 -np 32 -c 8192 --port 8080 &
    #   python3 -m bench.http_serve --base-url http://127.0.0.1:8080/v1 --vocab-size 151936 --label h200-llama-server

Without --base-url a daemon is started here with ``serve --http 127.0.0.1:0``.
Each client sends one streaming ``/v1/completions`` request at the same
moment as the others: a prompt of random token ids (a list of ids, which
both this server and llama-server take; a different prompt per client),
``max_tokens`` = --new-tokens, greedy, ``ignore_eos`` so every client gets
exactly that many tokens.  Time to first token is from sending the request
to its first streamed choice; aggregate tok/s is every client's generated
tokens (the usage chunk's count where the server sends one) over the time
from the start to the last client's last chunk.  The load generator is one
asyncio loop in this process: on a machine with few cores it competes with
the server.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")     # before numpy loads, here and in the daemon

import httpx  # noqa: E402

from kestrel_stream.cli.bench import environment  # noqa: E402
from kestrel_stream.loading.presets import ensure_preset  # noqa: E402

from . import daemons  # noqa: E402
from .daemons import (add_daemon_args, client_counts, daemon_vocab_size, percentile, random_prompts,  # noqa: E402
                      result_name, stop_daemon)
from .report import write_results  # noqa: E402


def start_daemon(model, args, tmp: Path):
    """``serve --http 127.0.0.1:0`` (and --serve-args) and the base URL it logs."""
    return daemons.start_daemon(model, tmp / "daemon.log", "--device", args.device, "--mode", args.mode,
                                "--socket", str(tmp / "ks.sock"), "--http", "127.0.0.1:0",
                                "--served-model-name", "bench", "--max-batch", str(args.max_batch),
                                "--max-sessions", str(max(args.client_counts) + 4),
                                *(["--max-seq-len", str(args.prompt_tokens + args.new_tokens + 8)]
                                  if args.prompt_texts is None else []), *shlex.split(args.serve_args),
                                listening=r"http listening on (http://\S+/v1)")


async def model_name(http: httpx.AsyncClient, base_url: str) -> str:
    response = await http.get(f"{base_url}/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def one_request(http: httpx.AsyncClient, base_url: str, body: dict) -> tuple[float, float, int, str | None]:
    """(time to first token s, finish time, generated tokens, the error event's message or None) of one
    streaming completion: a server that fails a request after its 200 says so in the stream."""
    sent = time.perf_counter()
    first, chunks, usage, error = None, 0, None, None
    async with http.stream("POST", f"{base_url}/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                err = chunk["error"]
                error = str(err.get("message", err) if isinstance(err, dict) else err)[:200]
            if chunk.get("usage"):
                usage = chunk["usage"].get("completion_tokens")
            if chunk.get("choices"):
                chunks += 1
                if first is None:
                    first = time.perf_counter() - sent
    return first if first is not None else float("nan"), time.perf_counter(), usage if usage else chunks, error


async def round_of(base_url: str, model: str, clients: int, args, vocab: int, seed: int) -> dict:
    prompts = ([args.prompt_texts[i % len(args.prompt_texts)] for i in range(clients)] if args.prompt_texts else
               [prompt.tolist() for prompt in random_prompts(vocab, clients, args.prompt_tokens, seed)])
    bodies = [{"model": model, "prompt": prompt, "max_tokens": args.new_tokens, "temperature": 0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}} for prompt in prompts]
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


def rows_at(base_url: str, args, vocab: int) -> list[dict]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    async def name() -> str:
        async with httpx.AsyncClient(timeout=60, headers=headers) as http:
            return args.served_model or await model_name(http, base_url)
    model = asyncio.run(name())
    warm = argparse.Namespace(**{**vars(args), "prompt_tokens": min(args.prompt_tokens, 16), "new_tokens": 4})
    asyncio.run(round_of(base_url, model, 2, warm, vocab, 0))
    rows = []
    for clients in args.client_counts:
        for repeat in range(args.repeat):
            run = asyncio.run(round_of(base_url, model, clients, args, vocab, 1000 * clients + repeat))
            ttft_ms = [t * 1e3 for t in run["ttft_s"]]
            rows.append({"server": args.server, "clients": clients, "run": repeat, "tok_s": round(run["tok_s"], 1),
                         "ttft_p50_ms": round(statistics.median(ttft_ms), 2),
                         "ttft_p99_ms": round(percentile(ttft_ms, 0.99), 2),
                         "tokens": run["tokens"], "expected_tokens": clients * args.new_tokens,
                         "short_streams": run["short_streams"], "error": run["error"]})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default=None, help="an OpenAI-compatible /v1 URL (default: start our daemon)")
    parser.add_argument("--served-model", default=None, help="the request's 'model' (default: /v1/models' first)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer key ($OPENAI_API_KEY)")
    parser.add_argument("--vocab-size", type=int, default=None, help="prompt ids are drawn below it (with "
                                                                     "--base-url; else the model's)")
    add_daemon_args(parser)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--serve-args", default="", help="more flags for our daemon's serve, e.g. "
                                                         "\"-md DRAFT.gguf --vram-budget 1GB\"")
    parser.add_argument("--prompt-file", default=None, help="text prompts separated by lines of --- instead of "
                                                            "random ids (client i sends prompt i mod n)")
    args = parser.parse_args()
    args.prompt_texts = ([t for t in Path(args.prompt_file).read_text().split("\n---\n") if t.strip()]
                         if args.prompt_file else None)
    args.client_counts = client_counts(parser, args)
    if not args.client_counts or args.prompt_tokens < 1 or args.new_tokens < 1:
        parser.error("--clients, --prompt-tokens and --new-tokens must be >= 1")
    if args.base_url:
        if args.vocab_size is None:
            parser.error("--base-url needs --vocab-size (prompt ids are drawn below it)")
        args.server = args.base_url
        rows = rows_at(args.base_url.rstrip("/"), args, args.vocab_size)
        name = "-".join(["http-serve", args.served_model or "endpoint"] + ([args.label] if args.label else []))
    else:
        model = args.model or ensure_preset(args.preset)
        args.server = "kestrel-stream"
        with tempfile.TemporaryDirectory(prefix="kestrel-http-") as tmp:
            proc, base_url = start_daemon(model, args, Path(tmp))
            try:
                vocab = args.vocab_size or daemon_vocab_size(Path(tmp) / "ks.sock")
                rows = rows_at(base_url, args, vocab)
            finally:
                stop_daemon(proc)
        name = result_name("http-serve", args, args.device)
    path = write_results(name, environment(), rows,
                         ["server", "clients", "run", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "tokens",
                          "expected_tokens", "short_streams", "error"], out_dir=args.out,
                         notes=f"HTTP, streaming /v1/completions; {os.cpu_count()} cores; serve {args.serve_args}. "
                               f"Each client: " + (f"a prompt of {args.prompt_file}" if args.prompt_file else
                                                    f"a {args.prompt_tokens}-token prompt (random ids)")
                               + f", {args.new_tokens} greedy tokens "
                               f"with ignore_eos. tok_s = generated tokens of all clients / (last chunk - start); "
                               f"ttft = request sent -> first streamed choice; short_streams: requests that ended with fewer "
                               f"tokens than asked (error: the first in-stream error message).")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
