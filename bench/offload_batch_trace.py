"""Where a batch step of mode offload goes: S sessions decoding together at the VRAM `-ngl N` holds for weights,
timed as they run (step graphs) and then traced (segment by segment, each host item and device segment a slice),
beside the placement's predicted step:

    python3 -m bench.offload_batch_trace FILE.gguf --ngl 14 --sessions 16 --trace OUT.json [--stream]

--stream: the window alone (mode gpu, KESTREL_OFFLOAD=stream) under the same budget instead.  The engines are
loaded as bench/offload.py's batch rows load them (BATCH_PROMPT-token prompts, max_batch = sessions) and step as they
step (greedy decode_batch: each session's token taken where lm_head ran).  Open the
trace with `kestrel-stream timeline`.  Needs a GPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--ngl", type=int, default=14, help="the weights' VRAM: what llama.cpp's -ngl N holds")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12, help="timed steps (then 4 traced)")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--stream", action="store_true", help="the window alone under the same budget")
    parser.add_argument("--trace", required=True, help="the Chrome trace to write")
    args = parser.parse_args()
    import kestrel_stream as ks
    from bench.offload import BATCH_PROMPT, batch_group, measured_pool, offload_budget, weight_budget_of
    from kestrel_stream.obs import trace
    from scheduler.offload import HOME_LETTERS

    profile, _ = measured_pool(args.threads)
    weight_bytes, _ = weight_budget_of(args.path, args.ngl)
    new_tokens = max(32, args.steps + 7)              # bench/offload.py's rows: 32 new tokens a session
    seq = -(-(BATCH_PROMPT + new_tokens + 2) // 16) * 16 * args.sessions
    budget = offload_budget(args.path, weight_bytes, seq, profile, args.sessions)
    if args.stream:
        os.environ["KESTREL_OFFLOAD"] = "stream"
        engine = ks.load(args.path, mode="gpu", vram_budget=budget, max_seq_len=seq, max_batch=args.sessions)
    else:
        engine = ks.load(args.path, mode="offload", vram_budget=budget, max_seq_len=seq, max_batch=args.sessions,
                         cpu_threads=args.threads)
    try:
        tokens = batch_group(engine, args.sessions)
    except BaseException:
        engine.close()
        raise
    try:
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.decode_batch(tokens, greedy=True)
            times.append((time.perf_counter() - start) * 1e3)
        print(f"{'window alone' if args.stream else 'mode offload'}, {args.sessions} sessions: steps "
              f"{', '.join(f'{t:.2f}' for t in times)} ms, median {statistics.median(times):.2f}")
        if not args.stream:
            placement = engine.executor.placement_for(args.sessions)
            print(f"placement {''.join(HOME_LETTERS[h] for h in placement.homes)} head {placement.head}: predicted "
                  f"{placement.predicted.total_us / 1e3:.2f} ms ({placement.predicted})")
        trace.start(args.trace)
        for _ in range(4):
            start = time.perf_counter()
            engine.decode_batch(tokens, greedy=True)
            print(f"traced step {(time.perf_counter() - start) * 1e3:.2f} ms")
        print("wrote", trace.stop())
    finally:
        for s, _ in tokens:
            s.close()
        engine.close()


if __name__ == "__main__":
    main()
