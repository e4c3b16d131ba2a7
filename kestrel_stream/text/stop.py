"""Stop conditions: end-of-generation ids, stop strings on the detokenized stream, a token limit.

A stop string may arrive split over tokens, so text that could be the start
of one is held back until the next pieces decide: it is either a stop (the
generation ends and the stop string is not part of the text) or ordinary text.
"""
from __future__ import annotations

EOS, STOP, LENGTH = "eos", "stop", "length"


class StopChecker:
    def __init__(self, eos_ids=(), stop: list[str] | None = None, max_new_tokens: int = 16):
        stop = list(stop or [])
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: expected non-empty strings, got {s!r}")
        self.eos_ids = frozenset(eos_ids)
        self.stop = stop
        self.max_new_tokens = max_new_tokens
        self.count = 0
        self.pending = ""         # text received but not yet released (a possible start of a stop string)
        self.reason: str | None = None

    def push(self, token_id: int, text: str) -> str:
        """Account for one generated token and its text; the text that may be released now.
        After it, `reason` is set once the generation must end."""
        self.count += 1
        if token_id in self.eos_ids:
            self.reason = EOS
            released, self.pending = self.pending, ""
            return released
        self.pending += text
        released = self._release()
        if self.reason is None and self.count >= self.max_new_tokens:
            self.reason = LENGTH
            released, self.pending = released + self.pending, ""
        return released

    def _release(self) -> str:
        if not self.stop:
            released, self.pending = self.pending, ""
            return released
        hits = [(self.pending.find(s), s) for s in self.stop]
        hits = [(at, s) for at, s in hits if at >= 0]
        if hits:
            at = min(at for at, _ in hits)
            self.reason = STOP
            released, self.pending = self.pending[:at], ""
            return released
        hold = 0                   # the longest tail of pending that begins some stop string
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:n]):
                    hold = n
                    break
        cut = len(self.pending) - hold
        released, self.pending = self.pending[:cut], self.pending[cut:]
        return released

    def finish(self, tail: str = "") -> str:
        """The held-back text once the generation ended for another reason (e.g. the session filled)."""
        released, self.pending = self.pending + tail, ""
        return released
