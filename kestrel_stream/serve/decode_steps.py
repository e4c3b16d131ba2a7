"""What the step thread does with a step the batcher formed: decode tokens and chunks of prompts.

The step thread (``StepThread``) takes steps of chunks (scheduler.batcher.Chunk,
each a DecodeJob's token or a part of a PrefillJob's prompt); ``DecodeSteps.run``
runs each as one engine step and then answers every job whose last chunk ran:
straight to its client's socket when the connection lets the step thread
write (the loop is not woken), else by waking the request's coroutine.
"""
from __future__ import annotations

import time

import numpy as np

from scheduler.batcher import StepBatcher

from kestrel_stream.run.engine import Engine, Session
from kestrel_stream.errors import CapacityError, SessionClosedError
from kestrel_stream.wire.protocol import error_header
from kestrel_stream.serve.step_jobs import DecodeJob, PrefillJob, StepJob, wake


class DecodeSteps:
    """Step thread: one engine step per batch of chunks, then each finished job's answer."""

    def __init__(self, engine: Engine, counters: dict, batcher: StepBatcher):
        self.engine, self.counters = engine, counters     # counters: the daemon's, shared with stats
        self.batcher = batcher
        self.answered = 0               # jobs answered here (written to their sockets): only this thread counts
        self.errors = 0                 # of which errors
        self.failed = 0                 # jobs that failed in these steps, whoever answers them

    def run(self, chunks: list) -> None:
        """Step thread: one engine.step over the chunks that can still run, then every finished job's answer."""
        runnable = []
        for chunk in chunks:
            job = chunk.payload
            if job.session.closed:
                job.error = SessionClosedError(f"{job.op}: session {job.session.id} was closed")
            elif job.session.position + chunk.count > job.session.max_seq_len:
                job.error = CapacityError(f"{job.op}: session {job.session.id} is full "
                                          f"(max_seq_len={job.session.max_seq_len})")
            else:
                runnable.append(chunk)
        try:
            if runnable:
                self.step(runnable)
        finally:
            woken: list = []            # the handlers waiting for this step's jobs, woken together
            try:
                for chunk in chunks:
                    job = chunk.payload
                    if job.error is not None:
                        self.failed += 1
                        if not chunk.final:
                            self.batcher.drop(chunk.pending)
                        job.rewind()
                        self.finish(job, woken)
                    elif chunk.final:
                        if type(job) is PrefillJob:
                            log = self.batcher.log
                            waited = log.steps - chunk.pending.queued_at_step     # steps formed since, its own in
                            log.first_token(time.perf_counter() - job.arrived_s, waited)
                        self.finish(job, woken)
            finally:
                wake(woken)             # those answered, whatever failed after them

    def step(self, runnable: list) -> None:
        """Engine.step straight away: the service checked every token, run() each session's room, and the
        batcher gives each session at most one place in a step of at most max_batch."""
        started = time.perf_counter()
        try:
            jobs = [chunk.payload for chunk in runnable]
            items = [(job.session, job.ids(chunk.start, chunk.count)) for job, chunk in zip(jobs, runnable)]
            trees = [job.tree for job in jobs] if any(job.tree is not None for job in jobs) else None
            if all(job.greedy_enough(chunk.final) for job, chunk in zip(jobs, runnable)):
                # every chunk needs only its last row's argmax, which the device then takes
                kind, out = "token", self.engine.step(items, greedy=True)      # tokens [B]
            elif all(job.draws_enough(chunk.final) for job, chunk in zip(jobs, runnable)):
                # decodes, some sampled: the device draws every token (greedy ones: their argmax), or each
                # session's last logits row comes back for its handler to draw from
                out = self.engine.step(items, sample=[job.draw_state() for job in jobs])
                kind = "token" if isinstance(out, np.ndarray) else "logits"
            elif all(job.picks_enough(chunk.final) for job, chunk in zip(jobs, runnable)):
                # decodes and verify passes whose verdict needs each row's argmax alone (on the device)
                kind, out = "argmax", self.engine.step(items, logits="argmax", trees=trees)
            else:
                # no chunk wants every row's logits: lm_head runs on each session's last row alone
                rows = "last" if all(job.want != "logits" for job in jobs) else "all"
                kind, out = "logits", self.engine.step(items, logits=rows, trees=trees)
        except Exception as e:          # a device failure fails this step's requests, not the daemon
            for chunk in runnable:
                chunk.payload.error = e
            return
        ran = time.perf_counter() - started
        self.batcher.log.ran(ran)
        if any(type(chunk.payload) is DecodeJob for chunk in runnable):    # the batcher's log counts every step
            self.counters["decode_steps"] += 1
            self.counters["decode_step_s"] += ran
        for chunk, row in zip(runnable, out):
            chunk.payload.take(row, chunk.final, kind)

    def finish(self, job: StepJob, woken: list | None = None) -> None:
        """Step thread: answer the client (when this thread sends the answer) or wake the waiting handler (with
        ``woken``: its waiter added there, for the step's one wake-up)."""
        job.position = job.session.position
        if job.send is None:
            job.finish(woken)
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
        """Step thread, between steps: close the sessions; their queued requests fail with SessionClosedError."""
        for session in sessions:
            for pending in batcher.forget(session.id):
                job = pending.payload
                job.error = SessionClosedError(f"{job.op}: session {session.id} was closed")
                self.finish(job)
            session.close()
