"""A batch step of mode offload under other placements of the same VRAM budget, beside their predictions and
the window alone: where the cost model's choice for S-token steps stands among its neighbours.

    python3 -m bench.offload_batch_homes FILE.gguf [--ngl 14] [--sessions 16] [--threads 16] [--logits]
        [--homes HOMES ...] [--thread-counts 15 12 8] [--eager]

Rows: the window alone (mode gpu, KESTREL_OFFLOAD=stream); mode offload's own choice; then, with L the letters
of its S-token placement (scheduler/offload.py's HOME_LETTERS), given as KESTREL_OFFLOAD_HOMES: L itself, L with
every M streamed (no host work), L with every other M streamed, the one-token placement's letters and each
--homes; L at each of --thread-counts host threads; --eager: L segment by segment (KESTREL_RING_GRAPHS=0).
Per row: the median and least step ms (greedy decode_batch, each session's token taken where lm_head ran;
--logits: every session's logits row back instead), the host library's items a step, their ms and its waits
for the device's word (the step graph's host items: kernels.times), the placement and its predicted step.
The engines load as bench/offload.py's batch rows load them (BATCH_PROMPT-token prompts, max_batch = sessions,
the budget of llama.cpp's -ngl N).  Needs a GPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time



def letters(placement) -> str:
    """A placement as KESTREL_OFFLOAD_HOMES gives it: a letter a layer, then lm_head's home."""
    from scheduler.offload import HOME_LETTERS
    return "".join(HOME_LETTERS[h] for h in placement.homes) + ":" + placement.head


def every_other(homes: str, letter: str = "M", to: str = "S") -> str:
    """`homes` with every other `letter` (the 2nd, 4th, ...) turned `to`."""
    out, seen = [], 0
    for ch in homes:
        if ch == letter:
            seen += 1
            ch = to if seen % 2 == 0 else ch
        out.append(ch)
    return "".join(out)


def main(argv=None) -> list[dict]:
    """The rows, printed as they are measured."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--ngl", type=int, default=14, help="the weights' VRAM: what llama.cpp's -ngl N holds")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--logits", action="store_true", help="every session's logits row back (not its token)")
    parser.add_argument("--homes", nargs="*", default=[], help="more placements to time (KESTREL_OFFLOAD_HOMES)")
    parser.add_argument("--thread-counts", type=int, nargs="*", default=[], help="the choice at these host threads")
    parser.add_argument("--eager", action="store_true", help="the choice segment by segment too")
    parser.add_argument("--steps", type=int, default=14, help="timed steps a row (after 3 warm-ups)")
    args = parser.parse_args(argv)
    import kestrel_stream as ks
    from bench.moe_offload import native_kernels
    from bench.offload import BATCH_PROMPT, batch_group, measured_pool, offload_budget, weight_budget_of
    from scheduler.window import WindowBudgetError

    S = args.sessions
    profile, _ = measured_pool(args.threads)
    weight_bytes, _ = weight_budget_of(args.path, args.ngl)
    seq = -(-(BATCH_PROMPT + 32 + 2) // 16) * 16 * S
    budget = offload_budget(args.path, weight_bytes, seq, profile, S)
    greedy, rows = not args.logits, []

    def row(name: str, env: dict, threads: int = args.threads, stream: bool = False):
        """Time one engine's batch steps into `rows`; (its one-token letters, its S-token letters) or Nones."""
        saved = {k: os.environ.get(k) for k in ("KESTREL_OFFLOAD", "KESTREL_OFFLOAD_HOMES", "KESTREL_RING_GRAPHS")}
        for k in saved:
            os.environ.pop(k, None)
        os.environ.update(env)
        try:
            if stream:
                engine = ks.load(args.path, mode="gpu", vram_budget=budget, max_seq_len=seq, max_batch=S)
            else:
                engine = ks.load(args.path, mode="offload", vram_budget=budget, max_seq_len=seq, max_batch=S,
                                 cpu_threads=threads)
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None)
                if v is not None:
                    os.environ[k] = v
        try:
            tokens = batch_group(engine, S, greedy)
        except BaseException:
            engine.close()
            raise
        try:
            host = native_kernels(engine) if not stream else None
            if host is not None:
                host.times(reset=True)
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.decode_batch(tokens, greedy=greedy)
                times.append((time.perf_counter() - start) * 1e3)
            out = {"row": name, "threads": threads, "median_ms": round(statistics.median(times), 3),
                   "least_ms": round(min(times), 3)}
            line = f"t{threads} {name:34s} median {out['median_ms']:6.2f} ms  least {out['least_ms']:6.2f}"
            if host is not None:
                t = host.times(reset=True)
                out.update(items_a_step=t["items"] / max(t["steps"], 1), items_ms=round(t["items_us"] / 1e3, 3),
                           waits_ms=round(t["waits_us"] / 1e3, 3))
                line += (f"  [items a step {out['items_a_step']:.0f}, {out['items_ms']:.2f} ms; "
                         f"waits {out['waits_ms']:.2f} ms]")
            made = (None, None)
            if not stream:
                p = engine.executor.placement_for(S)
                sim = p.predicted
                out.update(placement=letters(p), predicted_ms=round(sim.total_us / 1e3, 3))
                line += (f"  | {letters(p)} predicted {sim.total_us / 1e3:.2f} (copy {sim.copy_busy_us / 1e3:.2f}, "
                         f"host {sim.host_busy_us / 1e3:.2f}, GPU {sim.gpu_busy_us / 1e3:.2f}, {sim.handoffs} hand-offs)")
                made = (letters(engine.executor.placement), letters(p))
            rows.append(out)
            print(line, flush=True)
            return made
        finally:
            for s, _ in tokens:
                s.close()
            engine.close()

    print(f"{S} sessions, {'logits rows' if args.logits else 'greedy tokens'} back, weight budget of -ngl {args.ngl}")
    try:
        row("window alone", {"KESTREL_OFFLOAD": "stream"}, stream=True)
    except WindowBudgetError as e:              # gpu mode's own buffers may not fit where offload's do
        rows.append({"row": "window alone", "refused": str(e)})
        print(f"window alone: refused: {e}", flush=True)
    one, chosen = row("mode offload's choice", {})
    given = [chosen, chosen.replace("M", "S"), every_other(chosen), one] + list(args.homes)
    for homes in dict.fromkeys(given):
        try:
            row(homes, {"KESTREL_OFFLOAD_HOMES": homes})
        except (ValueError, WindowBudgetError) as e:      # a placement the budget cannot hold: say so, go on
            rows.append({"row": homes, "refused": str(e)})
            print(f"{homes}: refused: {e}", flush=True)
    for threads in args.thread_counts:
        row(chosen, {"KESTREL_OFFLOAD_HOMES": chosen}, threads=threads)
    if args.eager:
        row(chosen + " eager", {"KESTREL_OFFLOAD_HOMES": chosen, "KESTREL_RING_GRAPHS": "0"})
    return rows


if __name__ == "__main__":
    main()
