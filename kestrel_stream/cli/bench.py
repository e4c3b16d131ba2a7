"""Decode and prefill throughput of one engine, as ``kestrel-stream bench`` reports it."""
from __future__ import annotations

import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np

from kestrel_stream.cli.args import bars_shown
from kestrel_stream.options import Environment
from kestrel_stream.run.engine import Engine


def measure(engine: Engine, prompt_len: int = 32, new_tokens: int = 64, repeats: int = 3, seed: int = 0,
            on_run: Callable[[], None] | None = None) -> dict:
    """Median over ``repeats`` greedy generations after one warm-up (dequant caches, graph capture);
    ``on_run`` is called after each generation, the warm-up included."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, engine.config.vocab_size, prompt_len).tolist()
    runs = []
    for i in range(repeats + 1):
        result = engine.generate(prompt[: min(4, prompt_len)], min(4, new_tokens)) if i == 0 else \
            engine.generate(prompt, new_tokens)
        if i:
            runs.append(result)
        if on_run is not None:
            on_run()
    decode = statistics.median(r.decode_tok_s for r in runs)
    prefill = statistics.median(r.prefill_tok_s for r in runs)
    return {"prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
            **speeds(engine, prefill, decode, runs[-1].stats)}


def speeds(engine: Engine, prefill_tok_s: float, decode_tok_s: float, stats: dict) -> dict:
    """The speed fields of `generate --json` and `bench --json`; `stats`: a GenerateResult's."""
    return {
        "prefill_tok_s": round(prefill_tok_s, 2),
        "decode_tok_s": round(decode_tok_s, 2),
        "ms_per_token": round(1000.0 / decode_tok_s, 3) if decode_tok_s else None,
        "syncs_per_token": stats.get("syncs_per_token", 0.0),
        "launches_per_token": stats.get("launches_per_token", 0.0),
        "mode": engine.mode,
        "device": engine.device,
    }


def environment(settings: Environment | None = None) -> dict:
    """Date, machine and commit for a result file; `settings`: the process's Environment (read here when None)."""
    import os
    settings = Environment.from_env() if settings is None else settings
    # a copy of the tree without (or with a stale) .git, as on the GPU machine, names its commit
    # through KESTREL_COMMIT, which wins over what git says
    commit = settings.commit or source_commit() or "unknown"
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


def source_commit() -> str:
    """The short commit of the git checkout this package runs from ("" when installed elsewhere, or no git):
    asked of the package's own directory, not the working directory the command runs in."""
    package = Path(__file__).resolve().parents[1]
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(package), *args], capture_output=True, text=True,
                                  timeout=5).stdout.strip()
        top = git("rev-parse", "--show-toplevel")
        if not top or Path(top).resolve() != package.parent:     # e.g. site-packages inside some other repo
            return ""
        return git("rev-parse", "--short", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return ""


def preset_checkpoint(preset: str) -> Path:
    """The cached random checkpoint of ``preset``; written on first use, saying where and how big."""
    from tqdm import tqdm
    from kestrel_stream.loading.presets import PRESETS, ensure_preset, preset_dir
    from kestrel_stream.model.weights import hf_tensor_shapes
    out_dir = preset_dir(preset)
    if (out_dir / "config.json").exists():
        print(f"bench: using the random {preset} checkpoint in {out_dir}", file=sys.stderr)
        return out_dir
    sizes = {name: 2 * int(np.prod(shape)) for name, shape in hf_tensor_shapes(PRESETS[preset]).items()}  # bf16
    total = sum(sizes.values())
    print(f"bench: writing a random {preset} checkpoint ({total / 1e9:.2f} GB, bf16) to {out_dir} "
          f"(once; later runs reuse it)", file=sys.stderr)
    with tqdm(total=total, desc=f"writing {preset}", unit="B", unit_scale=True, delay=0.5, file=sys.stderr,
              leave=False, disable=not bars_shown()) as bar:
        return ensure_preset(preset, on_tensor=lambda name: bar.update(sizes[name]))


def measure_bar(repeats: int):
    """A bar over the warm-up and the measured runs (shown when they take a moment)."""
    from tqdm import tqdm
    return tqdm(total=repeats + 1, desc="measuring (warm-up + runs)", unit="run", delay=0.5, file=sys.stderr,
                leave=False, disable=not bars_shown())
