"""How many of a token's host-side expert choices the link share takes (KESTREL_LINK_EXPERTS=auto), chosen
by measuring the routed layers' host op while serving.

The host's cores and the link draw on one pool of host memory; how the two split a token's experts depends
on the machine (its pool, its PCIe, the fixed cost of a hand-off), and the calibrated rates do not predict
it well enough to pick one count: on three H200 hosts the 30B-A3B shape's best was 2 or 3 of 8, and 4
was slower than none.  The count can change between replays of a step graph (the host decides the share
when its item starts; the device runs whatever grouping it is given, none included), so the tuner tries
counts in turn, from 0 up, a few steps each, and keeps the fastest: the mean time of the layers' experts
op a call (the host's own choices, then the wait for the device's sum), which is all a count changes in a
step.  One tuner a step size: at T tokens the count is a share of the experts the host would compute
(count / k), and the right share moves with T (the host's work grows with the tokens, the link's with the
experts).  It stops climbing at the first count slower than the best by more than
`margin`, and measures again after `retune` steps (the machine's load may have changed).
"""
from __future__ import annotations


class LinkTuner:
    def __init__(self, most: int, steps: int = 4, margin: float = 0.02, retune: int = 4096, tokens: int = 1,
                 chosen: int = 0):
        """most: the largest count tried; steps: steps measured per count; tokens: the step size it tunes
        (above one the count is a share of `chosen`: count / chosen of the experts the host would compute)."""
        assert most >= 1 and steps >= 1
        self.most, self.steps, self.margin, self.retune = most, steps, margin, retune
        self.tokens, self.chosen = tokens, chosen
        self.tried: dict[int, float] = {}       # count -> mean microseconds a call
        self.kept: int | None = None            # the count the last settling kept (kept across retunes)
        self.changed = False                    # whether the last settling kept another count than the one before
        self._restart()

    def _restart(self) -> None:
        self.count, self.settled, self.tried = 0, False, {}
        self._calls, self._ns, self._seen, self._since = 0, 0, 0, 0

    @property
    def best(self) -> int:
        return min(self.tried, key=self.tried.get) if self.tried else 0

    def observe(self, calls: int, ns: int) -> None:
        """One step's armed experts calls and their nanoseconds (every layer's, at the current count)."""
        if calls <= 0:
            return
        if self.settled:
            self._since += 1
            if self._since >= self.retune:
                self._restart()
            return
        self._calls, self._ns, self._seen = self._calls + calls, self._ns + ns, self._seen + 1
        if self._seen < self.steps:
            return
        self.tried[self.count] = self._ns / self._calls / 1e3
        self._calls, self._ns, self._seen = 0, 0, 0
        best = self.best
        if self.count >= self.most or self.tried[self.count] > self.tried[best] * (1 + self.margin):
            self.count, self.settled = best, True
            self.changed, self.kept = best != self.kept, best
        else:
            self.count += 1

    def describe(self) -> str:
        tried = ", ".join(f"{n}: {us:.0f} us" for n, us in sorted(self.tried.items()))
        state = f"kept {self.count}" if self.settled else f"trying {self.count}"
        if self.tokens == 1:
            return f"link share: {state} of a token's host-side choices (an experts call at each count tried: {tried})"
        return (f"link share at {self.tokens} tokens: {state} / {self.chosen} of the host's experts (an experts "
                f"call at each count tried: {tried})")
