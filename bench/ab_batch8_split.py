"""Batch-8 greedy decode split into its GPU time and its host time, the same code for two source trees.

    PYTHONPATH=TREE python3 bench/ab_batch8_split.py MODEL --label L [--steps 256] [--rounds 3]

For one engine (`ks.load(MODEL, device="cuda", mode="gpu", max_seq_len=1024)`) and eight sessions
after a 128-token prompt each, per round: `decode_batch(pairs, greedy=True)` timed end to end
(ms per step), then the bucket's captured graph alone, launched and synchronized back to back
(`executor.steps._graphs[(8, True)]`: the GPU's time for the step plus one launch and one sync), and the
difference, the step's host time.  Both trees before and after the step program keep that graph
under that key.  A regression that is all in the first figure is the host's; one that moves the
second is the device's (kernels, copies, memory layout).  One JSON line on stdout.

--emulated runs it on the numpy device of tests/fake_cuda.py (a smoke test of this driver; the
figures then mean nothing).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

BATCH, PROMPT = 8, 128


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model"); p.add_argument("--label", required=True)
    p.add_argument("--steps", type=int, default=256); p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--emulated", action="store_true")
    a = p.parse_args()
    if a.emulated:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from _pytest.monkeypatch import MonkeyPatch
        import fake_cuda
        fake_cuda.install(MonkeyPatch())
    import kestrel_stream as ks
    eng = ks.load(a.model, device="cuda", mode="gpu", max_seq_len=1024)
    rng = np.random.default_rng(0)
    need = PROMPT + 3 + a.rounds * a.steps
    if need > 1024:
        raise SystemExit(f"--steps x --rounds = {a.rounds * a.steps}: past max_seq_len 1024 (at most {1024 - PROMPT - 3})")
    sessions = [eng.new_session() for _ in range(BATCH)]
    prompt = [int(t) for t in rng.integers(0, eng.config.vocab_size, PROMPT)]
    for s in sessions:
        s.prefill(prompt)
    tokens = [int(t) for t in rng.integers(0, eng.config.vocab_size, BATCH)]
    pairs = [(s, tokens[i]) for i, s in enumerate(sessions)]
    for _ in range(3):                                   # graph capture, warm-up
        eng.decode_batch(pairs, greedy=True)
    x = eng.executor
    graph = x.steps._graphs[(BATCH, True)]
    step_ms, graph_ms = [], []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        for _ in range(a.steps):
            eng.decode_batch(pairs, greedy=True)
        step_ms.append((time.perf_counter() - t0) / a.steps * 1e3)
        # the same graph again (positions do not advance: the kernels read the last step's params)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            graph.launch(x.steps.stream)
            x.steps.stream.synchronize()
        graph_ms.append((time.perf_counter() - t0) / a.steps * 1e3)
    step, replay = statistics.median(step_ms), statistics.median(graph_ms)
    print(json.dumps({"label": a.label, "batch": BATCH, "steps": a.steps, "rounds": a.rounds,
                      "step_ms": round(step, 4), "graph_replay_ms": round(replay, 4),
                      "host_ms": round(step - replay, 4), "tok_s": round(BATCH / step * 1e3, 1),
                      "step_ms_rounds": [round(v, 4) for v in step_ms],
                      "graph_replay_ms_rounds": [round(v, 4) for v in graph_ms]}))
    for s in sessions:
        s.close()
    eng.close()


if __name__ == "__main__":
    main()
