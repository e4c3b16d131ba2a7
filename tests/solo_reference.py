"""Greedy tokens of sessions run one at a time in process: the reference a daemon test compares with.

Run as a script (``python solo_reference.py MODEL MAX_SEQ_LEN`` with a JSON list of runs on stdin, each a
list of steps: ``["prefill", ids]`` or ``["decode", count]``) so that BLAS runs single-threaded beside the
test: this VM's two cores make a multi-threaded BLAS many times slower on the tiny model's small matrices.
Prints, per run, every token the run yields in order (a prefill yields its last row's argmax, a decode of
count n yields n tokens, each fed the one before); ``--logits OUT.npy`` also saves the first prefill's logits.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ENV_ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_alone(engine, steps: list, logits_out: list | None = None) -> list[int]:
    tokens: list[int] = []
    with engine.new_session() as s:
        for kind, arg in steps:
            if kind == "prefill":
                logits = s.prefill(np.asarray(arg, np.int64))
                if logits_out is not None and not logits_out:
                    logits_out.append(logits)
                tokens.append(int(np.argmax(logits[-1])))
            else:
                for _ in range(arg):
                    tokens.append(int(np.argmax(s.decode(tokens[-1]))))
    return tokens


def solo_runs(model, max_seq_len: int, runs: list, logits_path: Path | None = None) -> list[list[int]]:
    """Every run's tokens, computed in a single-threaded subprocess."""
    import os
    args = [sys.executable, __file__, str(model), str(max_seq_len)]
    if logits_path is not None:
        args += ["--logits", str(logits_path)]
    out = subprocess.run(args, input=json.dumps(runs), capture_output=True, text=True, check=True,
                         env={**os.environ, **ENV_ONE_THREAD, "PYTHONPATH": str(Path(__file__).parents[1])})
    return json.loads(out.stdout)


def main() -> None:
    import kestrel_stream as ks
    model, max_seq_len = sys.argv[1], int(sys.argv[2])
    logits_path = Path(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[3] == "--logits" else None
    engine = ks.load(model, device="cpu", max_seq_len=max_seq_len)
    results = []
    for i, steps in enumerate(json.load(sys.stdin)):
        logits = [] if i == 0 and logits_path is not None else None
        results.append(run_alone(engine, steps, logits))
        if logits:
            np.save(logits_path, logits[0])
    print(json.dumps(results))


if __name__ == "__main__":
    main()
