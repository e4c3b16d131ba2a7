"""Load to first token: a fresh process imports kestrel_stream, loads a model and produces a token.

    PYTHONPATH=. python3 -m bench.load_time --model FILE.gguf|DIR [--device cuda | --emulated] [--repeats 3]
        [--baseline OTHER_TREE] [--no-bytecode] [--out DIR]

Each repeat is a new Python process (the page cache stays warm after the first, as the target
asks: load to first token with a warm page cache), timed from just before it starts to its
first greedy token (a 4-token prefill) and, separately, the first decode step (which captures
the decode graph in gpu mode).  The child reports every load stage (obs/load_stages.py: GGUF
metadata and mmap, Q8_0 split, fusion, kernels, arena, pinned images, H2D, KV pool, graph
capture); the table is the median of each over the repeats.  The tokenizer is built on first
use, after the timed token, so its row ("tokenizer (built on first use)") is what a text prompt
would add to the first request; it is not part of the total.

Before the first repeat, each tree's packages (kestrel_stream, scheduler, kernels_ptx; with
--emulated the emulator's tests/ too) are compiled to bytecode with compileall, as pip does when
it installs the package: a source tree whose processes may not write bytecode
(PYTHONDONTWRITEBYTECODE, a read-only checkout) would otherwise compile every module in every fresh
process, a cost an installed package never pays.
The report says how many files that compiled; --no-bytecode skips it.
"""
from __future__ import annotations

import argparse
import json
import os
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
engine.tokenizer                    # built on first use: its stage row is what a text prompt would add
json.dump({"to_first_token_s": first - started, "stages": load_stages.snapshot(), "device": engine.device,
           "mode": engine.mode}, sys.stdout)
"""


def child_path(tree: Path) -> str:
    """PYTHONPATH for a child loading from `tree`: the tree, then the caller's entries that hold no
    kestrel_stream of their own (where its dependencies were installed with --target, as on the device)."""
    keep = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if entry and not (Path(entry) / "kestrel_stream").is_dir()]
    return os.pathsep.join([str(tree), *keep])


def run_once(args, tree: Path) -> dict:
    """One fresh process loading from the source tree `tree` (this one, or --baseline's)."""
    started = time.time()
    env = dict(os.environ, PYTHONPATH=child_path(tree))
    proc = subprocess.run([sys.executable, "-c", CHILD, repr(started), args.model, args.device, args.mode,
                           str(args.max_seq_len), "emulated" if args.emulated else ""],
                          capture_output=True, text=True, check=False, cwd=tree, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"load_time: the child ({tree}) failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


PACKAGES = ("kestrel_stream", "scheduler", "kernels_ptx")     # what an install compiles (pyproject's packages)


def compile_bytecode(tree: Path, emulated: bool) -> str:
    """Compile the tree's packages to __pycache__ as an install does; one line saying what it did."""
    import compileall
    start = time.perf_counter()
    folders = [tree / name for name in PACKAGES + (("tests",) if emulated else ())]
    files = sum(1 for folder in folders for _ in folder.rglob("*.py"))
    if not all(compileall.compile_dir(str(folder), quiet=1) for folder in folders):
        raise SystemExit(f"load_time: compileall failed in {tree} (a syntax error?)")
    return (f"bytecode: {files} files of {', '.join(f.name for f in folders)} in {tree} compiled where stale "
            f"(compileall, as an install does) in {time.perf_counter() - start:.2f} s")


def tree_commit(tree: Path) -> str:
    proc = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def medians(runs: list[dict]) -> dict[str, float]:
    names = list(dict.fromkeys(name for r in runs for name in r["stages"]))
    out = {name: round(statistics.median(r["stages"].get(name, {"s": 0})["s"] for r in runs), 3) for name in names}
    out[TOTAL] = round(statistics.median(r["to_first_token_s"] for r in runs), 3)
    return out


TOTAL = "load to first token (process start to token)"


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
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="a source tree of another commit (e.g. a git worktree): its runs alternate with this "
                        "tree's, so both see the same machine load; the table gets a column for each")
    p.add_argument("--no-bytecode", action="store_true",
                   help="leave the trees' modules uncompiled (each fresh process then compiles what it imports)")
    args = p.parse_args()
    if args.emulated:
        args.device, args.mode = "cuda", "gpu"
    here = Path(__file__).resolve().parents[1]
    trees = {"median_s": here} if args.baseline is None else {"baseline_s": Path(args.baseline).resolve(),
                                                               "median_s": here}
    bytecode = "bytecode: not compiled first (--no-bytecode)"
    if not args.no_bytecode:
        lines = [compile_bytecode(tree, args.emulated) for tree in dict.fromkeys(trees.values())]
        bytecode = "; ".join(lines)
        print("\n".join(lines))
    runs: dict[str, list[dict]] = {column: [] for column in trees}
    for _ in range(args.repeats):
        for column, tree in trees.items():
            runs[column].append(run_once(args, tree))
    table = {column: medians(r) for column, r in runs.items()}
    names = list(dict.fromkeys(name for t in table.values() for name in t if name != TOTAL)) + [TOTAL]
    rows = [{"stage": name, **{column: table[column].get(name, "") for column in trees}} for name in names]
    for row in rows:
        print(f"{row['stage']:<52} " + " ".join(f"{row[c]:>9}" for c in trees))
    if args.out:
        from kestrel_stream.cli.bench import environment
        from .report import write_results
        last = runs["median_s"][-1]
        name = f"load-time-{Path(args.model).stem}-{last['device']}{'-emulated' if args.emulated else ''}"
        notes = (f"device {last['device']}, mode {last['mode']}, {args.repeats} fresh processes per tree, "
                 f"medians (s); the first may have read the file cold; commits: "
                 + ", ".join(f"{column} {tree_commit(tree)}" for column, tree in trees.items()) + f"; {bytecode}")
        env = environment()
        if args.baseline:
            env["baseline_commit"] = tree_commit(trees["baseline_s"])
        print(f"wrote {write_results(name, env, rows, ['stage', *trees], notes, Path(args.out))}")


if __name__ == "__main__":
    main()
