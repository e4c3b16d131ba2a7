"""What the target keeps of a drafted chain: greedy agreement, or speculative rejection sampling.

Sampled verification is the standard one (Leviathan et al., Chen et al.): a
drafted token x drawn from the draft's q is kept with probability
min(1, p(x) / q(x)); at the first rejection the token is drawn from
norm(max(0, p - q)) instead, and after a fully kept chain the target's own
next token from p.  p and q are the distributions the sampling parameters
define (text/sampling.py: penalties, top-k, top-p, min-p, temperature) for
the same history, so the output has the target's distribution whatever the
draft proposes.  A draft with no distribution (prompt lookup) is a one-hot q.

Every uniform number is Philox keyed by (seed, output index, row): an output
index is decided by its own numbers only, so a seed reproduces a generation.
"""
from __future__ import annotations

import numpy as np

from kestrel_stream.text.sampling import apply_penalties, filter_threshold, philox_uniform, sample_logits

# Philox rows per output index; row 0 is plain decoding's draw (and the target's own token here)
ROW_TARGET, ROW_ACCEPT, ROW_RESIDUAL, ROW_DRAFT = 0, 1, 2, 3


def distribution(logits: np.ndarray, params, history=()) -> np.ndarray:
    """The probabilities [vocab] float64 sample_logits draws from for this row and history."""
    x = apply_penalties(np.asarray(logits, np.float32), history, params)
    threshold = filter_threshold(x, params)
    top = float(np.max(x))
    weights = np.where(x >= threshold, np.exp((x.astype(np.float64) - top) / params.temperature), 0.0)
    return weights / weights.sum()


def draw_from(probs: np.ndarray, u: float) -> int:
    """Inverse CDF in token-id order (text/sampling.draw's order) over `probs`, with u in [0, 1)."""
    cumulative = np.cumsum(probs)
    token = min(int(np.searchsorted(cumulative, u * cumulative[-1], side="right")), len(probs) - 1)
    while probs[token] == 0.0:       # u * total landed on the very end: the last token with mass
        token -= 1
    return token


def accept_or_resample(p: np.ndarray, q: np.ndarray | None, drafted: int, u_accept: float,
                       u_residual: float) -> tuple[bool, int]:
    """(kept, token): `drafted` kept with probability min(1, p/q), else a token drawn from
    norm(max(0, p - q)); q None is the one-hot distribution at `drafted`."""
    q_drafted = 1.0 if q is None else float(q[drafted])
    if u_accept * q_drafted < p[drafted]:
        return True, drafted
    if q is None:
        residual = p.copy()
        residual[drafted] = 0.0
    else:
        residual = np.maximum(p - q, 0.0)
    if residual.sum() <= 0.0:        # p == q up to rounding: nothing left to correct
        residual = p
    return False, draw_from(residual, u_residual)


def verify_greedy(rows: np.ndarray, drafts: list[int], params, history: list[int]) -> list[int]:
    """The tokens the target emits for a chain checked greedily: the drafts up to the first one its own
    pick (argmax after penalties, as plain decoding) differs from, then its pick.
    rows: the target's logits [len(drafts) + 1, vocab], row i after history + drafts[:i]."""
    out = []
    for i, drafted in enumerate(drafts):
        own = sample_logits(rows[i], params, 0, 0, history + drafts[:i])
        out.append(own)
        if own != drafted:
            return out
    out.append(sample_logits(rows[len(drafts)], params, 0, 0, history + drafts))
    return out


def verify_argmax(picks: np.ndarray, drafts: list[int]) -> list[int]:
    """verify_greedy without penalties, from the target's pick per row (its argmax, int [len(drafts) + 1])."""
    out = []
    for drafted, own in zip(drafts, picks):
        out.append(int(own))
        if own != drafted:
            return out
    out.append(int(picks[len(drafts)]))
    return out


def verify_sampled(rows: np.ndarray, drafts: list[int], q_rows, params, seed: int, step: int,
                   history: list[int]) -> list[int]:
    """The tokens the target emits for a chain drafted from q (rows of q_rows; None: one-hot drafts),
    by rejection sampling; the first output index is `step`."""
    out = []
    for i, drafted in enumerate(drafts):
        p = distribution(rows[i], params, history + drafts[:i])
        q = None if q_rows is None else q_rows[i]
        kept, token = accept_or_resample(p, q, drafted, philox_uniform(seed, step + i, ROW_ACCEPT),
                                         philox_uniform(seed, step + i, ROW_RESIDUAL))
        out.append(token)
        if not kept:
            return out
    p = distribution(rows[len(drafts)], params, history + drafts)
    out.append(draw_from(p, philox_uniform(seed, step + len(drafts), ROW_TARGET)))
    return out
