"""What a staggered HTTP run leaves beside its rows (bench/http_serve.py with --out): each request as the client
saw it, our daemon's log, and with --trace the daemon's trace of the run -- what a TTFT percentile is made of, by
prompt length, by time and by what the step thread did meanwhile."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path


def traced(args, log_path: Path | None, server: str, clients: int):
    """With --trace and --out, on our daemon (its socket beside `log_path`): a trace started over the socket,
    and the function that stops it and copies its file into --out; else None."""
    if not (args.trace and args.out and log_path is not None and server == "kestrel-stream"):
        return None
    from kestrel_stream.client.sync import connect
    client = connect(str(log_path.parent / "ks.sock"))
    name = f"trace-{args.label or 'run'}-c{clients}.json.gz"
    client.trace_start(name)

    def stop() -> None:
        try:
            written = client.trace_stop()
        finally:
            client.close()
        if written:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(written, Path(args.out) / name)
    return stop


def save_requests(args, server: str, clients: int, outcomes: list, started: float, log_path: Path | None) -> None:
    """With --out: each request of a staggered run as the client saw it (its arrival, prompt and max tokens, what
    became of it, TTFT and end, ms from the run's start), a JSON line each, and our daemon's log beside (its
    access lines give each completion's queue and app-side TTFT): what a TTFT percentile is made of, by prompt
    length and by time, written as soon as the run ends."""
    if not args.out:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "-".join(["requests", args.label or "run", re.sub(r"[^A-Za-z0-9.-]+", "_", server), f"c{clients}"])
    with open(out / f"{stem}.jsonl", "w") as f:
        for o in outcomes:
            f.write(json.dumps({"index": o.planned.index, "arrival_ms": round(o.planned.arrival_s * 1e3, 2),
                                "prompt_tokens": len(o.planned.prompt), "max_tokens": o.planned.max_tokens,
                                "kind": o.kind, "sent_ms": round((o.sent_s - started) * 1e3, 2) if o.sent_s else None,
                                "ttft_ms": round(o.ttft_s * 1e3, 2) if o.ttft_s == o.ttft_s else None,
                                "finished_ms": round((o.finished_s - started) * 1e3, 2) if o.finished_s else None,
                                "tokens": o.tokens, "error": o.error}) + "\n")
    if log_path is not None and log_path.exists():
        shutil.copyfile(log_path, out / f"{stem}-daemon.log")
