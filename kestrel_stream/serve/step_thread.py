"""One long-lived thread that runs every engine call of the daemon and forms its steps, off the event loop.

A step holds the decode token of every queued session and chunks of queued
prompts, as the batcher chooses under its token budget; a prompt longer than
that runs over several steps, with other sessions' decodes beside each chunk.

The one exception: a lone session's short decode step runs on the reader
thread that read its request (``run_inline``), since there is then no batch to
form and the hop here (a wake-up and a GIL hand-over) is pure latency.

A call runs after the steps ready when this thread reaches it (a close must
not overtake a decode queued before it), except one that only adds, a new
session and its prompt (``run_ahead``): it runs as soon as the step in
progress ends, so that the prompt joins the very next step instead of
waiting for that step and for the loop to pass the prompt on after it."""
from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from typing import Callable

from kestrel_stream.obs import trace
from scheduler.batcher import Chunk, Pending, StepBatcher

STOP = object()
DEFAULT_INLINE_MAX_S = 0.002        # serve --inline-max-ms


class Ahead:
    """A queued call that no step queued before it needs to precede (StepThread.run_ahead)."""
    __slots__ = ("future", "fn", "args", "queued_s")

    def __init__(self, future: asyncio.Future, fn, args: tuple):
        self.future, self.fn, self.args = future, fn, args
        self.queued_s = time.perf_counter()


