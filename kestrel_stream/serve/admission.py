"""Admission: the --max-sessions places, and a bounded queue of requests waiting for one (--max-queue).

A place is reserved before any await (``try_take``, ``take``), so requests
racing each other never pass the limit together.  A request that finds every
place held waits its turn, first come first served; a freed place goes to the
oldest waiter directly (``give_back``), never back to the pool while someone
waits, so a newcomer cannot overtake the queue.  Only when the queue is full
is a request refused.  A waiter that leaves (its task cancelled: the client
went away) frees its place in the queue, and gives back a place that was
handed to it in the meantime, whatever the moment it leaves.

Loop-only: every method runs on the daemon's event loop.
"""
from __future__ import annotations

import time
from collections import deque

import anyio

from kestrel_stream.errors import CapacityError


class Waiter:
    __slots__ = ("count", "granted", "refused", "event")

    def __init__(self, count: int):
        self.count = count          # places it needs at once (a request for n choices needs n)
        self.granted = False
        self.refused: Exception | None = None   # set instead of a place: the daemon is stopping
        self.event = anyio.Event()


class Admission:
    def __init__(self, max_sessions: int, max_queue: int = 0, clock=time.monotonic):
        """max_queue: requests that may wait for a place (0: none wait; one that finds no place is refused)."""
        self.max_sessions, self.max_queue, self.clock = max_sessions, max_queue, clock
        self.held = 0                       # places reserved: sessions open, or being opened
        self.waiting: deque[Waiter] = deque()
        self.admitted_after_wait = 0        # requests that waited, then got their places
        self.waited_s = 0.0                 # the time those waited, in all
        self.max_waited_s = 0.0
        self.left_while_queued = 0          # waiters whose client went away first
        self.refused_queue_full = 0
        self.closed: Exception | None = None    # refuse_all's error: no request waits any more

    @property
    def queued(self) -> int:
        return len(self.waiting)

    def try_take(self, count: int = 1) -> bool:
        """``count`` places now, if they are free and nobody waits for them."""
        if self.waiting or self.held + count > self.max_sessions:
            return False
        self.held += count
        return True

    async def take(self, count: int = 1, what: str = "a request") -> float:
        """``count`` places, waiting in the queue for them when they are held; the seconds waited.
        CapacityError at once when the queue is full, or when ``count`` exceeds every place there is."""
        if count > self.max_sessions:
            raise CapacityError(f"{what} needs {count} sessions at once; the daemon has "
                                f"{self.max_sessions} (--max-sessions {self.max_sessions})")
        if self.try_take(count):
            return 0.0
        if self.closed is not None:
            raise self.closed
        if len(self.waiting) >= self.max_queue:
            self.refused_queue_full += 1
            queue = (f"and {len(self.waiting)} requests are waiting, the queue's limit (--max-queue "
                     f"{self.max_queue})" if self.max_queue else "(--max-queue 0: none may wait)")
            raise CapacityError(f"{what}: all {self.max_sessions} sessions are in use (--max-sessions "
                                f"{self.max_sessions}) {queue}; retry later")
        waiter = Waiter(count)
        self.waiting.append(waiter)
        started = self.clock()
        try:
            await waiter.event.wait()
        except BaseException:               # the client left (cancelled) while queued, or just after its turn came
            if waiter.granted:
                self.give_back(count)
            else:
                self.waiting.remove(waiter)
                self.grant()                # a smaller request behind it may fit now
            self.left_while_queued += 1
            raise
        if waiter.refused is not None:
            raise waiter.refused
        waited = self.clock() - started
        self.admitted_after_wait += 1
        self.waited_s += waited
        self.max_waited_s = max(self.max_waited_s, waited)
        return waited

    def give_back(self, count: int = 1) -> None:
        """``count`` places freed: to the oldest waiters that fit, in order, else back to the pool."""
        self.held -= count
        assert self.held >= 0, "more places given back than taken"
        self.grant()

    def refuse_all(self, error: Exception) -> None:
        """Every waiter, and every request that would wait from now on, gets ``error`` (the daemon is stopping:
        a queued request must not hold the shutdown until a session frees)."""
        self.closed = error
        while self.waiting:
            waiter = self.waiting.popleft()
            waiter.refused = error
            waiter.event.set()

    def grant(self) -> None:
        while self.waiting and self.held + self.waiting[0].count <= self.max_sessions:
            waiter = self.waiting.popleft()
            self.held += waiter.count
            waiter.granted = True
            waiter.event.set()

    def stats(self) -> dict:
        mean = self.waited_s / self.admitted_after_wait if self.admitted_after_wait else 0.0
        return {"admission_queue_depth": len(self.waiting), "admission_max_queue": self.max_queue,
                "admission_waited": self.admitted_after_wait, "admission_wait_s": round(self.waited_s, 6),
                "admission_mean_wait_ms": round(mean * 1e3, 3),
                "admission_max_wait_ms": round(self.max_waited_s * 1e3, 3),
                "admission_left_while_queued": self.left_while_queued,
                "admission_refused_queue_full": self.refused_queue_full}
