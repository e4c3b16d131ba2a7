"""``kestrel-stream demo``: the README's first command.

Makes the tiny model if missing, loads it on the best device here (the CPU
engine without a GPU), runs greedy decode in two sessions and one batched step
of both, and prints what it did and where the files are.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


def run_demo(args) -> int:
    import kestrel_stream as ks
    from .presets import cache_root, make_model

    base = Path(args.dir) if args.dir else cache_root() / "demo"
    model_dir = base / "tiny"
    if not (model_dir / "config.json").exists():
        make_model(model_dir, "tiny", seed=0)
        print(f"made the tiny model (random Qwen3 weights) in {model_dir}")
    else:
        print(f"using the tiny model in {model_dir}")

    engine = ks.load(model_dir, device=args.device)
    cfg = engine.config
    print(f"loaded {cfg.arch}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}; "
          f"{engine.weights.quantized_bytes() / 1e6:.2f} MB of Q8_0 weights; device {engine.device}, mode {engine.mode}")

    result = engine.generate([1, 2, 3], 16)
    print(f"generate [1, 2, 3] → {result.tokens}")
    print(f"  prefill {result.prefill_tok_s:.0f} tok/s, decode {result.decode_tok_s:.0f} tok/s, "
          f"{result.stats.get('syncs_per_token', 0):.2f} host syncs per token")

    first, second = engine.new_session(), engine.new_session()
    a = int(np.argmax(first.prefill([5, 6, 7])[-1]))
    b = int(np.argmax(second.prefill([9, 10])[-1]))
    logits = engine.decode_batch([(first, a), (second, b)])
    print(f"two sessions, one batched decode step: logits {logits.shape}, next tokens {logits.argmax(axis=1).tolist()}")
    engine.close()
    print(f"files: model in {model_dir}")
    return 0
