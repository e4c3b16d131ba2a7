"""What the daemon does with a request: session ownership, operations, and the batch runner.

Every engine call runs on one dedicated step thread (``StepThread``), off the
event loop, so the loop keeps reading frames and queueing the next batch while
a step runs.  Requests are validated here, once, before they reach the
engine; a decode that is already queued when its session closes or fills up
fails alone, never its batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import anyio
import numpy as np

from scheduler.batcher import StepBatcher

from .engine import Engine, Session
from .step_thread import StepThread
from .errors import CapacityError, InvalidTokenError, SessionClosedError
from .protocol import Frame, ProtocolError, ShuttingDownError, UnavailableError, UnknownSessionError

WANTS = ("logits", "last", "token", "topk")


@dataclass
class Connection:
    peer: str
    answer_now: Callable[[dict, dict], bool] | None = None    # thread-safe send of a response; False: not sent
    sessions: dict[int, Session] = field(default_factory=dict)


@dataclass
class DecodeJob:
    session: Session
    token: int
    want: str
    k: int
    reply: Callable[[dict, dict], bool] | None = None     # step thread: answer the client at once
    done: anyio.Event = field(default_factory=anyio.Event)
    result: tuple | None = None             # (header fields, arrays)
    error: BaseException | None = None
    answered: bool = False                  # reply() sent the response; the loop sends nothing


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


def field_int(header: dict, name: str, op: str, low: int, high: int, default=None) -> int:
    value = header.get(name, default)
    if type(value) is not int or not low <= value <= high:
        raise ProtocolError(f"{op}: field {name!r} must be an integer in {low}..{high}, got {value!r}")
    return value


class Service:
    def __init__(self, engine: Engine, max_sessions: int, batcher: StepBatcher):
        self.engine, self.max_sessions, self.batcher = engine, max_sessions, batcher
        self.vocab_size = engine.config.vocab_size
        # Built once: the plan is fixed for the engine's mode, and stats() should stay a cheap round trip.
        self.plan = describe(getattr(engine, "plan_summary", None) or getattr(engine.executor, "plan_summary", None))
        self.steps = StepThread()
        self.connections: set[int] = set()
        self.draining = False
        self.inflight = 0
        self.idle = anyio.Event()
        self.arrival = anyio.Event()
        self.step_running = False
        self.counters = {"requests": 0, "errors": 0, "decode_steps": 0, "generated_tokens": 0,
                         "decode_step_s": 0.0}         # engine time of those steps, on the step thread

    async def in_worker(self, fn, *args):
        return await self.steps.run(fn, *args)

    # -- requests --------------------------------------------------------------
    async def handle(self, conn: Connection, frame: Frame) -> tuple[dict, dict] | None:
        """(header fields, arrays) of the response to one request, or None when the step thread already sent
        it (Connection.answer_now); raises a KestrelError to answer an error."""
        op = frame.header.get("op")
        handler = getattr(self, f"op_{op}", None) if isinstance(op, str) and op.isidentifier() else None
        if handler is None:
            raise ProtocolError(f"frame header: unknown op {op!r}")
        if self.draining and op not in ("close", "stats"):
            raise ShuttingDownError("the daemon is shutting down; no new work is accepted")
        self.counters["requests"] += 1
        self.inflight += 1
        try:
            return await handler(conn, frame.header, frame.arrays)
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self.idle.set()

    def session_of(self, conn: Connection, header: dict, op: str) -> Session:
        sid = header.get("session")
        session = conn.sessions.get(sid) if type(sid) is int else None
        if session is None:
            raise UnknownSessionError(f"{op}: session {sid!r} is not open on this connection")
        return session

    def want_of(self, header: dict, op: str) -> tuple[str, int]:
        want = header.get("want", "logits")
        if want not in WANTS:
            raise ProtocolError(f"{op}: field 'want' must be one of {', '.join(WANTS)}, got {want!r}")
        k = field_int(header, "k", op, 1, self.vocab_size, default=1) if want == "topk" else 1
        return want, k

    def token_ids(self, arrays: dict, op: str) -> np.ndarray:
        ids = arrays.get("ids")
        if ids is None:
            raise ProtocolError(f"{op}: expected an array 'ids' (int32 or int64, shape [n])")
        return self.engine.check_tokens(ids, f"{op} ids")

    def check_token(self, token, op: str) -> int:
        if type(token) is not int:
            raise InvalidTokenError(f"{op}: field 'token' must be an integer, got {token!r}")
        if not 0 <= token < self.vocab_size:
            raise InvalidTokenError(f"{op}: token id {token} is outside the vocabulary 0..{self.vocab_size - 1}")
        return token

    async def op_open(self, conn, header, arrays):
        length = header.get("max_seq_len")
        if length is not None:
            length = field_int(header, "max_seq_len", "open", 1, 2**31)     # the engine checks its own limit
        if len(self.engine.sessions) >= self.max_sessions:
            raise CapacityError(f"open: the daemon already holds {len(self.engine.sessions)} sessions "
                                f"(--max-sessions {self.max_sessions})")
        try:
            session = await self.in_worker(self.engine.new_session, length)
        except CapacityError:
            raise
        except Exception as e:          # e.g. the device arena has no room for one more KV cache
            raise CapacityError(f"open: the engine could not allocate a session ({type(e).__name__}: {e})") from e
        conn.sessions[session.id] = session
        return {"session": session.id, "max_seq_len": session.max_seq_len}, {}

    async def op_prefill(self, conn, header, arrays):
        session = self.session_of(conn, header, "prefill")
        want, k = self.want_of(header, "prefill")
        ids = self.token_ids(arrays, "prefill")
        logits = await self.in_worker(session.prefill, ids)
        fields, out = answer(logits, want, k)
        return {"position": session.position, **fields}, out

    async def op_decode(self, conn, header, arrays):
        session = self.session_of(conn, header, "decode")
        want, k = self.want_of(header, "decode")
        want = "last" if want == "logits" else want           # one row: logits [V]
        token = self.check_token(header.get("token"), "decode")
        reply = None
        if conn.answer_now is not None:
            request_id = header.get("id")
            reply = lambda fields, out: conn.answer_now(      # noqa: E731  (runs on the step thread)
                {"id": request_id, "ok": True, "position": session.position, **fields}, out)
        job = await self.decode(session, token, want, k, reply)
        if job.answered:
            return None
        fields, out = job.result
        return {"position": session.position, **fields}, out

    async def op_generate(self, conn, header, arrays):
        """Greedy: prefill the prompt, then n-1 decode steps batched with other sessions."""
        session = self.session_of(conn, header, "generate")
        count = field_int(header, "n", "generate", 0, session.max_seq_len)
        ids = self.token_ids(arrays, "generate")
        session._check_room(len(ids) + max(count - 1, 0))
        logits = await self.in_worker(session.prefill, ids)
        tokens = [int(np.argmax(logits[-1]))] if count else []
        while len(tokens) < count:
            job = await self.decode(session, tokens[-1], "token", 1)
            tokens.append(job.result[0]["token"])
        self.counters["generated_tokens"] += len(tokens)
        return {"position": session.position}, {"tokens": np.asarray(tokens, np.int32)}

    async def op_reset(self, conn, header, arrays):
        session = self.session_of(conn, header, "reset")
        await self.in_worker(session.reset)
        return {"position": 0}, {}

    async def op_close(self, conn, header, arrays):
        session = self.session_of(conn, header, "close")
        await self.close_sessions(conn, [session.id])
        return {}, {}

    async def op_stats(self, conn, header, arrays):
        return {"stats": self.stats()}, {}

    async def op_trace_start(self, conn, header, arrays):
        path = header.get("path")
        if not isinstance(path, str) or not path:
            raise ProtocolError("trace_start: field 'path' must be a non-empty string")
        start = getattr(tracer(), "start", None)
        if start is None:
            raise UnavailableError("tracing unavailable: this build has no kestrel_stream.trace recorder")
        await self.in_worker(start, path)
        return {"path": path}, {}

    async def op_trace_stop(self, conn, header, arrays):
        stop = getattr(tracer(), "stop", None)
        if stop is None:
            raise UnavailableError("tracing unavailable: this build has no kestrel_stream.trace recorder")
        written = await self.in_worker(stop)
        return {"path": str(written) if written is not None else None}, {}

    # -- decode batches ------------------------------------------------------------
    async def decode(self, session: Session, token: int, want: str, k: int, reply=None) -> DecodeJob:
        job = DecodeJob(session, token, want, k, reply)
        self.batcher.add(session.id, job, time.perf_counter())
        if not self.step_running and self.batcher.ready(time.perf_counter()):
            await self.run_ready_batch()        # run it from here: no wake-up of the runner task on the way
        else:
            self.arrival.set()
        if not job.done.is_set():               # skip a checkpoint when this handler ran the step itself
            await job.done.wait()
        if job.error is not None:
            raise job.error
        return job

    async def run_ready_batch(self) -> None:
        self.step_running = True
        try:
            jobs = [pending.payload for pending in self.batcher.take()]
            # No shield needed: a cancelled wait leaves the step running on its thread, and the daemon joins
            # that thread (StepThread.stop) before the engine closes.
            await self.in_worker(self.run_step, jobs)
            for job in jobs:
                job.done.set()
        finally:
            self.step_running = False
            if self.batcher.depth:
                self.arrival.set()              # requests that queued during the step go next

    async def run_batches(self) -> None:
        """Forever: run queued batches that did not start at once (waiting for peers, or behind a step)."""
        while True:
            now = time.perf_counter()
            if self.step_running or not self.batcher.ready(now):
                self.arrival = anyio.Event()
                deadline = None if self.step_running else self.batcher.deadline_s()
                with anyio.move_on_after(None if deadline is None else max(deadline - now, 0.0)):
                    await self.arrival.wait()
                continue
            await self.run_ready_batch()

    def run_step(self, jobs: list[DecodeJob]) -> None:
        """Worker thread: one engine.decode_batch over the jobs that can still run."""
        runnable = []
        for job in jobs:
            if job.session.closed:
                job.error = SessionClosedError(f"decode: session {job.session.id} was closed")
            elif job.session.position + 1 > job.session.max_seq_len:
                job.error = CapacityError(f"decode: session {job.session.id} is full "
                                          f"(max_seq_len={job.session.max_seq_len})")
            else:
                runnable.append(job)
        if not runnable:
            return
        started = time.perf_counter()
        try:
            pairs = [(job.session, job.token) for job in runnable]
            greedy = all(job.want == "token" for job in runnable)    # then the device takes the argmax
            out = self.engine.decode_batch(pairs, greedy=greedy)   # tokens [B] or logits [B, V]
        except Exception as e:          # a device failure fails this step's requests, not the daemon
            for job in runnable:
                job.error = e
            return
        self.counters["decode_steps"] += 1
        self.counters["decode_step_s"] += time.perf_counter() - started
        for job, row in zip(runnable, out):
            job.result = ({"token": int(row)}, {}) if greedy else answer(row[None, :], job.want, job.k)
            if job.reply is not None:
                job.answered = job.reply(*job.result)

    # -- connections -----------------------------------------------------------------
    async def close_sessions(self, conn: Connection, session_ids) -> None:
        sessions = [conn.sessions.pop(sid) for sid in list(session_ids)]
        for session in sessions:
            for pending in self.batcher.forget(session.id):
                pending.payload.error = SessionClosedError(f"decode: session {session.id} was closed")
                pending.payload.done.set()
        with anyio.CancelScope(shield=True):
            await self.in_worker(lambda: [s.close() for s in sessions])

    def stats(self) -> dict:
        engine, executor = self.engine, self.engine.executor
        return {
            "model": str(getattr(engine.weights, "source", "")) or None,
            "device": engine.device, "mode": engine.mode,
            "plan": self.plan,
            "residency": describe(getattr(executor, "residency", None)),
            "counters": {key: value for key, value in executor.stats.items() if isinstance(value, (int, float))},
            "sessions": len(engine.sessions), "max_sessions": self.max_sessions,
            "connections": len(self.connections), "inflight": self.inflight,
            **self.batcher.stats(), **self.counters,
        }


def describe(value):
    """A JSON-safe form of an engine attribute that may be a method, a dict or an object."""
    if callable(value):
        value = value()
    if value is None or isinstance(value, (str, int, float, bool, list, dict)):
        return value
    return str(value)


def tracer():
    try:
        from . import trace
    except ImportError:
        return None
    return trace
