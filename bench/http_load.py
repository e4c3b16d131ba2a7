"""HTTP load for bench/http_serve.py: one streaming /v1/completions request measured, and the staggered
mixed-length workload.

The staggered workload: ``requests`` requests planned up front from a seed
(the same requests for every server), each with a prompt of random token
ids whose length is log-uniform in ``prompt_range`` (as many short prompts
as long ones per doubling), ``max_tokens`` uniform in ``new_range``, and an
arrival time of a Poisson process of ``rate_per_s``.  ``clients``
connections take them in arrival order: a client sends the next request at
its arrival time, or as soon as the client is free if it is late.  Each
request is greedy with ``ignore_eos``, so it must stream exactly its
``max_tokens``.  Outcomes:

- completed: 200 and every token asked for;
- refused: an HTTP 429 or 503 (the server said it is full or stopping);
- lost: anything else: another status, a connection error or timeout, an
  error event in the stream, or a stream that ended short.

Time to first token is from sending a request to its first streamed
choice; throughput is the completed requests' tokens over the time from the
first send to the last finish.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import httpx
import numpy as np

from .daemons import percentile

REFUSAL_STATUSES = (429, 503)


class RequestFailed(RuntimeError):
    def __init__(self, status: int, text: str):
        super().__init__(f"HTTP {status}: {text[:300]}")
        self.status = status


async def one_request(http: httpx.AsyncClient, base_url: str, body: dict) -> tuple[float, float, int, str | None]:
    """(time to first token s, finish time, generated tokens, the error event's message or None) of one
    streaming completion: a server that fails a request after its 200 says so in the stream.  RequestFailed for
    a status other than 200."""
    sent = time.perf_counter()
    first, chunks, usage, error = None, 0, None, None
    async with http.stream("POST", f"{base_url}/completions", json=body) as response:
        if response.status_code != 200:
            raise RequestFailed(response.status_code, (await response.aread()).decode(errors="replace"))
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


def completion_body(model: str, prompt, max_tokens: int, sampling: dict | None = None) -> dict:
    """A streamed completion of exactly max_tokens tokens: greedy, or with `sampling`'s fields (temperature,
    top_p, seed, ...)."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **(sampling or {})}


def sampling_fields(temperature: float, index: int) -> dict | None:
    """A staggered request's sampling: None (greedy) at temperature 0, else that temperature, top_p 0.95 and
    the request's index as its seed (the same draws for every server that honours seeds)."""
    return None if temperature <= 0 else {"temperature": temperature, "top_p": 0.95, "seed": index}


@dataclass(frozen=True)
class Planned:
    arrival_s: float            # from the start of the run
    prompt: list[int]
    max_tokens: int
    index: int = 0              # its place in the plan (a sampled request's seed)


def plan_requests(count: int, vocab: int, prompt_range: tuple[int, int], new_range: tuple[int, int],
                  rate_per_s: float, seed: int) -> list[Planned]:
    rng = np.random.default_rng(seed)
    low, high = prompt_range
    lengths = np.exp(rng.uniform(np.log(low), np.log(high + 1), count)).astype(int).clip(low, high)
    news = rng.integers(new_range[0], new_range[1] + 1, count)
    gaps = rng.exponential(1.0 / rate_per_s, count)
    arrivals = np.cumsum(gaps) - gaps[0]            # the first arrives at once
    return [Planned(float(t), rng.integers(0, vocab, int(n)).tolist(), int(m), i)
            for i, (t, n, m) in enumerate(zip(arrivals, lengths, news))]


@dataclass
class Outcome:
    planned: Planned
    kind: str = "lost"          # "completed" | "refused" | "lost"
    sent_s: float = 0.0         # perf_counter at sending
    ttft_s: float = float("nan")
    finished_s: float = 0.0
    tokens: int = 0
    error: str = ""


