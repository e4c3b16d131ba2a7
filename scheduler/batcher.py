"""Step batching: every queued session's next tokens become one engine step, under a token budget.

Pure data and clock arithmetic (no I/O, no device), so the policy is testable
on its own; the daemon feeds it requests and asks when to run a step.

A request is a decode (one token) or a prompt (many).  What one step holds
(``take``), within ``step_tokens`` tokens and ``max_batch`` sessions:
- decode tokens first, oldest first: a prompt never delays a decode by more
  than the one step it shares with it;
- then chunks of prompts, oldest first, each as much of its prompt as the
  budget has left; a prompt longer than that goes on in the next steps (the
  engine continues a session from its position, so a prompt cut into chunks
  reaches the same cache as one run whole).  With ``prompt_order="shortest"``
  the prompts with the fewest tokens left go first (a short prompt's first
  token no longer waits for a long one's chunks), but one that has waited
  ``prompt_age_steps`` steps since it came goes before those, oldest first, so
  that no prompt waits on shorter ones for ever;
- while a prompt waits, decodes leave it one session and one token of room,
  so prompts move on even when decodes alone would fill every step;
- a request that must run whole (a token tree: its rows see each other in
  one step) is never cut: it waits for a step with room for all of it, and
  where it is the oldest prompt the decodes leave it that room.
A session appears at most once per step; its later requests stay queued, in
order, behind the one that is running.

A step goes when any of these holds:
- it is full (``max_batch`` distinct sessions queued);
- every recently active session has a request queued: waiting longer could
  only add sessions that are not coming, so a lone client never waits;
- the oldest queued request has waited ``window_s`` (a prompt cut into chunks
  has: its next chunk goes at once).
Batching changes no session's tokens: the engine computes each session's rows
from that session's KV cache alone.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable

from .step_log import StepLog

DEFAULT_WINDOW_S = 0.001
DEFAULT_ACTIVE_HORIZON_S = 0.05
DEFAULT_STEP_TOKENS = 256                   # a step's budget on the host
DEVICE_STEP_TOKENS = 2048                   # ... and on a GPU
PROMPT_ORDERS = ("oldest", "shortest")
DEFAULT_PROMPT_AGE_STEPS = 8                # prompt_order "shortest": a prompt this many steps old goes first


def default_step_tokens(on_device: bool) -> int:
    """The token budget of a step where none is given, by where the step's projections run.

    On a GPU a step's time grows slowly with its tokens until its GEMMs fill
    the device (weights are read once a step, whatever its tokens), so a
    prompt cut into few large chunks reaches its first token in fewer steps,
    and each decode beside a chunk pays little for it.  On the host every
    token costs its share of the arithmetic: a large chunk would hold every
    running decode for its whole length, so chunks stay small there."""
    return DEVICE_STEP_TOKENS if on_device else DEFAULT_STEP_TOKENS


@dataclass(eq=False)
class Pending:
    session_key: Hashable
    payload: Any                    # what the daemon needs to run and answer it (session, tokens, reply slot)
    arrived_s: float
    tokens: int = 1                 # 1: a decode; more: a prompt
    taken: int = 0                  # tokens already given to steps
    queued_at_step: int = 0         # steps formed before it came
    whole: bool = False             # runs in one step, never cut into chunks

    @property
    def remaining(self) -> int:
        return self.tokens - self.taken


class Chunk:
    """Tokens start..start+count of one request, in one step."""
    __slots__ = ("pending", "start", "count")

    def __init__(self, pending: Pending, start: int, count: int):
        self.pending, self.start, self.count = pending, start, count

    @property
    def payload(self) -> Any:
        return self.pending.payload

    @property
    def session_key(self) -> Hashable:
        return self.pending.session_key

    @property
    def final(self) -> bool:
        """The request's last tokens: its answer can go out after this step."""
        return self.start + self.count == self.pending.tokens

    def __repr__(self) -> str:
        return f"Chunk({self.session_key!r}, {self.start}:{self.start + self.count} of {self.pending.tokens})"


