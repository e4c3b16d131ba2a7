"""What the served steps held and how long prompts waited: counters for the daemon's ``stats``.

Pure arithmetic over numbers the batcher and the step thread hand in; kept
apart from the policy (batcher.py) so the policy reads alone.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

RECENT_TTFT = 1024          # time-to-first-token samples the percentiles are taken over
RECENT_STEPS = 1024         # step times the step percentiles are taken over


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
        if steps is not None:
            self.ttft_steps.append(steps)
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
            "step_ms": step_figures(list(self.step_s)),
        }
