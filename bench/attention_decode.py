"""Batch-1 decode step time on the device by the split blocks' fewest keys (attention_min_keys) and
warps (attention_warps).

    PYTHONPATH=. python3 -m bench.attention_decode /tmp/q8b-q4_k_m.gguf [--min-keys 16,32,64,128]
                                                   [--warps 4,8] [--positions 8,64,128,512,1000] [--out DIR]

Per (warps, min_keys): gpu mode's one-token launch list (the rope op inside attention unless KESTREL_FUSED_ROPE=0)
captured as one graph and replayed back to back (timing events around --repeats replays, no host
work between them), at each position of a session's cache; and the graph of the attention launches
alone.  A context of at most min_keys keys runs as one block per (kv head, token) that writes its
output (attention_body.cuh): fewer blocks and no merge, but each block's warps take more keys in turn.
The fastest pair per position range is what kestrel_stream.cuda.kernels.ATTENTION_MIN_KEYS and
ATTENTION_WARPS should be.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from kestrel_stream.cli.bench import environment
from kestrel_stream.cuda import driver
from kestrel_stream.loading.loader import load_weights
from kestrel_stream.run.compat import GpuExecutor

from .report import write_results


def graph_us(gpu: GpuExecutor, launches, repeats: int) -> float:
    """µs per replay of a graph of `launches`, replayed `repeats` times back to back."""
    with driver.capture(gpu.steps.stream) as captured:
        for launch in launches:
            launch.enqueue(gpu.steps.stream)
    graph = captured.graph
    graph.launch(gpu.steps.stream)
    start, stop = driver.Event(timing=True), driver.Event(timing=True)
    start.record(gpu.steps.stream)
    for _ in range(repeats):
        graph.launch(gpu.steps.stream)
    stop.record(gpu.steps.stream)
    gpu.steps.stream.synchronize()
    graph.destroy()
    return stop.elapsed_ms(start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a GGUF file (bench/make_gguf.py)")
    parser.add_argument("--min-keys", default="16,32,64,128")
    parser.add_argument("--warps", default="4", help="comma-separated warps per block of the fused kernel (4, 8)")
    parser.add_argument("--positions", default="8,64,128,512,1000")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default=os.environ.get("KESTREL_COMMIT"))
    args = parser.parse_args()
    positions = [int(p) for p in args.positions.split(",")]
    seq = max(positions) + 16
    weights = load_weights(args.model)
    rows = []
    choices = [(int(w), int(m)) for w in args.warps.split(",") for m in args.min_keys.split(",")]
    for warps, min_keys in choices:
        gpu = GpuExecutor(weights, max_seq_len=seq, max_batch=1, max_sessions=2, prefill_chunk=16,
                          attention_min_keys=min_keys, attention_warps=warps)
        kv = gpu.alloc_kv(seq)
        gpu.forward([(kv, np.arange(16) % weights.config.vocab_size, 0)])
        gpu.steps._reserve([(kv, 0, seq)])            # blocks for every position the replays read
        launches = gpu.steps.step_launches(1)
        attention = [launch for launch in launches if launch.labels.get("op") == "attention"]
        for position in positions:
            gpu.steps.stage(gpu.steps._rows([(kv, np.array([5]), position)]), 1)
            gpu.steps.step_params.upload(1, gpu.steps.stream)
            row = {"file": os.path.basename(args.model), "warps": warps, "min_keys": min_keys, "position": position,
                   "step_us": round(graph_us(gpu, launches, args.repeats), 1),
                   "attention_us": round(graph_us(gpu, attention, args.repeats), 1), "launches": len(launches)}
            print(row, flush=True)
            rows.append(row)
        gpu.close()
    env = environment()
    env.update(machine=driver.detect(), commit=args.commit or env["commit"])
    notes = ("In-graph µs of one batch-1 decode step (step_us) and of its attention launches alone (attention_us), "
             f"{args.repeats} replays back to back; min_keys: the fewest keys a split block of split-key attention "
             "takes (a context of at most that many keys: one block, no merge); warps: a block's in the kernel with the "
             "rope prologue (8: its _w8 kernels).")
    path = write_results("h200-attention-decode", env, rows,
                         ["file", "warps", "min_keys", "position", "step_us", "attention_us", "launches"], notes=notes,
                         out_dir=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
