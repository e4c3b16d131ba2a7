"""Trace decode steps of a GPU mode on the device: the trace, its HTML timeline, a PNG screenshot.

    PYTHONPATH=. python3 -m bench.trace_gpu [--preset qwen3-1.7b] [--modes gated] [--steps 8]
                                            [--vram-budget BYTES] [--out DIR]
    PYTHONPATH=. python3 -m bench.trace_gpu --png-only --out DIR     # screenshots of DIR's timelines

The device layer traces itself (kestrel_stream/cuda/driver.py, device_trace.py):
this only turns tracing on around `--steps` decode steps, after a prefill and
warm-up steps (graph capture, launch lists, plans), and renders the result.
Weights are random Q8_0 of the preset's real shapes (bench/synthetic.py random_q8_weights);
`--vram-budget` is handed to the engine (window mode: gpu with a small budget).
The screenshot needs headless Chromium; where it is absent (the device
machine) `--png-only` makes the PNGs later from the HTML files.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from kestrel_stream.obs import timeline
from kestrel_stream.obs import trace
from kestrel_stream.cuda import driver
from kestrel_stream.run.engine import Engine
from bench.synthetic import random_q8_weights

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def trace_mode(weights, preset: str, mode: str, steps: int, out_dir: Path, vram_budget: str | None,
               tag: str) -> Path:
    # one session at batch 1: the arena holds two KV caches, so a small budget goes to weights
    engine = Engine(weights, device="cuda", mode=mode, max_seq_len=256, max_batch=1, max_sessions=1,
                    vram_budget=vram_budget)
    try:
        session = engine.new_session()
        session.prefill(list(range(1, 17)))
        token = 1
        for _ in range(4):                      # warm-up: graph capture, launch lists, plans
            token = int(np.argmax(session.decode(token)))
        trace.start(out_dir / f"trace-{tag}-{preset}.json.gz", preset=preset, mode=mode, gpu=driver.detect(),
                    vram_budget=vram_budget, weights="random Q8_0")
        for _ in range(steps):
            token = int(np.argmax(session.decode(token)))
        return trace.stop()
    finally:
        engine.close()


def screenshot(html: Path, png: Path) -> bool:
    """A 1400x800 headless-Chromium screenshot of `html`; False where Chromium is absent."""
    chromium = next((shutil.which(n) for n in CHROMIUM_NAMES if shutil.which(n)), None)
    if chromium is None:
        return False
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={profile}", f"--screenshot={png.resolve()}", "--window-size=1400,800",
                        f"file://{html.resolve()}"], capture_output=True, timeout=120)
    return png.exists()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--modes", default="gated", help="comma-separated engine modes (gated, gpu, layers=N)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--vram-budget", default=None,
                        help="the engine's device memory (2GiB, 1500MB, bytes); with mode gpu, a budget too small "
                             "for the weights streams them through a window")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--png-only", action="store_true", help="only screenshot every trace-*.html in --out")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.png_only:
        for html in sorted(out_dir.glob("trace-*.html")):
            print(f"{html.with_suffix('.png')}: {'written' if screenshot(html, html.with_suffix('.png')) else 'no Chromium'}")
        return
    weights = random_q8_weights(args.preset)
    for mode in args.modes.split(","):
        tag = mode.replace("=", "") + ("-window" if args.vram_budget else "")
        path = trace_mode(weights, args.preset, mode, args.steps, out_dir, args.vram_budget, tag)
        html_path = out_dir / f"trace-{tag}-{args.preset}.html"
        html, summary = timeline.run(str(path), str(html_path), None)
        html_path.with_suffix(".summary.txt").write_text(summary + "\n")
        shot = screenshot(html, html_path.with_suffix(".png"))
        print(f"== {mode}: {path}, {html}{'' if shot else ' (no Chromium: run again with --png-only)'}\n"
              f"{summary}\n", flush=True)


if __name__ == "__main__":
    main()
