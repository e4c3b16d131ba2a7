"""llama-server's load to first token, to set beside bench/load_time.py's figure for the same file.

    python3 -m bench.llama_load --server PATH/llama-server --model FILE.gguf [--repeats 3] [--out DIR]

Each repeat starts a fresh server (`-ngl 99`, one slot, 4,096 positions), polls /health until it
answers 200, and sends one /completion of a 4-token prompt for 1 token; the figure is the time from
just before the process starts to that answer (the page cache stays warm after the first repeat).
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_load(server: str, model: str, timeout_s: float) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    proc = subprocess.Popen([server, "-m", model, "-ngl", "99", "-np", "1", "-c", "4096", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{server} exited with {proc.returncode} before answering /health")
            if time.perf_counter() - started > timeout_s:
                raise TimeoutError(f"{server} not healthy after {timeout_s:.0f} s")
            try:
                with urllib.request.urlopen(base + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.02)
        healthy = time.perf_counter()
        body = json.dumps({"prompt": [1, 2, 3, 4], "n_predict": 1, "temperature": 0, "cache_prompt": False}).encode()
        request = urllib.request.Request(base + "/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            r.read()
        first = time.perf_counter()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {"healthy_s": healthy - started, "first_token_s": first - started}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", required=True, help="the llama-server binary")
    p.add_argument("--model", required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    runs = [one_load(args.server, args.model, args.timeout_s) for _ in range(args.repeats)]
    summary = {"model": args.model, "runs": runs,
               "median_first_token_s": statistics.median(r["first_token_s"] for r in runs),
               "median_healthy_s": statistics.median(r["healthy_s"] for r in runs)}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "llama-server-load.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