@dataclass
class StepBatcher:
    max_batch: int = 32
    window_s: float = DEFAULT_WINDOW_S
    active_horizon_s: float = DEFAULT_ACTIVE_HORIZON_S      # a session counts as active this long after a request
    step_tokens: int = DEFAULT_STEP_TOKENS                  # the token budget of one step
    prompt_order: str = "oldest"                            # or "shortest" (module docstring)
    prompt_age_steps: int = DEFAULT_PROMPT_AGE_STEPS
    queue: deque = field(default_factory=deque)
    last_request_s: dict = field(default_factory=dict)      # session_key -> time of its latest request
    batches: int = 0
    batched_requests: int = 0
    log: StepLog = field(default_factory=StepLog)

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {self.window_s}")
        if self.step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {self.step_tokens}")
        if self.prompt_order not in PROMPT_ORDERS:
            raise ValueError(f"prompt_order must be one of {', '.join(PROMPT_ORDERS)}, got {self.prompt_order!r}")
        if self.prompt_age_steps < 1:
            raise ValueError(f"prompt_age_steps must be >= 1, got {self.prompt_age_steps}")

    def add(self, session_key: Hashable, payload: Any, now_s: float, tokens: int = 1, whole: bool = False) -> Pending:
        if tokens < 1:
            raise ValueError(f"a request holds at least one token, got {tokens}")
        if whole and tokens > self.step_tokens:
            raise ValueError(f"a request that runs whole fits a step: {tokens} tokens, step_tokens={self.step_tokens}")
        item = Pending(session_key, payload, now_s, tokens, 0, self.log.steps, whole)
        self.queue.append(item)
        self.last_request_s[session_key] = now_s
        return item

    def forget(self, session_key: Hashable) -> list[Pending]:
        """Drop a closed session: its queued requests (returned, so they can be answered) and its activity."""
        self.last_request_s.pop(session_key, None)
        dropped = [p for p in self.queue if p.session_key == session_key]
        if dropped:
            self.queue = deque(p for p in self.queue if p.session_key != session_key)
        return dropped

    def drop(self, pending: Pending) -> None:
        """A prompt whose chunk failed: its remaining chunks do not run."""
        if pending.remaining:
            pending.taken = pending.tokens
            self.queue = deque(p for p in self.queue if p is not pending)

    @property
    def depth(self) -> int:
        return len(self.queue)

    def queued_tokens(self) -> int:
        return sum(p.remaining for p in self.queue)

    def _distinct_queued(self) -> int:
        return len({p.session_key for p in self.queue})

    def active_sessions(self, now_s: float) -> int:
        horizon = now_s - self.active_horizon_s
        return sum(1 for t in self.last_request_s.values() if t >= horizon)

    def lone(self, session_key: Hashable, now_s: float) -> bool:
        """No session but ``session_key`` has asked for a step within the active horizon."""
        horizon = now_s - self.active_horizon_s
        return all(t < horizon for key, t in self.last_request_s.items() if key != session_key)

    def run_alone(self, session_key: Hashable, now_s: float) -> None:
        """A decode that runs at once, outside the queue (its session is ``lone``): a step of one."""
        self.last_request_s[session_key] = now_s
        self.batches += 1
        self.batched_requests += 1
        self.log.step(1, 0, 0, 1)

    def ready(self, now_s: float) -> bool:
        if not self.queue:
            return False
        distinct = 1 if len(self.queue) == 1 else self._distinct_queued()
        if distinct >= self.max_batch or now_s - self.queue[0].arrived_s >= self.window_s:
            return True
        return distinct >= self.active_sessions(now_s)

    def deadline_s(self) -> float | None:
        """When the oldest request's window ends (None with an empty queue)."""
        return self.queue[0].arrived_s + self.window_s if self.queue else None

    def take(self) -> list[Chunk]:
        """The next step: decode tokens first, then chunks of prompts, within the budget (module docstring)."""
        queue = self.queue
        if len(queue) == 1 and queue[0].tokens == 1:     # a lone decode: the common case, taken without the scan
            self.batches += 1
            self.batched_requests += 1
            self.log.step(1, 0, 0, 1)
            return [Chunk(queue.popleft(), 0, 1)]
        heads, seen = [], set()             # each session's oldest request: the only one that may run now
        for item in queue:
            if item.session_key not in seen:
                seen.add(item.session_key)
                heads.append(item)
        if not heads:
            return []
        chosen = self.choose(heads)
        for pending, count in chosen:
            pending.taken += count
        if any(pending.remaining == 0 for pending, _ in chosen):
            self.queue = deque(p for p in queue if p.remaining)
        step = [Chunk(pending, pending.taken - count, count) for pending, count in chosen]
        decodes = [c.pending for c in step if c.pending.tokens == 1]
        decode = len(decodes)
        if decodes:
            self.log.waited(max(self.log.steps - p.queued_at_step for p in decodes))
        prompt = [c for c in step if c.pending.tokens > 1]
        self.batches += 1
        self.batched_requests += len(step)
        self.log.step(decode, sum(c.count for c in prompt), len(prompt), len(step))
        return step

    def choose(self, heads: list[Pending]) -> list[tuple[Pending, int]]:
        """(request, tokens of it) for one step, from each session's oldest request, oldest first."""
        room = min(self.max_batch, self.step_tokens)
        if room == 1:                       # one session or one token a step: strictly oldest first
            return [(heads[0], min(heads[0].remaining, self.step_tokens))]
        singles = [p for p in heads if p.remaining == 1]
        prompts = self.in_prompt_order([p for p in heads if p.remaining > 1])
        # decodes leave the first prompt room: one token, or all of one that runs whole
        reserved = (prompts[0].remaining if prompts[0].whole else 1) if prompts else 0
        chosen = [(p, 1) for p in singles[:min(room - (1 if prompts else 0), self.step_tokens - reserved)]]
        tokens_left, sessions_left = self.step_tokens - len(chosen), self.max_batch - len(chosen)
        for p in prompts:
            if not tokens_left or not sessions_left:
                break
            if p.whole and p.remaining > tokens_left:
                continue                    # the next step has room for all of it
            count = min(p.remaining, tokens_left)
            chosen.append((p, count))
            tokens_left -= count
            sessions_left -= 1
        return chosen

    def in_prompt_order(self, prompts: list[Pending]) -> list[Pending]:
        """`prompts` (oldest first) in the order they take a step's budget."""
        if self.prompt_order == "oldest" or len(prompts) < 2:
            return prompts
        steps, age = self.log.steps, self.prompt_age_steps
        aged = [p for p in prompts if steps - p.queued_at_step >= age]
        fresh = [p for p in prompts if steps - p.queued_at_step < age]
        return aged + sorted(fresh, key=lambda p: p.remaining)     # stable: the older of two alike first

    def stats(self) -> dict:
        return {"queue_depth": self.depth, "queued_tokens": self.queued_tokens(), "batches": self.batches,
                "batched_requests": self.batched_requests,
                "mean_batch": round(self.batched_requests / self.batches, 3) if self.batches else 0.0,
                "max_batch": self.max_batch, "window_ms": self.window_s * 1e3, "step_tokens": self.step_tokens,
                "prompt_order": self.prompt_order,
                **self.log.stats()}
