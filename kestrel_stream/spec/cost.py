"""When speculation pays, and how far: the draft length that gives the most tokens per second.

A round of speculation on B sessions, each drafting k tokens, is one target
pass of B(k + 1) tokens plus the drafting, and emits B E(k) tokens, where
E(k) = 1 + a + a^2 + ... + a^k is the expected run of a chain whose tokens are
each kept with probability a (the running acceptance).  Plain decoding is a
pass of B tokens for B tokens.  So

    rate(k) = B E(k) / (T(B (k + 1)) + B k d)

with T the target's measured pass time as a function of the tokens in the
pass (``PassCurve``, measured on the placement that runs) and d the draft's
time per drafted token.  ``choose_draft_length`` takes the k in 0..k_max with
the highest rate, and 0 (plain decoding) unless some k beats plain by
MIN_GAIN.  Two consequences are the policy in words:

- in VRAM, where a pass of k tokens costs about k times one, T(k + 1) grows
  as fast as E(k) and speculation stays off;
- as the batch grows, B (k + 1) leaves the flat part of the curve (the
  tokens a pass takes at the cost of one, ``PassCurve.flat_tokens``) sooner:
  once B (k + 1) passes it, each added draft costs a full token's time for
  a fraction of a token, so k shrinks, to 0 once B alone fills the flat part.
"""
from __future__ import annotations

from dataclasses import dataclass

MIN_GAIN = 1.05         # speculate only when the expected rate beats plain decoding's by this factor
FLAT_RATIO = 1.1        # a pass costs "the same as one token" within this factor of a one-token pass


@dataclass(frozen=True)
class PassCurve:
    """The target's pass time (seconds) at a few token counts; between them linear, past the last one the last
    segment's slope (at least proportional to the tokens: a pass never gets cheaper per token than measured)."""
    tokens: tuple[int, ...]         # increasing, the first is 1
    seconds: tuple[float, ...]

    def __post_init__(self):
        if not self.tokens or self.tokens[0] != 1 or len(self.tokens) != len(self.seconds):
            raise ValueError(f"a pass curve starts at 1 token with a time per point, got tokens={self.tokens} "
                             f"seconds={self.seconds}")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:])) or any(s <= 0 for s in self.seconds):
            raise ValueError(f"a pass curve needs increasing token counts and positive times, got "
                             f"tokens={self.tokens} seconds={self.seconds}")

    def time_s(self, tokens: int) -> float:
        """The predicted time of a pass of `tokens` tokens."""
        xs, ys = self.tokens, self.seconds
        if tokens <= xs[0]:
            return ys[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if tokens <= x1:
                return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        if len(xs) == 1:
            return ys[0] * tokens
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        return ys[-1] + slope * (tokens - xs[-1])

    def flat_tokens(self, ratio: float = FLAT_RATIO) -> int:
        """The most tokens measured in a pass that costs at most `ratio` times a one-token pass."""
        return max(x for x, y in zip(self.tokens, self.seconds) if y <= ratio * self.seconds[0])

    def describe(self) -> str:
        points = ", ".join(f"{x}: {y * 1e3:.3g}" for x, y in zip(self.tokens, self.seconds))
        flat = self.flat_tokens()
        return f"pass time (tokens: ms) {points}; {flat} token{'s' if flat > 1 else ''} at the cost of one"

    def as_dict(self) -> dict:
        return {"tokens": list(self.tokens), "seconds": [round(s, 9) for s in self.seconds],
                "flat_tokens": self.flat_tokens()}


def expected_tokens(acceptance: float, k: int) -> float:
    """E(k): tokens a round of k drafts emits when each is kept with probability `acceptance` (the target's own
    token after the kept run included)."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def tokens_per_s(curve: PassCurve, acceptance: float, k: int, batch: int = 1,
                 draft_s_per_token: float = 0.0) -> float:
    """rate(k) of the module docstring: tokens per second of `batch` sessions each drafting k."""
    return batch * expected_tokens(acceptance, k) / (curve.time_s(batch * (k + 1)) + batch * k * draft_s_per_token)


def choose_draft_length(curve: PassCurve, acceptance: float, k_max: int, batch: int = 1,
                        draft_s_per_token: float = 0.0) -> int:
    """The draft length in 0..k_max with the most tokens per second; 0 (no drafts: plain decoding) unless one
    beats plain decoding by MIN_GAIN."""
    best_k, best = 0, MIN_GAIN * tokens_per_s(curve, acceptance, 0, batch)
    for k in range(1, k_max + 1):
        rate = tokens_per_s(curve, acceptance, k, batch, draft_s_per_token)
        if rate > best:
            best_k, best = k, rate
    return best_k


def choose_tree_nodes(curve: PassCurve, k: int, batch: int = 1, max_nodes: int = 64) -> int:
    """The nodes of a round's token tree whose longest path is k drafts: the chain's k + 1, and more (branches,
    spec/tree.py) while the pass of the batch costs at most FLAT_RATIO times the chains' pass: under offload a
    pass is flat for tens of tokens, so branches ride along for free; in VRAM it stays a chain."""
    if k <= 0:
        return 1
    chains = curve.time_s(batch * (k + 1))
    nodes = k + 1
    while nodes < max_nodes and curve.time_s(batch * (nodes + 1)) <= FLAT_RATIO * chains:
        nodes += 1
    return nodes


class Acceptance:
    """The running chance that a drafted token is kept: kept drafts over kept drafts and misses (a chain stops
    at its first miss, so each round adds its kept run and at most one miss), starting from a prior of
    PRIOR_KEPT kept to PRIOR_MISSES missed, so a first round is tried and a few misses turn it down.  Earlier
    rounds weigh DECAY less at each round, so the rate follows the text (a passage the draft knows, then one
    it does not)."""
    PRIOR_KEPT, PRIOR_MISSES = 3.0, 1.0
    DECAY = 0.9
    PRIOR = PRIOR_KEPT / (PRIOR_KEPT + PRIOR_MISSES)

    def __init__(self):
        self.kept, self.misses = self.PRIOR_KEPT, self.PRIOR_MISSES

    def record(self, drafted: int, kept: int) -> None:
        self.kept = self.DECAY * self.kept + kept
        self.misses = self.DECAY * self.misses + (1 if kept < drafted else 0)

    @property
    def rate(self) -> float:
        return self.kept / (self.kept + self.misses)
