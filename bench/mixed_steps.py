"""A serving step under load, on one engine: a prompt chunk of L tokens beside D decoding sessions, against the
same chunk alone and the decodes alone -- what a staggered HTTP run's steps are made of.

    PYTHONPATH=. python3 -m bench.mixed_steps F.gguf|--preset NAME [--device cuda|cpu] [--decodes 64]
        [--context 512] [--chunks 64,256,1024,2048] [--repeats 5] [--out DIR]

D sessions hold --context tokens each.  Per chunk length L, the median wall ms over --repeats (after a warm-up)
of: `decode_ms`, one greedy step of the D sessions' next tokens (the daemon's decode step); `alone_ms`, a fresh
session's L-token prompt in a step of its own (its greedy next token, as a one-choice generation's prompt);
`mixed_ms`, both in one engine.step, as the daemon's batcher forms them.  `extra_ms` = mixed_ms - decode_ms: what
the chunk adds to the decodes' step, `chunk_tok_s` = L / extra_ms beside `alone_tok_s` = L / alone_ms; and
`split_ms` = decode_ms + alone_ms, the two run as steps of their own.  The decodes are truncated back after each
step and the fresh sessions closed, so every repeat sees the same context.  A request arriving during a step waits
for its end (bench/results/2026-12-05-vm-http-open-waits-traced.md): a mixed step's length is the wait of every
request that arrives in it.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kestrel_stream.cli.bench import environment

from .report import write_results


def median_ms(run, repeats: int) -> float:
    """Median wall ms of run() over `repeats` calls after one warm-up (run cleans up after itself)."""
    times = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        run()
        if i:
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def bench(model: str, args) -> list[dict]:
    import kestrel_stream as ks
    chunks = [int(n) for n in args.chunks.split(",") if n]
    mode = "gpu" if args.device == "cuda" else "cpu"
    engine = ks.load(model, device=args.device, mode=mode, max_seq_len=args.context + max(chunks) + 8,
                     max_batch=args.decodes + 1)
    try:
        rng = np.random.default_rng(0)
        high = min(engine.weights.config.vocab_size, 32000)
        decoding = []
        for _ in range(args.decodes):
            session = engine.new_session()
            session.prefill(rng.integers(0, high, args.context), logits="last")
            decoding.append(session)
        tokens = [np.array([int(t)]) for t in rng.integers(0, high, args.decodes)]

        def decodes() -> list:
            return [(s, t) for s, t in zip(decoding, tokens)]

        def back() -> None:
            for s in decoding:
                s.truncate(args.context)

        def decode_step() -> None:
            engine.step(decodes(), greedy=True)
            back()

        rows = []
        decode_ms = median_ms(decode_step, args.repeats)
        for length in chunks:
            ids = rng.integers(0, high, length)

            def alone() -> None:
                fresh = engine.new_session()
                try:
                    engine.step([(fresh, ids)], greedy=True)
                finally:
                    fresh.close()

            def mixed() -> None:
                fresh = engine.new_session()
                try:
                    engine.step(decodes() + [(fresh, ids)], greedy=True)
                finally:
                    fresh.close()
                    back()

            alone_ms, mixed_ms = median_ms(alone, args.repeats), median_ms(mixed, args.repeats)
            extra = mixed_ms - decode_ms
            rows.append({"file": model.rsplit("/", 1)[-1], "device": args.device, "decodes": args.decodes,
                         "context": args.context, "chunk": length, "decode_ms": round(decode_ms, 3),
                         "alone_ms": round(alone_ms, 3), "mixed_ms": round(mixed_ms, 3), "extra_ms": round(extra, 3),
                         "chunk_tok_s": round(length / extra * 1e3, 1) if extra > 0 else None,
                         "alone_tok_s": round(length / alone_ms * 1e3, 1),
                         "split_ms": round(decode_ms + alone_ms, 3)})
            print(rows[-1], flush=True)
        for s in decoding:
            s.close()
        return rows
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="a GGUF file or model dir (or --preset)")
    parser.add_argument("--preset", default=None, help="a random model of a named shape instead (e.g. tiny)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--decodes", type=int, default=64, help="sessions decoding beside the chunk")
    parser.add_argument("--context", type=int, default=512, help="tokens each decoding session holds")
    parser.add_argument("--chunks", default="64,256,1024,2048", help="prompt chunk lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if (args.model is None) == (args.preset is None):
        parser.error("give a model file or --preset, one of them")
    if args.decodes < 1 or args.context < 1 or args.repeats < 1:
        parser.error("--decodes, --context and --repeats must be >= 1")
    if args.preset:
        from kestrel_stream.loading.presets import ensure_preset
        args.model = str(ensure_preset(args.preset))
    rows = bench(args.model, args)
    columns = ["file", "device", "decodes", "context", "chunk", "decode_ms", "alone_ms", "mixed_ms", "extra_ms",
               "chunk_tok_s", "alone_tok_s", "split_ms"]
    path = write_results("mixed-steps", environment(), rows, columns, out_dir=args.out,
                         notes="A prompt chunk beside decoding sessions in one step, against each alone "
                               "(bench/mixed_steps.py's docstring).")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
