"""Sampling parameters and the reference sampler (numpy), with llama.cpp's semantics and order.

Order (llama.cpp's default chain): penalties over the last `repeat_last_n`
tokens → top_k → top_p → min_p → temperature → draw.  top_p and min_p see the
logits before temperature, as in llama.cpp.  Every filter keeps the tokens
whose logit is at or above a threshold (ties at the cut are all kept), so the
device kernel (kernels_ptx/sample.cu) can find the same thresholds by radix
selection without sorting.  The draw is an inverse CDF in token-id order
with one uniform number from Philox4x32-10 keyed by the seed and counted by
the step: the same (seed, step, logits) gives the same token here, in the
kernel and in its twin.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0        # 0: greedy (argmax after penalties)
    top_k: int = 40                 # <= 0: off
    top_p: float = 0.95             # >= 1: off
    min_p: float = 0.05             # <= 0: off
    repeat_penalty: float = 1.0     # 1: off; logit > 0 divided by it, logit < 0 multiplied
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64         # tokens of history the penalties look at
    seed: int | None = None         # None: a random seed per generation

    def __post_init__(self):
        checks = [("temperature", self.temperature >= 0), ("top_p", self.top_p > 0),
                  ("min_p", 0 <= self.min_p <= 1), ("repeat_penalty", self.repeat_penalty > 0),
                  ("repeat_last_n", self.repeat_last_n >= 0)]
        for name, ok in checks:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or not ok:
                raise ValueError(f"sampling: {name}={value!r} is out of range")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise ValueError(f"sampling: top_k={self.top_k!r} must be an integer")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 64):
            raise ValueError(f"sampling: seed={self.seed!r} must be an integer in 0..2**64-1")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def penalized(self) -> bool:
        return self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def resolved_seed(self) -> int:
        return self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little")


def philox_uniform(seed: int, step: int, row: int = 0) -> float:
    """One uniform number in [0, 1) (24 bits) from Philox4x32-10: key = seed, counter = (step, row, 0, 0)."""
    c0, c1, c2, c3 = step & MASK32, row & MASK32, (step >> 32) & MASK32, 0
    k0, k1 = seed & MASK32, (seed >> 32) & MASK32
    for _ in range(10):
        p0, p1 = PHILOX_M0 * c0, PHILOX_M1 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & MASK32, p1 & MASK32, ((p0 >> 32) ^ c3 ^ k1) & MASK32, p0 & MASK32
        k0, k1 = (k0 + PHILOX_W0) & MASK32, (k1 + PHILOX_W1) & MASK32
    return (c0 >> 8) * (1.0 / (1 << 24))


def apply_penalties(logits: np.ndarray, history, params: SamplingParams) -> np.ndarray:
    """llama.cpp's penalties over the last repeat_last_n tokens of `history` (prompt and generated)."""
    if not params.penalized or params.repeat_last_n == 0 or not len(history):
        return logits
    recent = np.asarray(history[-params.repeat_last_n:], np.int64)
    ids, counts = np.unique(recent, return_counts=True)
    out = logits.astype(np.float32, copy=True)
    seen = out[ids]
    seen = np.where(seen > 0, seen / params.repeat_penalty, seen * params.repeat_penalty)
    seen -= counts * params.frequency_penalty + params.presence_penalty
    out[ids] = seen
    return out


def filter_threshold(logits: np.ndarray, params: SamplingParams) -> float:
    """The smallest logit kept by top_k, top_p and min_p together (keep logits >= it)."""
    n = len(logits)
    top = float(np.max(logits))
    k = params.top_k if 0 < params.top_k < n else n
    threshold = float(np.partition(logits, n - k)[n - k]) if k < n else float(np.min(logits))
    if params.top_p < 1.0:
        kept = logits[logits >= threshold]           # ties at the k-th value stay
        kept = np.sort(kept)[::-1]                   # descending
        cumulative = np.cumsum(np.exp(kept.astype(np.float64) - top))
        last = int(np.searchsorted(cumulative, params.top_p * cumulative[-1], side="left"))
        threshold = max(threshold, float(kept[min(last, len(kept) - 1)]))
    if params.min_p > 0.0:
        threshold = max(threshold, top + math.log(params.min_p))
    return threshold


def sample_logits(logits: np.ndarray, params: SamplingParams, seed: int, step: int, history=()) -> int:
    """The sampled token of one logits row [vocab]; greedy (argmax) when temperature is 0."""
    x = apply_penalties(np.asarray(logits, np.float32), history, params)
    if params.greedy:
        return int(np.argmax(x))
    return draw(x, filter_threshold(x, params), params.temperature, philox_uniform(seed, step))


def draw(x: np.ndarray, threshold: float, temperature: float, u: float) -> int:
    """Inverse CDF in token-id order over the kept logits (>= threshold), softmax at `temperature`.

    Computed over the kept logits alone (a top-k of 40 reads 40 exponentials, not the vocabulary's): the
    running sum in id order with the dropped tokens' zeros left out is the same sum, bit for bit."""
    top = float(np.max(x))
    kept = None if threshold <= float(np.min(x)) else np.flatnonzero(x >= threshold)     # None: every token
    weights = np.exp(((x if kept is None else x[kept]).astype(np.float64) - top) / temperature)
    cumulative = np.cumsum(weights)
    j = int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))
    if j == len(weights):                             # u * total landed on the very end: the last kept token
        j = int(np.flatnonzero(weights)[-1])          # (of those whose weight did not underflow to 0)
    return j if kept is None else int(kept[j])
