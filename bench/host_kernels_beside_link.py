"""The host kernels' rate at steps of a few tokens alone and while pinned H2D copies stream (a mixed step's host
items run beside the weight ring's copies): calibrate measures the joint rate with one token of Q8_0 alone, and
prices a step's compute-bound host work by the curves measured alone.

    python3 -m bench.host_kernels_beside_link [--tokens 1,4,16] [--formats Q8_0,Q4_K,Q6_K] [--seconds 0.4]

Per format and token count: the weight bytes/s over weights far larger than the caches (calibrate's), alone and
with a second thread keeping pinned copies of up to 256 MB queued (calibrate.LinkCopies, measure_pool's copier), and the copies' GB/s
meanwhile.  Needs a GPU.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,4,16")
    parser.add_argument("--formats", default="Q8_0,Q4_K,Q6_K")
    parser.add_argument("--seconds", type=float, default=0.4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--weight-mb", type=int, default=256, help="weights a pass reads (calibrate's: 256)")
    args = parser.parse_args(argv)
    from kestrel_stream import native
    from kestrel_stream.run.calibrate import POOL_COPY_BYTES, LinkCopies, _format_weights

    kernels = native.load(None, threads=args.threads)
    link = LinkCopies(min(POOL_COPY_BYTES, args.weight_mb << 20), "h2d beside the host kernels")
    rows = []
    print(f"host kernels {kernels.path.name}:{kernels.isa}, {kernels.threads} threads")
    for fmt in args.formats.split(","):
        weights, nbytes = _format_weights(kernels, fmt, args.weight_mb << 20)
        for tokens in [int(t) for t in args.tokens.split(",")]:
            x = np.ones((tokens, weights[0].cols), np.float32)
            out = np.empty((tokens, weights[0].rows), np.float32)

            def rate() -> float:
                for w in weights[:1]:
                    kernels.matmul(x, w, out)
                start, passes = time.perf_counter(), 0
                while time.perf_counter() - start < args.seconds:
                    for w in weights:
                        kernels.matmul(x, w, out)
                    passes += 1
                return passes * nbytes / (time.perf_counter() - start) / 1e9

            alone = rate()
            joint, link_GBps = link.beside(rate)
            row = {"format": fmt, "tokens": tokens, "alone_GBps": round(alone, 2), "beside_link_GBps": round(joint, 2),
                   "ratio": round(joint / alone, 3), "link_GBps": round(link_GBps, 2)}
            rows.append(row)
            print(row, flush=True)
        weights = None          # the next format's weights in their place, not beside them
    link.close()
    return rows


if __name__ == "__main__":
    main()
