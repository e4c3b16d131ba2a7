"""Daemon cost: client-observed latency per decode step vs in-process, and tok/s with concurrent clients.

    python3 -m bench.daemon_latency [--preset tiny | --model PATH] [--device cpu] [--mode auto]
                                    [--steps 1000] [--clients 1,4,16,32] [--tokens 200] [--out DIR] [--label NAME]
                                    [--repeat N] [--daemon LABEL=DIR ...]
    # on the H200:  python3 -m bench.daemon_latency --preset qwen3-1.7b --device cuda --mode gpu --label h200

Rows: one `latency` row per transport payload (`want=logits`: the full
[vocab] row, `want=token`: 4 bytes) with the median µs per step in process,
through the daemon, and the difference (the daemon's overhead), per run
(``--repeat``: each run starts a new daemon; ``latency-median`` rows give the
median over runs and the range) and per daemon build (``--daemon``: another
source tree's daemon, measured in turns with this one); one
`throughput` row per (clients, batching) with aggregate decode tok/s.  The
load generator is one anyio loop of AsyncClients in this process, so at high
client counts it competes with the daemon for the same cores.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

# One BLAS thread, as the daemon's tests run it: set before numpy loads (here and in the daemon it starts).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import anyio  # noqa: E402
import numpy as np  # noqa: E402

import kestrel_stream as ks  # noqa: E402
from kestrel_stream.cli.bench import environment  # noqa: E402
from kestrel_stream.loading.presets import ensure_preset  # noqa: E402

from . import daemons  # noqa: E402
from .daemons import add_daemon_args, client_counts, clients_round, result_name, stop_daemon  # noqa: E402
from .report import write_results  # noqa: E402

PROMPT = [1, 2, 3, 4]


def start_daemon(model, args, socket_path: Path, max_batch: int, source: str | None = None):
    """`kestrel-stream serve` on socket_path; ``source``: run the package from that source tree instead."""
    proc, _ = daemons.start_daemon(model, socket_path.with_suffix(f".b{max_batch}.log"), "--device", args.device,
                                   "--mode", args.mode, "--socket", str(socket_path), "--max-batch", str(max_batch),
                                   "--max-sessions", str(max(args.client_counts, default=1) + 4),
                                   "--max-seq-len", str(args.max_seq_len), source=source)
    return proc


def parse_daemon_sources(parser, specs: list[str]) -> list[tuple[str, str]]:
    """``--daemon LABEL=DIR`` options as (label, absolute source dir)."""
    daemons = []
    for spec in specs:
        label, _, source = spec.partition("=")
        if not label or not (Path(source) / "kestrel_stream").is_dir():
            parser.error(f"--daemon {spec!r}: expected LABEL=DIR with DIR/kestrel_stream in it")
        daemons.append((label, str(Path(source).resolve())))
    return daemons


BLOCK = 20              # calls of one kind in a row; kinds take turns block by block
BLOCK_WARMUP = 2        # the first calls of a block are dropped: the other side was idle for a whole block


def latency_rows(engine, model, args, socket_path: Path, source: str | None = None) -> list[dict]:
    """Per-step µs of the same decode in this process and through the daemon, interleaved in blocks.

    Kinds take turns in blocks of BLOCK calls (rotating which goes first), so
    drift and other load on the host reach every kind alike while each block
    still measures back-to-back steps, as a client decoding in a loop sees
    them; the first round is warm-up and dropped, medians over the rest.
    Daemon decodes alternate want=logits and want=token within a block.
    Sessions restart (reset + 4-token prefill, untimed) before they fill up.
    ``source``: the daemon runs from that source tree (a --daemon variant)."""
    proc = start_daemon(model, args, socket_path, max_batch=args.max_batch, source=source)
    local = engine.new_session()
    samples_us = {"inproc": [], "logits": [], "token": [], "stats": []}
    by_round: list[dict] = []           # each kept round's samples per label, for the paired estimate
    try:
        with ks.Client(str(socket_path)) as client, client.new_session() as remote:
            def inproc(token: int) -> str:
                local.decode(token)
                return "inproc"

            def daemon(token: int) -> str:
                want = ("logits", "token")[token % 2]
                remote.decode(token, want=want)
                return want

            def stats(token: int) -> str:
                client.stats()
                return "stats"

            calls = {"inproc": inproc, "daemon": daemon, "stats": stats}
            kinds = list(calls)
            rounds = max(args.steps // BLOCK, 2)
            for round_index in range(rounds):
                if round_index == 1:
                    before = client.stats()         # the engine time of the kept rounds' steps
                this_round = {label: [] for label in samples_us}
                by_round.append(this_round)
                for kind in kinds[round_index % 3:] + kinds[:round_index % 3]:
                    for i in range(BLOCK):
                        if local.position + 1 >= args.max_seq_len or round_index == i == 0:
                            local.reset()
                            local.prefill(PROMPT)
                        if remote.position + 1 >= args.max_seq_len or round_index == i == 0:
                            remote.reset()
                            remote.prefill(PROMPT, want="token")
                        t0 = time.perf_counter()
                        label = calls[kind]((round_index * BLOCK + i) % 200 + 1)
                        elapsed_us = (time.perf_counter() - t0) * 1e6
                        if round_index and i >= BLOCK_WARMUP:
                            samples_us[label].append(elapsed_us)
                            this_round[label].append(elapsed_us)
            after = client.stats()
    finally:
        local.close()
        stop_daemon(proc)
    steps = after["decode_steps"] - before["decode_steps"]
    daemon_step_us = (after["decode_step_s"] - before["decode_step_s"]) / max(steps, 1) * 1e6
    inproc_median, stats_median = statistics.median(samples_us["inproc"]), statistics.median(samples_us["stats"])
    rows = []
    for want in ("logits", "token"):
        remote_median = statistics.median(samples_us[want])
        # Paired: each round's daemon block against the in-process block of the same round (the host's drift
        # between rounds cancels), then the median over rounds.
        paired = statistics.median(statistics.median(r[want]) - statistics.median(r["inproc"])
                                   for r in by_round[1:] if r[want] and r["inproc"])
        rows.append({"kind": "latency", "want": want, "inproc_us": round(inproc_median, 1),
                     "daemon_us": round(remote_median, 1), "overhead_us": round(remote_median - inproc_median, 1),
                     "paired_overhead_us": round(paired, 1),
                     "daemon_p90_us": round(float(np.percentile(samples_us[want], 90)), 1),
                     "daemon_step_us": round(daemon_step_us, 1), "stats_rtt_us": round(stats_median, 1)})
    return rows


def repeated_latency_rows(engine, model, args, socket_path: Path) -> list[dict]:
    """latency_rows --repeat times for each daemon build, each run with a newly started daemon, builds taking
    turns; then per build and payload the median over runs (kind ``latency-median``).

    A daemon's threads land on some cores of a shared host and stay there for
    the run, so one run's figure carries that placement; a fresh daemon per
    run and the median over runs average it out."""
    builds = [("this", None), *args.daemons]
    rows = []
    for run in range(args.repeat):
        for label, source in builds:
            for row in latency_rows(engine, model, args, socket_path, source):
                rows.append({**row, "daemon": label, "run": run + 1})
                print(rows[-1], flush=True)
    if args.repeat > 1:
        for label, _ in builds:
            for want in ("logits", "token"):
                runs = [r for r in rows if r["daemon"] == label and r["want"] == want and r["kind"] == "latency"]
                summary = {"kind": "latency-median", "want": want, "daemon": label, "run": f"{len(runs)} runs",
                           **{key: round(statistics.median(r[key] for r in runs), 1)
                              for key in ("inproc_us", "daemon_us", "overhead_us", "paired_overhead_us",
                                          "daemon_p90_us", "daemon_step_us", "stats_rtt_us")},
                           "overhead_range_us": f"{min(r['overhead_us'] for r in runs):.0f}.."
                                                f"{max(r['overhead_us'] for r in runs):.0f}"}
                rows.append(summary)
                print(summary, flush=True)
    return rows


async def aggregate_tok_s(socket_path: Path, clients: int, tokens: int) -> float:
    """Decode tok/s of ``clients`` sessions together, timed once every one has prefilled its prompt."""
    prompts = [[i % 7 + 1, 2, 3] for i in range(clients)]
    return (await clients_round(socket_path, prompts, tokens, prefill_first=True))["tok_s"]


def throughput_rows(model, args, socket_path: Path) -> list[dict]:
    rows = []
    for batching, max_batch in (("on", args.max_batch), ("off", 1)):
        proc = start_daemon(model, args, socket_path, max_batch=max_batch)
        try:
            anyio.run(aggregate_tok_s, socket_path, 1, 5)         # warm-up
            with ks.Client(str(socket_path)) as watcher:
                for clients in args.client_counts:
                    before = watcher.stats()
                    tok_s = anyio.run(aggregate_tok_s, socket_path, clients, args.tokens)
                    after = watcher.stats()
                    steps = after["batches"] - before["batches"]
                    mean_batch = (after["batched_requests"] - before["batched_requests"]) / max(steps, 1)
                    rows.append({"kind": "throughput", "clients": clients, "batching": batching,
                                 "tok_s": round(tok_s, 1), "mean_batch": round(mean_batch, 2)})
                    print(rows[-1], flush=True)
        finally:
            stop_daemon(proc)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    add_daemon_args(parser, clients="1,4,16,32")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=200, help="decode steps per client in the throughput runs")
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=1,
                        help="latency runs, each with a newly started daemon; medians over runs are added")
    parser.add_argument("--daemon", action="append", default=[], metavar="LABEL=DIR", dest="daemon_sources",
                        help="also measure the latency of the daemon served from source tree DIR, in turns")
    args = parser.parse_args()
    args.client_counts = client_counts(parser, args)
    args.daemons = parse_daemon_sources(parser, args.daemon_sources)
    model = args.model or ensure_preset(args.preset)
    engine = ks.load(model, device=args.device, mode=args.mode, max_seq_len=args.max_seq_len)
    device, mode = engine.device, engine.mode
    with tempfile.TemporaryDirectory(prefix="kestrel-bench-") as tmp:
        socket_path = Path(tmp) / "ks.sock"
        rows = repeated_latency_rows(engine, model, args, socket_path)
        engine.close()              # the daemon gets the device to itself for the throughput runs
        rows += throughput_rows(model, args, socket_path) if args.client_counts else []
    env = environment()
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "unset")
    path = write_results(result_name("daemon-latency", args, device, mode), env, [{"device": device, "mode": mode, **row} for row in rows],
                         ["kind", "device", "mode", "daemon", "run", "want", "inproc_us", "daemon_us", "overhead_us", "paired_overhead_us",
                          "daemon_p90_us", "daemon_step_us", "stats_rtt_us", "overhead_range_us", "clients", "batching", "tok_s", "mean_batch"], out_dir=args.out,
                         notes=f"Unix socket; OPENBLAS_NUM_THREADS={blas}; {os.cpu_count()} cores. Latency: "
                               f"in-process decodes, daemon decodes (want logits and token alternating) and "
                               f"stats round trips take turns in blocks of {BLOCK} calls, {args.steps} calls "
                               f"of each kind; medians without the first round and the first "
                               f"{BLOCK_WARMUP} calls of each block. overhead_us = daemon_us - inproc_us (the "
                               f"same decode in this process vs through the daemon); paired_overhead_us = the "
                               f"median over rounds of each round's daemon block median minus the same round's "
                               f"in-process block median (drift between rounds cancels); daemon_step_us = mean "
                               f"engine time of those decode steps inside the daemon; stats_rtt_us = a round "
                               f"trip with no engine work. {args.repeat} run(s), each with a newly started "
                               f"daemon; latency-median rows: medians over runs, with the range of "
                               f"overhead_us. Throughput: "
                               f"{args.tokens} greedy decode steps per client after all clients prefilled; "
                               f"batching off = --max-batch 1.")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
