"""Load to first token: a fresh process imports kestrel_stream, loads a model and produces a token.

    PYTHONPATH=. python3 -m bench.load_time --model FILE.gguf|DIR [--device cuda | --emulated] [--repeats 3] [--out DIR]

Each repeat is a new Python process (the page cache stays warm after the first, as the target
asks: load to first token with a warm page cache), timed from just before it starts to its
first greedy token (a 4-token prefill) and, separately, the first decode step (which captures
the decode graph in gpu mode).  The child reports every load stage (obs/load_stages.py: GGUF
metadata and mmap, Q8_0 split, fusion, kernels, arena, pinned images, H2D, KV pool, graph
capture); the table is the median of each over the repeats.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
started = float(sys.argv[1])
t = time.perf_counter()
import numpy as np
import kestrel_stream as ks
from kestrel_stream.obs import load_stages
load_stages.record("import kestrel_stream", time.perf_counter() - t)
if sys.argv[6] == "emulated":       # tests/fake_cuda.py: gpu mode's load path with no GPU (numpy kernels)
    sys.path.insert(0, "tests")
    import fake_cuda
    from _pytest.monkeypatch import MonkeyPatch
    fake_cuda.install(MonkeyPatch())
engine = ks.load(sys.argv[2], device=sys.argv[3], mode=sys.argv[4], max_seq_len=int(sys.argv[5]))
with load_stages.stage("first token (4-token prefill)"), engine.new_session() as s:
    token = int(np.argmax(s.prefill([1, 2, 3, 4])[-1]))
    first = time.time()
    with load_stages.stage("first decode step"):
        s.decode_greedy(token)
json.dump({"to_first_token_s": first - started, "stages": load_stages.snapshot(), "device": engine.device,
           "mode": engine.mode}, sys.stdout)
"""


def run_once(args) -> dict:
    started = time.time()
    proc = subprocess.run([sys.executable, "-c", CHILD, repr(started), args.model, args.device, args.mode,
                           str(args.max_seq_len), "emulated" if args.emulated else ""],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"load_time: the child failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--mode", default="auto")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--emulated", action="store_true",
                   help="gpu mode on the emulated device of tests/fake_cuda.py (load stages; kernels are numpy)")
    args = p.parse_args()
    if args.emulated:
        args.device, args.mode = "cuda", "gpu"
    runs = [run_once(args) for _ in range(args.repeats)]
    names = list(runs[-1]["stages"])
    rows = [{"stage": name, "median_s": round(statistics.median(r["stages"].get(name, {"s": 0})["s"] for r in runs), 3)}
            for name in names]
    total = statistics.median(r["to_first_token_s"] for r in runs)
    rows.append({"stage": "load to first token (process start to token)", "median_s": round(total, 3)})
    for row in rows:
        print(f"{row['stage']:<52} {row['median_s']:8.3f} s")
    if args.out:
        from kestrel_stream.cli.bench import environment
        from .report import write_results
        name = f"load-time-{Path(args.model).stem}-{runs[-1]['device']}{'-emulated' if args.emulated else ''}"
        notes = (f"device {runs[-1]['device']}, mode {runs[-1]['mode']}, {args.repeats} fresh processes, "
                 f"medians; the first may have read the file cold")
        print(f"wrote {write_results(name, environment(), rows, ['stage', 'median_s'], notes, Path(args.out))}")


if __name__ == "__main__":
    main()
