"""Batch-1 decode and the residency window on GGUF files side by side: native 4-bit blocks vs Q8_0.

    python3 -m bench.make_gguf --preset qwen3-1.7b --mix q4_k_m --vocab V.gguf -o /tmp/q17-q4km.gguf
    python3 -m bench.make_gguf --preset qwen3-1.7b --vocab V.gguf -o /tmp/q17-q8.gguf
    PYTHONPATH=. python3 -m bench.block_decode /tmp/q17-q4km.gguf /tmp/q17-q8.gguf [--out DIR]

Per file: gpu mode with every weight resident (decode tok/s at batch 1 through GpuExecutor.forward:
graph replay, one sync, logits out) and at 50 % of the weight bytes (a budget of the executor's KV
pool and activations, gpu_mode_needs, + half the weights), with the bytes streamed per step, the PCIe roofline (pinned H2D
measured here / streamed bytes) and the fraction of it reached.  x_q8_0: tok/s over the Q8_0 file's
at the same budget (the last file named Q8_0 in its types).  The llama.cpp side of the comparison is
llama-bench on the same files (`-ngl 99 -n 128 -p 0` and `-ngl <half the layers>`).
"""
from __future__ import annotations

import argparse
import os
from collections import Counter

import numpy as np

from kestrel_stream.cli.bench import environment
from kestrel_stream.cuda import driver
from kestrel_stream.loading.loader import load_weights
from kestrel_stream.run.device.budget import budget_for_weight_fraction, gpu_mode_needs
from kestrel_stream.run.compat import GpuExecutor

from .report import write_results
from .window import CHUNK, SEQ, SESSIONS, decode, measure_h2d_gb_s


def file_kind(weights) -> str:
    """The formats of a model's linear weights, most bytes first (e.g. Q4_K+Q6_K)."""
    formats = dict(weights.config.weight_formats)
    counts = Counter(formats.values()) if formats else Counter({"Q8_0": 1})
    return "+".join(kind for kind, _ in counts.most_common())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="GGUF files of one shape (bench/make_gguf.py)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default=os.environ.get("KESTREL_COMMIT"))
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--fractions", default="1.0,0.5")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    driver.Device(0)
    h2d_gb_s = measure_h2d_gb_s()
    rows = []
    for path in args.files:
        weights = load_weights(path)
        kind, config = file_kind(weights), weights.config
        needs = gpu_mode_needs(config, SESSIONS, SEQ, CHUNK, max_sessions=SESSIONS)   # what GpuExecutor takes
        for fraction in [float(f) for f in args.fractions.split(",")]:
            budget = budget_for_weight_fraction(config, needs, fraction) if fraction < 1 else None
            gpu = GpuExecutor(weights, max_seq_len=SEQ, max_batch=SESSIONS, max_sessions=SESSIONS,
                              prefill_chunk=CHUNK, vram_budget=budget)
            result = decode(gpu, 1, args.steps, rng)
            streamed = result.get("streamed_bytes", 0.0)
            roofline = h2d_gb_s * 1e9 / streamed if streamed else None
            row = {"file": os.path.basename(path), "formats": kind, "weights_pct": round(100 * fraction),
                   "weight_MB": round(weights.quantized_bytes() / 1e6, 1),
                   "resident": f"{len(gpu.steps.window.resident)}/{gpu.steps.window.total_items}",
                   "streamed_MB_per_step": round(streamed / 1e6, 1), "tok_s": round(result["tok_s"], 1),
                   "ms_per_step": round(result["ms_per_step"], 3),
                   "pcie_roofline_tok_s": round(roofline, 1) if roofline else "-",
                   "frac_roofline": round(result["tok_s"] / roofline, 3) if roofline else "-"}
            print(row, flush=True)
            rows.append(row)
            gpu.close()
    for r in rows:
        q8 = next((o["tok_s"] for o in reversed(rows) if o["formats"] == "Q8_0" and o["weights_pct"] == r["weights_pct"]),
                  None)
        r["x_q8_0"] = round(r["tok_s"] / q8, 2) if q8 else "-"
    env = environment()
    env.update(machine=driver.detect(), commit=args.commit or env["commit"], pinned_h2d_GB_s=round(h2d_gb_s, 1))
    notes = (f"Batch-1 decode through GpuExecutor.forward ({args.steps} steps after a {8}-token prompt); the 50 % "
             f"budget is KV caches + activations + half the file's weight bytes (budget_for_weight_fraction). "
             f"Pinned H2D measured here: {h2d_gb_s:.1f} GB/s; pcie_roofline_tok_s = that / streamed bytes per step.")
    path = write_results("h200-block-decode", env, rows,
                         ["file", "formats", "weights_pct", "weight_MB", "resident", "streamed_MB_per_step", "tok_s",
                          "ms_per_step", "pcie_roofline_tok_s", "frac_roofline", "x_q8_0"], notes=notes,
                         out_dir=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
