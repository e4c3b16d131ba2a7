"""Decode and prefill throughput of one engine, as ``kestrel-stream bench`` reports it."""
from __future__ import annotations

import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone

import numpy as np

from kestrel_stream.run.engine import Engine


def measure(engine: Engine, prompt_len: int = 32, new_tokens: int = 64, repeats: int = 3, seed: int = 0) -> dict:
    """Median over ``repeats`` greedy generations after one warm-up (dequant caches, graph capture)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, engine.config.vocab_size, prompt_len).tolist()
    engine.generate(prompt[: min(4, prompt_len)], min(4, new_tokens))
    runs = [engine.generate(prompt, new_tokens) for _ in range(repeats)]
    decode = statistics.median(r.decode_tok_s for r in runs)
    prefill = statistics.median(r.prefill_tok_s for r in runs)
    last = runs[-1].stats
    return {
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "prefill_tok_s": round(prefill, 2),
        "decode_tok_s": round(decode, 2),
        "ms_per_token": round(1000.0 / decode, 3) if decode else None,
        "syncs_per_token": last.get("syncs_per_token", 0.0),
        "launches_per_token": last.get("launches_per_token", 0.0),
        "device": engine.device,
        "mode": engine.mode,
    }


def environment() -> dict:
    """Date, machine and commit for a result file."""
    import os
    # a copy of the tree without (or with a stale) .git, as on the GPU machine, names its commit
    # through KESTREL_COMMIT, which wins over what git says
    commit = os.environ.get("KESTREL_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
    commit = commit or "unknown"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {cores} cores".strip(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "commit": commit,
        "unix_time": int(time.time()),
    }
