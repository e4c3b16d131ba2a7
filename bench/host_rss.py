"""The CPU engine's resident memory: the process's RSS (anonymous and file-backed pages) before loading, after
ks.load, after a prompt and after some decode steps, in one fresh process per file.

    python3 -m bench.host_rss FILE.gguf [--threads 2] [--prompt 64] [--new-tokens 16] [--json]

The weights' host bytes are the load's figure less the empty process's; a repacked weight's second copy
(the file's pages, a fused weight's concatenated blocks) shows up there (run/host/repacked.py).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def rss_mib() -> dict:
    """VmRSS, RssAnon and RssFile of this process, MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import kestrel_stream as ks
    rows = {"start": rss_mib()}         # the interpreter, numpy and the package, before any weight
    t0 = time.perf_counter()
    engine = ks.load(args.file, device="cpu", cpu_threads=args.threads, max_seq_len=args.prompt + args.new_tokens + 8)
    rows["load_s"] = round(time.perf_counter() - t0, 2)
    rows["loaded"] = rss_mib()
    ids = [int(t) for t in np.random.default_rng(0).integers(0, engine.config.vocab_size, args.prompt)]
    session = engine.new_session()
    token = int(np.argmax(session.prefill(ids, logits="last")[-1]))
    rows["prompt"] = rss_mib()
    for _ in range(args.new_tokens):
        token = session.decode_greedy(token)
    rows["decoded"] = rss_mib()
    rows["last_token"] = int(token)
    print(json.dumps(rows) if args.json else "\n".join(f"{k}: {v}" for k, v in rows.items()))


if __name__ == "__main__":
    main()
