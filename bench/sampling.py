"""Sampled vs greedy decode at batch 1 through Engine.generate (the path users take).

    PYTHONPATH=. python3 -m bench.sampling [--model PATH] [--device auto|cpu|cuda] [--out DIR]
    PYTHONPATH=. python3 -m bench.sampling --host-draw 151936 [--out DIR]   # the host's draw alone, per row

Without --model: random Q8_0 weights of the qwen3-1.7b shape (bench/gpu_decode.py) in gpu mode when
there is a GPU, else the tiny preset on the CPU.  Rows: greedy chained on the device (the default
greedy path), greedy one step per sync, and sampled (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05,
drawn on the device in gpu mode); the ratio column is each row's decode tok/s over greedy's.
--host-draw V: text/sampling.sample_logits on random rows of V logits (what the daemon's handlers and the CPU
engine pay per sampled token where the device does not draw), µs per row, for a few parameter sets.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from kestrel_stream.cli.bench import environment
from kestrel_stream.run.engine import Engine, resolve_device

from .report import write_results

SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1)


def build_engine(args) -> Engine:
    device, mode = resolve_device(args.device, "auto")
    if args.model:
        import kestrel_stream as ks
        return ks.load(args.model, device=device, mode=mode)
    if device == "cuda":
        from .gpu_decode import random_weights
        weights = random_weights(np.random.default_rng(0))
    else:
        from kestrel_stream.loading.presets import PRESETS
        from bench.synthetic import random_q8_weights
        weights = random_q8_weights(PRESETS["tiny"], seed=0)
    return Engine(weights, device=device, mode=mode, max_seq_len=1024, max_batch=4)


def run(engine: Engine, prompt, new_tokens: int, repeats: int, **kw) -> dict:
    engine.generate(prompt[:8], 4, ignore_eos=True, **kw)              # capture graphs, warm caches
    runs = [engine.generate(prompt, new_tokens, ignore_eos=True, **kw) for _ in range(repeats)]
    best = max(runs, key=lambda r: r.decode_tok_s)
    return {"decode_tok_s": round(best.decode_tok_s, 2), "ms_per_token": round(1e3 / best.decode_tok_s, 4),
            "syncs_per_token": round(best.stats.get("syncs_per_token", 0.0), 4), "tokens": len(best.tokens)}


HOST_DRAWS = {"llama.cpp defaults (top-k 40, top-p 0.95, min-p 0.05, T 0.8)": dict(temperature=0.8),
              "OpenAI defaults (T 1, top-p 1, no top-k)": dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0),
              "top-p 0.9 alone (T 0.7)": dict(temperature=0.7, top_k=-1, top_p=0.9, min_p=0.0)}


def host_draws(vocab: int, rows: int = 200) -> list[dict]:
    import time

    from kestrel_stream.text.sampling import SamplingParams, sample_logits
    x = (3 * np.random.default_rng(0).standard_normal((8, vocab))).astype(np.float32)
    out = []
    for name, fields in HOST_DRAWS.items():
        params = SamplingParams(**fields)
        sample_logits(x[0], params, 1, 0)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for i in range(rows):
                sample_logits(x[i % len(x)], params, 1, i)
            best = min(best, (time.perf_counter() - start) / rows)
        out.append({"path": name, "us_per_row": round(best * 1e6, 1), "vocab": vocab})
        print(f"{name:62s} {best * 1e6:9.1f} us a row")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default=os.environ.get("KESTREL_COMMIT"))
    parser.add_argument("--host-draw", type=int, default=None, metavar="V",
                        help="time the host's draw alone over rows of V logits")
    args = parser.parse_args()
    if args.host_draw:
        rows = host_draws(args.host_draw)
        env = environment() | {"commit": args.commit}
        print(f"wrote {write_results('sampling-host-draw', env, rows, ['path', 'vocab', 'us_per_row'], out_dir=args.out)}")
        return
    engine = build_engine(args)
    prompt = np.random.default_rng(1).integers(0, engine.config.vocab_size, args.prompt_len).tolist()
    rows = [{"path": "greedy (chained)", **run(engine, prompt, args.new_tokens, args.repeats)}]
    engine.chain_greedy = False
    rows.append({"path": "greedy (one step per sync)", **run(engine, prompt, args.new_tokens, args.repeats)})
    engine.chain_greedy = True
    rows.append({"path": "sampled", **run(engine, prompt, args.new_tokens, args.repeats, **SAMPLED)})
    for row in rows:
        row["vs_greedy"] = round(row["decode_tok_s"] / rows[0]["decode_tok_s"], 4)
        print(f"{row['path']:28s} {row['decode_tok_s']:10.2f} tok/s  {row['ms_per_token']:8.4f} ms/token  "
              f"{row['syncs_per_token']:.4f} syncs/token  x{row['vs_greedy']:.3f}")
    env = environment() | {"commit": args.commit, "device": engine.device, "mode": engine.mode,
                           "model": args.model or engine.weights.source}
    out = write_results("sampling", env, rows, ["path", "decode_tok_s", "ms_per_token", "syncs_per_token",
                                                "vs_greedy"], out_dir=args.out)
    print(f"wrote {out}")
    engine.close()


if __name__ == "__main__":
    main()
