"""What one native host call costs beyond its work: a matmul over a tiny Q8_0 weight (16 x 256: no work to
speak of), per thread count and pool spin, back to back and after a busy gap as long as a device segment
between two host segments of a mixed step.

    python3 -m bench.host_pool [--threads 1,2,4,8,16] [--spins 100,2000] [--gap-us 250] [--calls 2000] [--out DIR]

One row per (threads, spin): the median µs of a call back to back and after the gap, and the same call with
one thread (no pool) for the Python and ctypes share.  calibrate's host_call_us is the after-gap figure at
the spin mixed steps use (run/host/pool_spin.py), over a 64 x 4096 weight (its work included).
"""
from __future__ import annotations

import argparse

import numpy as np

from kestrel_stream import native
from kestrel_stream.cli.bench import environment
from kestrel_stream.options import Options
from kestrel_stream.run.calibrate import call_after_gap_us

from .report import write_results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", default=None, help="comma list (default: 1, 2, 4, ... up to the physical cores)")
    parser.add_argument("--spins", default="100,2000")
    parser.add_argument("--gap-us", type=float, default=250.0)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cores = native.kernels.physical_cores()
    threads = ([int(t) for t in args.threads.split(",")] if args.threads
               else sorted({1 << i for i in range(cores.bit_length()) if 1 << i <= cores} | {cores}))
    rng = np.random.default_rng(0)
    qs = rng.integers(-127, 128, (16, 256), dtype=np.int8)
    scales = np.full((16, 8), 0.01, np.float16)
    rows = []
    for spin in [int(s) for s in args.spins.split(",")]:
        for n in threads:
            kernels = native.load(Options.from_env({}), threads=n)
            kernels.set_spin_us(spin)
            weight = kernels.prepare_q8_0(qs, scales)
            row = {"threads": n, "spin_us": spin, "back_to_back_us": round(call_after_gap_us(kernels, weight, args.calls, 0.0), 2),
                   "after_gap_us": round(call_after_gap_us(kernels, weight, args.calls, args.gap_us), 2), "gap_us": args.gap_us}
            print(row, flush=True)
            rows.append(row)
    if args.out:
        write_results("host-pool", environment(), rows, list(rows[0]),
                      "One native call over a 16 x 256 Q8_0 weight: median µs.", out_dir=args.out)


if __name__ == "__main__":
    main()
