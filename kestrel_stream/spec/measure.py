"""The target's pass-time curve, measured on the engine as loaded (its placement, its kernels, its graphs).

Passes of 1, 2, 4, 8, ... tokens, each with every row's logits (as a verify
pass wants them), on a scratch session that is rewound after each; the best of
REPEATS runs, so the first run of a size (a graph capture, a cold cache) does
not count.  The doubling stops at max_tokens, at the session's room, or once a
pass costs STEEP_RATIO times a one-token pass: past that point the curve is
extrapolated linearly (cost.PassCurve), and speculation is far from paying.
"""
from __future__ import annotations

import time

import numpy as np

from kestrel_stream.spec.cost import PassCurve

REPEATS = 3
STEEP_RATIO = 4.0
MAX_TOKENS = 256


def pass_seconds(session, ids: np.ndarray) -> float:
    """The best of REPEATS passes of `ids` on an empty `session`, rewound after each."""
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        session.prefill(ids, logits="all")
        best = min(best, time.perf_counter() - started)
        session.truncate(0)
    return max(best, 1e-9)


def measure_pass_curve(engine, max_tokens: int = MAX_TOKENS) -> PassCurve:
    """The engine's pass time at 1, 2, 4, ... tokens (module docstring)."""
    limit = min(max_tokens, engine.max_seq_len)
    with engine.new_session(limit) as session:
        ids = np.arange(limit, dtype=np.int64) % engine.config.vocab_size
        tokens, seconds = [], []
        n = 1
        while n <= limit:
            tokens.append(n)
            seconds.append(pass_seconds(session, ids[:n]))
            if seconds[-1] >= STEEP_RATIO * seconds[0]:
                break
            n *= 2
    return PassCurve(tuple(tokens), tuple(seconds))