async def staggered(base_url: str, model: str, planned: list[Planned], clients: int, headers: dict,
                    timeout_s: float, started: float | None = None,
                    temperature: float = 0.0) -> tuple[list[Outcome], float]:
    """Every planned request's outcome, and the perf_counter the run started at (`started`: at that
    perf_counter, a time of CLOCK_MONOTONIC that every process of the machine reads alike).  temperature > 0:
    each request sampled (sampling_fields)."""
    outcomes = [Outcome(p) for p in planned]
    pending = iter(outcomes)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=headers) as http:
        if started is not None:
            await asyncio.sleep(max(started - time.perf_counter(), 0.0))
        started = time.perf_counter() if started is None else started

        async def client() -> None:
            for outcome in pending:         # one iterator shared by the clients: each request is taken once
                wait = started + outcome.planned.arrival_s - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                await send(http, base_url, model, outcome, temperature)
        await asyncio.gather(*(client() for _ in range(clients)))
    return outcomes, started


def staggered_in_processes(base_url: str, model: str, planned: list[Planned], clients: int, headers: dict,
                           timeout_s: float, processes: int, temperature: float = 0.0) -> tuple[list[Outcome], float]:
    """staggered() with the clients spread over `processes` processes, each with its own event loop (one loop
    parsing every client's stream can be the slowest part of the measurement: its delays count in each
    request's time to first token); process i takes requests i, i + P, ... with its share of the clients, all
    starting at one moment.  The outcomes in the plan's order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    if processes <= 1:
        return asyncio.run(staggered(base_url, model, planned, clients, headers, timeout_s, None, temperature))
    shares = [clients // processes + (i < clients % processes) for i in range(processes)]
    started = time.perf_counter() + 1.0 + 0.1 * processes          # every process up before the first send
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork")) as pool:
        parts = [pool.submit(run_part, base_url, model, planned[i::processes], max(shares[i], 1), headers,
                             timeout_s, started, temperature) for i in range(processes)]
        results = [part.result() for part in parts]
    outcomes: list[Outcome] = [None] * len(planned)
    for i, (part, _) in enumerate(results):
        outcomes[i::processes] = part
    return outcomes, started


def run_part(base_url, model, planned, clients, headers, timeout_s, started, temperature):
    return asyncio.run(staggered(base_url, model, planned, clients, headers, timeout_s, started, temperature))


async def send(http: httpx.AsyncClient, base_url: str, model: str, outcome: Outcome, temperature: float = 0.0) -> None:
    planned = outcome.planned
    outcome.sent_s = time.perf_counter()
    try:
        ttft_s, finished_s, tokens, error = await one_request(
            http, base_url, completion_body(model, planned.prompt, planned.max_tokens,
                                            sampling_fields(temperature, planned.index)))
    except RequestFailed as e:
        outcome.kind = "refused" if e.status in REFUSAL_STATUSES else "lost"
        outcome.error, outcome.finished_s = str(e)[:200], time.perf_counter()
        return
    except (httpx.HTTPError, OSError, ValueError) as e:        # ValueError: a chunk that is not JSON
        outcome.error, outcome.finished_s = f"{type(e).__name__}: {e}"[:200], time.perf_counter()
        return
    outcome.ttft_s, outcome.finished_s, outcome.tokens = ttft_s, finished_s, tokens
    if error is None and tokens >= planned.max_tokens:
        outcome.kind = "completed"
    else:
        outcome.error = error or f"{tokens} of {planned.max_tokens} tokens"


def summary(server: str, clients: int, outcomes: list[Outcome], started: float) -> dict:
    """One row: throughput, time to first token, and the counts of each outcome."""
    done = [o for o in outcomes if o.kind == "completed"]
    tokens = sum(o.tokens for o in done)
    end = max((o.finished_s for o in outcomes), default=started)
    ttft_ms = [o.ttft_s * 1e3 for o in done]
    return {"server": server, "workload": "staggered", "clients": clients, "requests": len(outcomes),
            "completed": len(done), "refused": sum(o.kind == "refused" for o in outcomes),
            "lost": sum(o.kind == "lost" for o in outcomes),
            "tok_s": round(tokens / (end - started), 1) if end > started else 0.0,
            "ttft_p50_ms": round(statistics.median(ttft_ms), 1) if ttft_ms else None,
            "ttft_p99_ms": round(percentile(ttft_ms, 0.99), 1) if ttft_ms else None,
            "generated_tokens": tokens, "prompt_tokens": sum(len(o.planned.prompt) for o in outcomes),
            "duration_s": round(end - started, 2),
            "error": next((o.error for o in outcomes if o.error), "")}
