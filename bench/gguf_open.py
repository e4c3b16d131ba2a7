"""Opening a GGUF without its tokenizer: header, tensor descriptors and the model config, in fresh processes.

    PYTHONPATH=. python3 -m bench.gguf_open --model FILE.gguf [--repeats 7] [--reader ours|gguf] [--out DIR]

Each repeat is a new Python process (warm page cache after the first).  The child imports the reader
first (that import is reported on its own row), then times ``open_gguf`` plus ``config_from_metadata``
(what ``ks.load`` reads before any weight) and one non-array key; the tokenizer's arrays stay unread.
``--reader gguf`` times gguf's own ``GGUFReader`` on the same file instead, which parses every array.
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
started = time.perf_counter()
if sys.argv[2] == "gguf":
    from gguf import GGUFReader
    imported = time.perf_counter()
    reader = GGUFReader(sys.argv[1])
    arch = reader.get_field("general.architecture").contents()
else:
    from kestrel_stream.loading.gguf import config_from_metadata, open_gguf
    imported = time.perf_counter()
    f = open_gguf(sys.argv[1])
    arch = config_from_metadata(f).arch
opened = time.perf_counter()
json.dump({"import_s": imported - started, "open_s": opened - imported, "arch": arch}, sys.stdout)
"""


def run_once(model: str, reader: str) -> dict:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, model, reader], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"gguf_open: the child failed:\n{proc.stderr[-4000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - started}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--reader", choices=("ours", "gguf"), default="ours")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    runs = [run_once(args.model, args.reader) for _ in range(args.repeats)]
    rows = []
    for key, what in (("open_s", "open + config (no tokenizer)"), ("import_s", "import of the reader"),
                      ("process_s", "whole process")):
        values = [r[key] for r in runs]
        rows.append({"stage": what, "median_s": round(statistics.median(values), 4),
                     "min_s": round(min(values), 4), "max_s": round(max(values), 4)})
    for row in rows:
        print(f"{row['stage']:<32} median {row['median_s']:.4f} s  (min {row['min_s']:.4f}, max {row['max_s']:.4f})")
    if args.out:
        from kestrel_stream.cli.bench import environment
        from .report import write_results
        size_mb = Path(args.model).stat().st_size / 1e6
        notes = (f"`{Path(args.model).name}` ({size_mb:.1f} MB, arch {runs[-1]['arch']}), reader {args.reader}, "
                 f"{args.repeats} fresh processes, warm page cache; seconds")
        name = f"gguf-open-{Path(args.model).stem}-{args.reader}"
        print(f"wrote {write_results(name, environment(), rows, ['stage', 'median_s', 'min_s', 'max_s'], notes, Path(args.out))}")


if __name__ == "__main__":
    main()