class StepThread:
    """Runs engine calls in submission order, and steps (decodes, prompt chunks) as soon as the batcher lets them go.

    A call (``run``) is one queue put; its result comes back through
    ``call_soon_threadsafe`` on an asyncio future, a single wake-up of the loop.
    A decode (``submit``) is one queue put and nothing has to come back: this
    thread owns the batcher, takes each batch itself and hands it to
    ``run_batch``, which answers every request from here.  So the event loop
    only reads frames; a decode step costs it no wake-up, and a lone client's
    request goes into a step the moment this thread sees it.

    ``turn`` is held by whichever thread runs the engine or touches the
    batcher: this one, or the reader thread for an inline step."""

    def __init__(self, batcher: StepBatcher, run_batch: Callable[[list], None],
                 inline_max_s: float = DEFAULT_INLINE_MAX_S):
        self.batcher, self.run_batch = batcher, run_batch
        self.loop = asyncio.get_running_loop()          # the daemon runs on anyio's asyncio backend
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()   # (future, fn, args) calls, decode jobs, STOP
        self.handoffs: list = []            # decode jobs the loop passes on when it next goes round
        self.turn = threading.Lock()
        self.inline_max_s = inline_max_s    # <= 0: every decode step runs on this thread
        self.step_s = 0.0                   # the latest decode step's time
        self.inline_steps = 0
        self.after_inline: Callable[[], None] | None = None     # reader thread, after each inline step
        self.thread = threading.Thread(target=self.serve, name="kestrel-step", daemon=True)
        self.thread.start()

    async def run(self, fn, *args):
        return await self.queue_call(fn, *args)

    async def run_ahead(self, fn, *args):
        """``fn(*args)`` here once the step in progress ends, before the steps ready by then (``run`` waits for
        those): for a call that only adds, such as a new session whose prompt ``fn`` queues in the batcher, which
        then runs in the next step.  Decodes submitted before it still reach the batcher first."""
        return await self.queue_ahead(fn, *args)

    def queue_ahead(self, fn, *args) -> asyncio.Future:
        """run_ahead's call queued now, its result on the future: for one nobody waits for (a prompt's blocks
        into the prefix cache), which then neither runs a step before itself nor holds back the calls queued
        after it (a new request's session and prompt) for that step, as ``queue_call`` would."""
        if self.handoffs:
            self.hand_off()
        future = self.loop.create_future()
        self.inbox.put(Ahead(future, fn, args))
        return future

    def queue_call(self, fn, *args) -> asyncio.Future:
        """``fn(*args)`` queued here now, before any step or call submitted after it; its result on the future."""
        if self.handoffs:                   # a call never overtakes a decode submitted before it
            self.hand_off()
        future = self.loop.create_future()
        self.inbox.put((future, fn, args, time.perf_counter()))
        return future

    def submit(self, job, at_once: bool = False) -> None:
        """A decode or prompt (``job.session.id``, ``job.arrived_s``, ``job.tokens``, ``job.whole``) for the first
        step that may take it.  Only a decode comes ``at_once``.

        ``at_once``: from the reader thread, which runs a lone session's short
        step itself (``run_inline``) or queues it here at once.  Otherwise, from
        the loop, it reaches this thread when the loop next goes round, after
        the request's coroutine has gone back to waiting for its next frame:
        woken earlier, the thread would start the step while the loop still
        holds the GIL for that bookkeeping, and the two would trade the GIL
        through the step."""
        if at_once:
            if not self.run_inline(job):
                self.inbox.put(job)
            return
        self.handoffs.append(job)
        if len(self.handoffs) == 1:
            self.loop.call_soon(self.hand_off)

    def run_inline(self, job) -> bool:
        """Reader thread: run a lone session's short decode step right here; False to queue it.

        Only when no other session asked for a step within the batcher's
        active horizon, nothing is queued or running here, and the latest step
        took under ``inline_max_s``: the reader reads no other connection
        meanwhile, so a long step stays on this thread."""
        if self.step_s >= self.inline_max_s or not self.turn.acquire(blocking=False):
            return False
        try:
            batcher, now = self.batcher, time.perf_counter()
            if batcher.depth or self.handoffs or not self.inbox.empty() or not batcher.lone(job.session.id, now):
                return False
            batcher.run_alone(job.session.id, job.arrived_s)
            self.inline_steps += 1
            try:
                self.run_timed([Chunk(Pending(job.session.id, job, job.arrived_s), 0, 1)])
            except Exception:               # a bug past the step; run_batch answered the job in any case, and
                traceback.print_exc()       # it must not run a second time from the connection's coroutine
            if self.after_inline is not None:
                self.after_inline()
            return True
        finally:
            self.turn.release()

    def hand_off(self) -> None:
        for job in self.handoffs:
            self.inbox.put(job)
        self.handoffs.clear()

    def serve(self) -> None:
        batcher, inbox = self.batcher, self.inbox
        while True:
            # Block until something arrives, or until the oldest queued request's batching window ends.
            wait_s = max(batcher.deadline_s() - time.perf_counter(), 0.0) if batcher.depth else None
            try:
                item = inbox.get(timeout=wait_s)
            except queue.Empty:
                item = None
            with self.turn:
                while item is not None:         # everything already queued joins before a batch is formed
                    if item is STOP:
                        return
                    if type(item) is tuple:
                        self.run_ready_batch()      # requests queued before this call go first
                        self.call(*item)
                    elif type(item) is Ahead:
                        self.call(item.future, item.fn, item.args, item.queued_s)
                    else:
                        batcher.add(item.session.id, item, item.arrived_s, item.tokens, item.whole)
                    item = None if inbox.empty() else inbox.get()
                self.run_ready_batch()

    def run_ready_batch(self) -> None:
        if self.batcher.ready(time.perf_counter()):
            step = self.batcher.take()
            # only a decode step's time says whether the next lone decode may run inline
            self.run_timed(step, timed=all(chunk.pending.tokens == 1 for chunk in step))

    def run_timed(self, chunks: list, timed: bool = True) -> None:
        started = time.perf_counter()
        self.run_batch(chunks)
        if timed:
            self.step_s = time.perf_counter() - started

    def call(self, future: asyncio.Future, fn, args, queued_s: float) -> None:
        """fn(*args), its result or error on the future; in a trace, a span "call <fn>" on the host's "calls"
        lane with the milliseconds it waited here (``waited_ms``: from its queueing to its start)."""
        try:
            with trace.lane_span("calls", "call " + getattr(fn, "__name__", "?"), "serve",
                                 waited_ms=round((time.perf_counter() - queued_s) * 1e3, 3)):
                result = fn(*args)
        except BaseException as e:          # handed to the awaiting request, raised there
            self.loop.call_soon_threadsafe(settle, future, None, e)
        else:
            self.loop.call_soon_threadsafe(settle, future, result, None)

    def stop(self) -> None:
        """Let queued calls finish, then end the thread (requests still queued for a batch are dropped)."""
        self.inbox.put(STOP)
        self.thread.join()


def settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():                       # its request was cancelled (shutdown, dropped client)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def report_unawaited(future: asyncio.Future) -> None:
    """Done-callback of a queue_call nobody awaits: its error, if any, on stderr (the daemon goes on)."""
    if not future.cancelled() and future.exception() is not None:
        traceback.print_exception(future.exception())
