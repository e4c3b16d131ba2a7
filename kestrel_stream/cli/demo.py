"""``kestrel-stream demo``: the README's first command, the main job end to end.

Makes the tiny model if missing, starts the scheduler daemon on a temporary
Unix socket (CPU engine without a GPU), submits decode steps from a Python
client -- two sessions stepping concurrently, so the daemon batches them --
while tracing, writes the trace and its HTML timeline, stops the daemon, and
prints what it did and where the files are.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


def start_daemon(model_dir: Path, socket_path: Path, device: str, log_path: Path,
                 trace_dir: Path) -> subprocess.Popen:
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "kestrel_stream", "serve", "--model", str(model_dir),
                             "--socket", str(socket_path), "--device", device, "--trace-dir", str(trace_dir)],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not socket_path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the daemon did not start; its log: {log_path}\n{log_path.read_text()}")
        time.sleep(0.05)
    return proc


def stop_daemon(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def client_steps(socket_path: Path, prompt: list[int], steps: int, out: dict, key: str) -> None:
    """One client: a session, a prefill, then greedy decode steps that ask only for the token."""
    import kestrel_stream as ks
    with ks.Client(str(socket_path)) as client, client.new_session() as session:
        token = int(np.argmax(session.prefill(prompt)[-1]))
        tokens = [token]
        for _ in range(steps - 1):
            token = int(session.decode(token, want="token"))
            tokens.append(token)
        out[key] = tokens


def run_demo(args) -> int:
    import kestrel_stream as ks
    from kestrel_stream.obs import timeline
    from kestrel_stream.loading.presets import cache_root, make_model
    from kestrel_stream.text.tokenizer import load_tokenizer

    base = Path(args.dir) if args.dir else cache_root() / "demo"
    model_dir = base / "tiny"
    if not (model_dir / "config.json").exists():
        make_model(model_dir, "tiny", seed=0)
        print(f"made the tiny model (random Qwen3 weights) in {model_dir}")
    else:
        print(f"using the tiny model in {model_dir}")

    trace_path, html_path, log_path = base / "demo-trace.json.gz", base / "demo-timeline.html", base / "daemon.log"
    with tempfile.TemporaryDirectory(prefix="kestrel-demo-") as runtime:
        socket_path = Path(runtime) / "kestrel.sock"
        started = time.perf_counter()
        trace_path.unlink(missing_ok=True)         # the daemon never replaces a trace; this one is the demo's own
        daemon = start_daemon(model_dir, socket_path, args.device, log_path, trace_path.parent)
        print(f"daemon pid {daemon.pid} listening on {socket_path} (mode {oct(socket_path.stat().st_mode & 0o777)}), "
              f"up in {time.perf_counter() - started:.1f} s")
        try:
            with ks.Client(str(socket_path)) as client:
                client.trace_start(trace_path.name)
                results: dict = {}
                threads = [threading.Thread(target=client_steps, args=(socket_path, prompt, 12, results, name))
                           for name, prompt in (("A", [1, 2, 3]), ("B", [9, 10]))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                generated = client.generate([5, 6, 7], 8)
                stats = client.stats()
                written = client.trace_stop()
        finally:
            code = stop_daemon(daemon)
    for name in sorted(results):
        print(f"session {name}: 12 greedy tokens, decode steps asking only for the token: {results[name]}")
    print(f"server-side generate [5, 6, 7] → {generated}")
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is not None:          # random weights: the bytes are noise, but they decode as text
        print(f"  as text: {tokenizer.decode(generated)!r}")
    interesting = {k: stats[k] for k in ("device", "mode", "requests", "decode_steps", "batches", "mean_batch",
                                         "generated_tokens", "errors") if k in stats}
    interesting["executor steps"] = stats.get("counters", {}).get("steps")
    print(f"daemon stats: {interesting}")
    print(batching_note(stats))
    print(f"daemon stopped with SIGTERM (exit code {code}); its log: {log_path}")
    html, summary = timeline.run(written or str(trace_path), str(html_path), None)
    print(summary)
    print(f"files: model {model_dir}\n       trace {written or trace_path} (Perfetto / chrome://tracing)\n"
          f"       timeline {html} (open in a browser)")
    return 0 if code == 0 else 1


def batching_note(stats: dict) -> str:
    """What mean_batch says: how often the two clients' decode steps shared one engine step."""
    batches, mean = stats.get("batches", 0), stats.get("mean_batch", 0.0)
    if not batches:
        return "batching: no decode step went through the batcher"
    return (f"batching: {batches} decode step(s) ran {stats.get('batched_requests', 0)} request(s), mean_batch "
            f"{mean} (1.0: each request alone; 2.0: both sessions in every step);\n"
            f"  a step runs alone while the other session is still in its prefill or already done, or when its "
            f"request misses the batching window (serve --batch-window-ms)")
