"""A decode request's way through a batched step: DecodeJob, and what the step thread does with a batch.

The step thread (``StepThread``) takes batches of DecodeJobs; ``DecodeSteps.run``
runs each batch as one engine step and then answers every job: straight to
its client's socket when the connection lets the step thread write (the
loop is not woken), else by waking the request's coroutine.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable

import numpy as np

from kestrel_stream.run.engine import Engine, Session
from kestrel_stream.errors import CapacityError, SessionClosedError
from kestrel_stream.serve.protocol import error_header
from kestrel_stream.serve.step_thread import settle

# Step thread: send (header, arrays) to the client, then call the third argument once it is all written.
SendFromStep = Callable[[dict, "dict | None", Callable[[], None]], None]


class DecodeJob:
    """One decode request on its way through the batcher and a step.

    ``send`` set: the step thread answers the client itself and the handler
    does not wait; the connection waits (``wait``) before its next request.
    Otherwise the handler waits and answers."""
    __slots__ = ("session", "token", "want", "k", "request_id", "send", "arrived_s", "position", "result", "error",
                 "done", "waiter")
    lock = threading.Lock()         # done and waiter of every job: held for a few bytecodes, by any thread

    def __init__(self, session: Session, token: int, want: str, k: int, request_id=None,
                 send: SendFromStep | None = None):
        self.session, self.token, self.want, self.k = session, token, want, k
        self.request_id, self.send = request_id, send
        self.arrived_s = time.perf_counter()
        self.position = 0
        self.result: tuple | None = None        # (header fields, arrays)
        self.error: BaseException | None = None
        self.done = False
        self.waiter: asyncio.Future | None = None

    def finish(self) -> None:
        """Any thread: the job is over (its answer written, when the step thread sends it)."""
        with self.lock:
            self.done = True
            waiter = self.waiter
        if waiter is not None:                  # the loop wakes only when a coroutine waits for this job
            waiter.get_loop().call_soon_threadsafe(settle, waiter, None, None)

    async def wait(self) -> None:
        with self.lock:
            if self.done:
                return
            self.waiter = asyncio.get_running_loop().create_future()
        await self.waiter


def answer(logits: np.ndarray, want: str, k: int) -> tuple[dict, dict]:
    """The response fields for logits [n, V]: all rows, the last row, its greedy token, or its top-k."""
    if want == "logits":
        return {}, {"logits": logits}
    last = logits[-1]
    if want == "last":
        return {}, {"logits": last}
    token = int(np.argmax(last))
    if want == "token":
        return {"token": token}, {}
    top = np.argpartition(-last, k - 1)[:k]
    top = top[np.argsort(-last[top], kind="stable")]
    return {"token": token}, {"topk_ids": top.astype(np.int32), "topk_logits": last[top]}


class DecodeSteps:
    """Step thread: one engine step per batch of DecodeJobs, then each job's answer."""

    def __init__(self, engine: Engine, counters: dict):
        self.engine, self.counters = engine, counters     # counters: the daemon's, shared with stats
        self.answered = 0               # jobs answered here (written to their sockets): only this thread counts
        self.errors = 0                 # of which errors

    def run(self, jobs: list[DecodeJob]) -> None:
        """Step thread: one engine.decode_batch over the jobs that can still run, then every job's answer."""
        runnable = []
        for job in jobs:
            if job.session.closed:
                job.error = SessionClosedError(f"decode: session {job.session.id} was closed")
            elif job.session.position + 1 > job.session.max_seq_len:
                job.error = CapacityError(f"decode: session {job.session.id} is full "
                                          f"(max_seq_len={job.session.max_seq_len})")
            else:
                runnable.append(job)
        try:
            if runnable:
                self.step(runnable)
        finally:
            for job in jobs:
                self.finish(job)

    def step(self, runnable: list[DecodeJob]) -> None:
        """Engine.step straight away: the service checked every token, run() each session's room, and the
        batcher gives each session at most one place in a batch of at most max_batch."""
        started = time.perf_counter()
        try:
            items = [(job.session, np.array([job.token], np.int64)) for job in runnable]
            greedy = all(job.want == "token" for job in runnable)    # then the device takes the argmax
            out = self.engine.step(items, greedy=greedy)     # tokens [B], or logits [1, V] per session
        except Exception as e:          # a device failure fails this step's requests, not the daemon
            for job in runnable:
                job.error = e
            return
        self.counters["decode_steps"] += 1
        self.counters["decode_step_s"] += time.perf_counter() - started
        for job, row in zip(runnable, out):
            job.result = ({"token": int(row)}, {}) if greedy else answer(row, job.want, job.k)

    def finish(self, job: DecodeJob) -> None:
        """Step thread: answer the client (when this thread sends the answer) or wake the waiting handler."""
        job.position = job.session.position
        if job.send is None:
            job.finish()
            return
        if job.error is None:
            fields, arrays = job.result
            header = {"id": job.request_id, "ok": True, "position": job.position, **fields}
        else:
            self.errors += 1
            header, arrays = error_header(job.request_id, job.error), None
        try:
            job.send(header, arrays, job.finish)
        finally:
            self.answered += 1          # after the write began: a shutdown notice cannot overtake it

    def close_sessions(self, batcher, sessions: list[Session]) -> None:
        """Step thread, between steps: close the sessions; their queued decodes fail with SessionClosedError."""
        for session in sessions:
            for pending in batcher.forget(session.id):
                pending.payload.error = SessionClosedError(f"decode: session {session.id} was closed")
                self.finish(pending.payload)
            session.close()
