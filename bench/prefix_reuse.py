"""Time to first token with and without a cached prompt prefix (run/prefix_cache.py).

    PYTHONPATH=. python3 -m bench.prefix_reuse --model PATH|PRESET [--device cpu|cuda] [--mode gpu]
        [--prefix-len 1000] [--suffix-len 16] [--repeats 5] [--cpu-threads N] [--out DIR]

For each repeat: a fresh random prefix; request A (prefix + suffix A) computes all of it and leaves
the prefix cached; request B (prefix + suffix B, a new session) adopts the cached prefix and
computes only its suffix.  Time to first token = prefill of the prompt + the greedy argmax of its
last row.  B's first 8 greedy tokens are checked against a fresh run on an engine with no cache.
Reports the median TTFT of each and their ratio (the issue's target: 10x).  A preset name
(tiny, qwen3-0.6b, ...) builds random weights of that shape in memory.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import numpy as np

from kestrel_stream.cli.bench import environment
from kestrel_stream.loading.presets import PRESETS
from bench.synthetic import random_q8_weights
from kestrel_stream.run.blas_threads import cpu_threads_now, set_cpu_threads
from kestrel_stream.run.engine import Engine, resolve_device

from .report import write_results


def load_model_weights(model: str, context: int):
    """A preset's random weights get at least `context` positions (the engine checks max_seq_len
    against max_position_embeddings; tiny's own is 512)."""
    if model in PRESETS:
        config = PRESETS[model]
        if config.max_position_embeddings < context:
            config = dataclasses.replace(config, max_position_embeddings=context)
        return random_q8_weights(config, seed=0)
    from kestrel_stream.loading.loader import load_weights
    return load_weights(model)


def build(weights, device: str, mode: str, max_seq_len: int, kv_dtype: str) -> Engine:
    device, mode = resolve_device(device, mode)
    return Engine(weights, device=device, mode=mode, max_seq_len=max_seq_len, max_batch=4, kv_dtype=kv_dtype)


def first_token(engine: Engine, prompt: list[int]) -> tuple[float, list[int]]:
    """(seconds to the first token through the prefix cache, the first 8 greedy tokens)."""
    with engine.new_session() as s:
        t0 = time.perf_counter()
        logits = engine.prefix_cache.prefill_last(s, prompt)
        tokens = [int(np.argmax(logits[-1]))]
        elapsed = time.perf_counter() - t0
        while len(tokens) < 8:
            tokens.append(s.decode_greedy(tokens[-1]))
    return elapsed, tokens


def fresh_tokens(engine: Engine, prompt: list[int]) -> list[int]:
    with engine.new_session() as s:
        tokens = [int(np.argmax(s.prefill(prompt)[-1]))]
        while len(tokens) < 8:
            tokens.append(s.decode_greedy(tokens[-1]))
    return tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny", help="checkpoint directory, .gguf file, or a preset name")
    p.add_argument("--device", default="auto")
    p.add_argument("--mode", default="auto")
    p.add_argument("--kv-dtype", default="f16", choices=["f16", "f32"])
    p.add_argument("--prefix-len", type=int, default=1000)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cpu-threads", type=int, default=None, help="the CPU engine's BLAS threads (ks.load's cpu_threads)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    set_cpu_threads(args.cpu_threads)
    max_seq_len = args.prefix_len + args.suffix_len + 16
    weights = load_model_weights(args.model, max_seq_len)
    engine = build(weights, args.device, args.mode, max_seq_len, args.kv_dtype)
    reference = build(weights, args.device, args.mode, max_seq_len, args.kv_dtype)
    engine.enable_prefix_cache(budget_positions=4 * max_seq_len)
    vocab = engine.config.vocab_size
    rng = np.random.default_rng(0)
    first_token(engine, [int(t) for t in rng.integers(0, vocab, 64)])       # warm-up: kernels, graphs
    cold, warm, identical = [], [], True
    for _ in range(args.repeats):
        prefix = [int(t) for t in rng.integers(0, vocab, args.prefix_len)]
        a = prefix + [int(t) for t in rng.integers(0, vocab, args.suffix_len)]
        b = prefix + [int(t) for t in rng.integers(0, vocab, args.suffix_len)]
        cold.append(first_token(engine, a)[0])
        seconds, tokens = first_token(engine, b)
        warm.append(seconds)
        identical &= tokens == fresh_tokens(reference, b)
    cold_ms, warm_ms = statistics.median(cold) * 1e3, statistics.median(warm) * 1e3
    row = {"model": Path(args.model).name, "device": engine.device, "mode": engine.mode,
           "kv_dtype": args.kv_dtype if engine.mode == "gpu" else "f32", "prefix_len": args.prefix_len,
           "suffix_len": args.suffix_len, "repeats": args.repeats, "blas_threads": cpu_threads_now(),
           "ttft_fresh_ms": round(cold_ms, 2),
           "ttft_cached_prefix_ms": round(warm_ms, 2), "speedup": round(cold_ms / warm_ms, 1),
           "tokens_identical": identical, **{k: v for k, v in engine.prefix_cache.stats.items()}}
    print(row)
    if args.out:
        env = environment()
        path = write_results(f"prefix-reuse-{row['model']}-{engine.device}", env, [row], list(row),
                             out_dir=Path(args.out))
        print(f"wrote {path}")
    engine.close()
    reference.close()


if __name__ == "__main__":
    main()
