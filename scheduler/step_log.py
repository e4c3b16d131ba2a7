"""What the served steps held and how long prompts waited: counters for the daemon's ``stats``.

Pure arithmetic over numbers the batcher and the step thread hand in; kept
apart from the policy (batcher.py) so the policy reads alone.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

RECENT_TTFT = 1024          # time-to-first-token samples the percentiles are taken over
RECENT_STEPS = 1024         # step times the step percentiles are taken over
# every prompt since the start, counted by bucket (a Prometheus histogram: what happened between two scrapes is
# their difference, where the percentiles above mix in whatever came before)
TTFT_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5,
                  0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
TTFT_STEP_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 128)


def percentile(sorted_values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending list (0.0 for an empty one)."""
    if not sorted_values:
        return 0.0
    rank = min(len(sorted_values) - 1, max(0, round(fraction * (len(sorted_values) - 1))))
    return sorted_values[rank]


def ttft_figures(seconds: list[float], steps: list[int]) -> dict:
    """p50 / p99 of prompts' times to first token (ms) and of the steps each took (formed from its arrival to its
    first token, its own included): a wait of many steps is queueing, one long step is the prompt's own work."""
    seconds, steps = sorted(seconds), sorted(steps)
    out = {"p50": round(percentile(seconds, 0.5) * 1e3, 3), "p99": round(percentile(seconds, 0.99) * 1e3, 3),
           "samples": len(seconds)}
    if steps:
        out.update(steps_p50=percentile(steps, 0.5), steps_p99=percentile(steps, 0.99))
    return out


def step_figures(seconds: list[float]) -> dict:
    """p50 / p99 / max of steps' run times (ms): the engine's step, from its start to its outputs."""
    seconds = sorted(seconds)
    return {"p50": round(percentile(seconds, 0.5) * 1e3, 3), "p99": round(percentile(seconds, 0.99) * 1e3, 3),
            "max": round(seconds[-1] * 1e3, 3) if seconds else 0.0, "samples": len(seconds)}


def histogram(edges: tuple, counts: list, total: float) -> dict:
    """Counts by bucket (counts[i]: values <= edges[i] and above the edge before; the last: above them all) as
    {"le": {edge: values <= edge, ..., "+Inf": all}, "sum", "count"}: cumulative, so two scrapes subtract, and
    replicas' histograms add key by key."""
    cumulative, running = {}, 0
    for edge, count in zip(edges, counts):
        running += count
        cumulative[f"{edge:g}"] = running
    cumulative["+Inf"] = running + counts[-1]
    return {"le": cumulative, "sum": round(total, 6), "count": running + counts[-1]}


@dataclass
class StepLog:
    steps: int = 0
    step_tokens: int = 0                # tokens over all steps
    decode_tokens: int = 0              # of which one-token requests (decode steps)
    prompt_tokens: int = 0              # of which chunks of prompts
    prompt_chunks: int = 0
    max_tokens_in_step: int = 0
    mixed_steps: int = 0                # steps that held decode tokens and prompt tokens
    ttft_s: deque = field(default_factory=lambda: deque(maxlen=RECENT_TTFT))
    ttft_steps: deque = field(default_factory=lambda: deque(maxlen=RECENT_TTFT))     # the same prompts' steps
    step_s: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    prompts_answered: int = 0
    ttft_ms: dict | None = None         # ttft_summary's cache
    max_decode_wait_steps: int = 0      # most steps formed while a decode waited in the queue (0: it went next)
    ttft_counts: list = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS_S) + 1))     # every prompt, by bucket
    ttft_total_s: float = 0.0
    ttft_step_counts: list = field(default_factory=lambda: [0] * (len(TTFT_STEP_BUCKETS) + 1))
    ttft_total_steps: int = 0

    def step(self, decode: int, prompt: int, chunks: int, sessions: int) -> None:
        tokens = decode + prompt
        self.steps += 1
        self.step_tokens += tokens
        self.decode_tokens += decode
        self.prompt_tokens += prompt
        self.prompt_chunks += chunks
        self.max_tokens_in_step = max(self.max_tokens_in_step, tokens)
        self.mixed_steps += bool(decode and prompt)

    def waited(self, steps: int) -> None:
        self.max_decode_wait_steps = max(self.max_decode_wait_steps, steps)

    def first_token(self, waited_s: float, steps: int | None = None) -> None:
        """A prompt's answer is ready ``waited_s`` after its request arrived, ``steps`` steps formed since (its
        own included; None: not counted)."""
        self.prompts_answered += 1
        self.ttft_s.append(waited_s)
        self.ttft_counts[bisect_left(TTFT_BUCKETS_S, waited_s)] += 1
        self.ttft_total_s += waited_s
        if steps is not None:
            self.ttft_steps.append(steps)
            self.ttft_step_counts[bisect_left(TTFT_STEP_BUCKETS, steps)] += 1
            self.ttft_total_steps += steps
        self.ttft_ms = None

    def ran(self, seconds: float) -> None:
        """A step ran for ``seconds`` (the step thread's engine call)."""
        self.step_s.append(seconds)

    def ttft_summary(self) -> dict:
        """p50/p99 of the latest samples, computed once per new sample (stats may be asked for often)."""
        if self.ttft_ms is None:
            self.ttft_ms = ttft_figures(list(self.ttft_s), list(self.ttft_steps))
        return self.ttft_ms

    def stats(self) -> dict:
        return {
            "steps": self.steps,
            "tokens_per_step": round(self.step_tokens / self.steps, 3) if self.steps else 0.0,
            "max_tokens_in_step": self.max_tokens_in_step,
            "decode_tokens": self.decode_tokens, "prompt_tokens": self.prompt_tokens,
            "prompt_chunks": self.prompt_chunks, "max_decode_wait_steps": self.max_decode_wait_steps,
            "mixed_steps": self.mixed_steps,
            "prompts_answered": self.prompts_answered,
            "ttft_ms": self.ttft_summary(),
            "ttft_histogram": histogram(TTFT_BUCKETS_S, self.ttft_counts, self.ttft_total_s),
            "ttft_steps_histogram": histogram(TTFT_STEP_BUCKETS, self.ttft_step_counts, self.ttft_total_steps),
            "step_ms": step_figures(list(self.step_s)),
        }
