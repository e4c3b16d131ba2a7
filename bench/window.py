"""`gpu` mode under VRAM budgets: the residency window on the qwen3-1.7b shape (random in-memory Q8 weights).

    PYTHONPATH=. python3 -m bench.window [--out DIR] [--commit HASH]

For budgets of 25/50/75/100% of the weight bytes (on top of the KV caches and
activations, see kestrel_stream.run.device.budget.budget_for_weight_fraction): decode tok/s
at batch 1 end to end through GpuExecutor.forward (graph replay with the copy
stream's prefetch, one sync, logits out), the PCIe roofline (pinned H2D
bandwidth measured here ÷ bytes streamed per token) and the fraction of it
achieved; copy vs compute busy ms per step from a few timed eager steps; preload
GB/s.  At the 50% budget, aggregate tok/s of 1, 4 and 16 sessions decoding
together (every step streams the same bytes, whatever the batch).
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from kestrel_stream.obs import prof
from kestrel_stream.cli.bench import environment
from kestrel_stream.run.device.budget import arena_needs, budget_for_weight_fraction
from kestrel_stream.cuda import driver
from kestrel_stream.run.compat import GpuExecutor
from bench.synthetic import random_q8_weights

from .report import write_results

SEQ, SESSIONS, CHUNK, PROMPT_LEN = 128, 16, 16, 8


def measure_h2d_gb_s(nbytes: int = 512 << 20, repeats: int = 4) -> float:
    """Pinned host → device copy bandwidth (one stream, back-to-back copies, timed with events)."""
    host, device, stream = driver.PinnedBuffer(nbytes), driver.Arena(nbytes), driver.Stream("bench h2d")
    start, stop = driver.Event(timing=True), driver.Event(timing=True)
    driver.h2d_async(device.base, host, nbytes, stream)
    start.record(stream)
    for _ in range(repeats):
        driver.h2d_async(device.base, host, nbytes, stream)
    stop.record(stream)
    stop.synchronize()
    gb_s = nbytes * repeats / (stop.elapsed_ms(start) / 1e3) / 1e9
    host.free()
    device.release()
    return gb_s


def decode(gpu: GpuExecutor, batch: int, steps: int, rng) -> dict:
    """Aggregate decode tok/s of `batch` sessions stepping together, and the stats per step."""
    sessions = [gpu.alloc_kv(SEQ) for _ in range(batch)]
    for kv in sessions:
        gpu.forward([(kv, rng.integers(0, gpu.config.vocab_size, PROMPT_LEN), 0)])
    tokens = [int(t) for t in rng.integers(0, gpu.config.vocab_size, batch)]
    step = lambda position: [(kv, np.array([t]), position) for kv, t in zip(sessions, tokens)]
    gpu.forward(step(PROMPT_LEN))                      # captures this batch's graph
    before = dict(gpu.stats)
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        gpu.forward(step(PROMPT_LEN + i))
    seconds = time.perf_counter() - t0
    for kv in sessions:
        gpu.free_kv(kv)
    delta = {k: (gpu.stats.get(k, 0) - before.get(k, 0)) / steps for k in gpu.stats}
    return dict(delta, tok_s=batch * steps / seconds, ms_per_step=seconds / steps * 1e3)


def busy_times(gpu: GpuExecutor, steps: int = 4) -> tuple[float, float, float]:
    """(copy busy, compute busy, step span) ms per step from eager steps with timing events."""
    kv = gpu.alloc_kv(SEQ)
    gpu.forward([(kv, np.arange(PROMPT_LEN), 0)])
    saved, prof.enabled = prof.enabled, True           # timing events on: streamed steps run eagerly
    try:
        before = dict(gpu.stats)
        for i in range(steps):
            gpu.forward([(kv, np.array([7]), PROMPT_LEN + i)])
    finally:
        prof.enabled = saved
    gpu.free_kv(kv)
    per_step = lambda key: round((gpu.stats.get(key, 0.0) - before.get(key, 0.0)) / steps, 3)
    return per_step("copy_busy_ms"), per_step("compute_busy_ms"), per_step("step_span_ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default=os.environ.get("KESTREL_COMMIT"))
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--fractions", default="0.25,0.5,0.75,1.0")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    weights = random_q8_weights("qwen3-1.7b")
    config, weight_bytes = weights.config, weights.quantized_bytes()
    needs = arena_needs(config, max(SESSIONS, CHUNK), SESSIONS + 1, SEQ, 16)
    driver.Device(0)
    h2d_gb_s = measure_h2d_gb_s()
    print(f"pinned H2D {h2d_gb_s:.1f} GB/s; weights {weight_bytes / 1e6:.0f} MB", flush=True)
    rows = []
    for fraction in [float(f) for f in args.fractions.split(",")]:
        budget = budget_for_weight_fraction(config, needs, fraction)
        gpu = GpuExecutor(weights, max_seq_len=SEQ, max_batch=SESSIONS, max_sessions=SESSIONS, prefill_chunk=CHUNK,
                          vram_budget=budget)
        window = gpu.steps.window
        batches = [1, 4, 16] if fraction == 0.5 else [1]
        for batch in batches:
            result = decode(gpu, batch, args.steps, rng)
            streamed = result.get("streamed_bytes", 0.0)
            roofline = batch * h2d_gb_s * 1e9 / streamed if streamed else None
            row = {"weights_pct": round(100 * fraction), "budget_MB": round(budget / 1e6, 1),
                   "arena_MB": round(gpu.steps.arena.capacity_bytes / 1e6, 1), "sessions": batch,
                   "resident_MB": round(window.resident_bytes / 1e6, 1),
                   "resident": f"{len(window.resident)}/{window.total_items}",
                   "ring": f"{window.slot_count}x{window.slot_stride / 1e6:.1f}MB" if window.streamed else "-",
                   "streamed_MB_per_step": round(streamed / 1e6, 1),
                   "tok_s": round(result["tok_s"], 1), "ms_per_step": round(result["ms_per_step"], 3),
                   "pcie_roofline_tok_s": round(roofline, 1) if roofline else "-",
                   "frac_roofline": round(result["tok_s"] / roofline, 3) if roofline else "-",
                   "syncs_per_step": result["syncs"],
                   "preload_GB_s": round(window.resident_bytes / max(window.preload_s, 1e-9) / 1e9, 1)}
            if batch == 1 and window.streamed:
                row["copy_busy_ms"], row["compute_busy_ms"], row["span_ms"] = busy_times(gpu)
            print(row, flush=True)
            rows.append(row)
        gpu.close()
    base = next((r["tok_s"] for r in rows if r["weights_pct"] == 50 and r["sessions"] == 1), None)
    for r in rows:
        if r["weights_pct"] == 50 and base:
            r["x_batch1"] = round(r["tok_s"] / base, 2)
    env = environment()
    env.update(machine=driver.detect(), commit=args.commit or env["commit"], pinned_h2d_GB_s=round(h2d_gb_s, 1),
               weight_MB=round(weight_bytes / 1e6, 1), kv_and_activations_MB=round(needs.total / 1e6, 1))
    notes = (f"qwen3-1.7b shape, random Q8_0 weights ({weight_bytes / 1e6:.0f} MB), tied lm_head (kept resident: "
             f"the embed kernel gathers from it). Budget = KV caches + activations ({needs.total / 1e6:.0f} MB for "
             f"{SESSIONS + 1} caches x {SEQ} positions) + the stated % of the weight bytes. Pinned H2D measured "
             f"here: {h2d_gb_s:.1f} GB/s; pcie_roofline_tok_s = sessions x that / streamed bytes per step. "
             f"tok_s: end to end through forward() (graph replay incl. the copy stream, one sync, logits out), "
             f"{args.steps} steps. copy/compute busy: eager steps with timing events (KESTREL_PROF path). "
             f"preload_GB_s: the resident weights' one H2D from pinned host images.")
    path = write_results("h200-window", env, rows,
                         ["weights_pct", "sessions", "budget_MB", "arena_MB", "resident", "resident_MB", "ring",
                          "streamed_MB_per_step", "tok_s", "ms_per_step", "pcie_roofline_tok_s", "frac_roofline",
                          "x_batch1", "copy_busy_ms", "compute_busy_ms", "span_ms", "syncs_per_step",
                          "preload_GB_s"], notes=notes, out_dir=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
