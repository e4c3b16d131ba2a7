"""Step batching: decode requests of different sessions become one batched step.

Pure data and clock arithmetic (no I/O, no device), so the policy is testable
on its own; the daemon feeds it requests and asks when to run a batch.

A batch goes when any of these holds:
- it is full (``max_batch`` distinct sessions queued);
- every recently active session has a request queued: waiting longer could
  only add sessions that are not coming, so a lone client never waits;
- the oldest queued request has waited ``window_s``.
A session appears at most once per batch; its later requests stay queued, in
order, for the next batch.  Batching changes no session's result: the engine
computes each session's rows from that session's KV cache alone.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable

DEFAULT_WINDOW_S = 0.001
DEFAULT_ACTIVE_HORIZON_S = 0.05


@dataclass
class Pending:
    session_key: Hashable
    payload: Any                    # what the daemon needs to run and answer it (session, token, reply slot)
    arrived_s: float


@dataclass
class StepBatcher:
    max_batch: int = 32
    window_s: float = DEFAULT_WINDOW_S
    active_horizon_s: float = DEFAULT_ACTIVE_HORIZON_S      # a session counts as active this long after a request
    queue: deque = field(default_factory=deque)
    last_request_s: dict = field(default_factory=dict)      # session_key -> time of its latest request
    batches: int = 0
    batched_requests: int = 0

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {self.window_s}")

    def add(self, session_key: Hashable, payload: Any, now_s: float) -> Pending:
        item = Pending(session_key, payload, now_s)
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

    @property
    def depth(self) -> int:
        return len(self.queue)

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
        """A request that runs at once, outside the queue (its session is ``lone``): a batch of one."""
        self.last_request_s[session_key] = now_s
        self.batches += 1
        self.batched_requests += 1

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

    def take(self) -> list[Pending]:
        """Oldest-first, at most one request per session, at most max_batch."""
        if len(self.queue) == 1:            # a lone request: the common case, taken without the scan
            self.batches += 1
            self.batched_requests += 1
            return [self.queue.popleft()]
        batch, seen, rest = [], set(), deque()
        for item in self.queue:
            if len(batch) < self.max_batch and item.session_key not in seen:
                seen.add(item.session_key)
                batch.append(item)
            else:
                rest.append(item)
        self.queue = rest
        if batch:
            self.batches += 1
            self.batched_requests += len(batch)
        return batch

    def stats(self) -> dict:
        return {"queue_depth": self.depth, "batches": self.batches, "batched_requests": self.batched_requests,
                "mean_batch": round(self.batched_requests / self.batches, 3) if self.batches else 0.0,
                "max_batch": self.max_batch, "window_ms": self.window_s * 1e3}
