"""What the daemon does with a request: session ownership, operations, and steps.

Every engine call runs on its engine's dedicated step thread (``StepThread``), off
the event loop, so the loop keeps reading frames while a step runs; with
several devices (``serve --devices``) each engine is a replica with its own
step thread and batcher, and a session's requests go to the replica that
holds it (serve/replicas.py).  Decode and
prefill requests go to that thread, whose batcher forms every step from the
decode tokens and prompt chunks queued, under a token budget (continuous
batching; scheduler/batcher.py); for connections that allow it, the step
thread writes each decode's answer to the socket itself (decode_steps.py); a lone
session's short decode step runs on the socket reader thread instead, which
read its request (step_thread.py, socket_reader.py).
Requests are validated here, once, before they reach the engine; a decode
that is already queued when its session closes or fills up fails alone,
never its batch.

One concern, a request's life in the daemon: who owns which session, and what each operation may do to
it, are checked in one place so that no path frees or reuses a session another still holds.
"""
from __future__ import annotations

import threading
from typing import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import numpy as np

from scheduler.batcher import StepBatcher
from scheduler.replica_choice import DEFAULT_PREFIX_SLACK

from kestrel_stream.serve.admission import Admission
from kestrel_stream.serve.generate_op import parse_generate, run_generation
from kestrel_stream.serve.memory import FreedPages
from kestrel_stream.serve.replicas import Replica, Replicas
from kestrel_stream.serve.sampling_defaults import SamplingDefaults
from kestrel_stream.serve.stats import daemon_stats
from kestrel_stream.serve.traces import recorder_for, tracer
from kestrel_stream.serve.step_jobs import DecodeJob, PrefillJob, SendFromStep
from kestrel_stream.run.engine import Engine, Session
from kestrel_stream.errors import CapacityError, InvalidTokenError, KestrelError
from kestrel_stream.wire.protocol import (Frame, ProtocolError, ShuttingDownError, UnavailableError,
                                         UnknownSessionError, field_int)
from kestrel_stream.serve.step_thread import DEFAULT_INLINE_MAX_S, report_unawaited

WANTS = ("logits", "last", "token", "topk")


@dataclass
class Connection:
    peer: str
    send_from_step: SendFromStep | None = None     # None: answers go out from the event loop
    send_frame: Callable[..., Awaitable[None]] | None = None    # loop: a frame before the answer (streaming)
    authenticated: bool = False
    sessions: dict[int, Session] = field(default_factory=dict)
    prefilling: dict[int, PrefillJob] = field(default_factory=dict)    # session id -> its prompt, queued at its open


class Service:
    def __init__(self, engines: Engine | list[Engine], max_sessions: int, batchers: StepBatcher | list[StepBatcher],
                 inline_max_s: float = DEFAULT_INLINE_MAX_S, sessions_per_client: int | None = None,
                 traces=None, max_queue: int = 0, sampling_defaults: SamplingDefaults | None = None,
                 devices: list[str] | None = None, prefix_slack: int = DEFAULT_PREFIX_SLACK):
        """engines, batchers: one engine and its batcher, or a list of each (the replicas, one per device in
        ``devices``).  max_queue: generations that may wait for a session when --max-sessions are held (0:
        refused at once); both limits hold across the replicas.  prefix_slack: scheduler/replica_choice.py's."""
        engines = engines if isinstance(engines, list) else [engines]
        batchers = batchers if isinstance(batchers, list) else [batchers]
        self.replicas = Replicas(engines, batchers, inline_max_s, devices, prefix_slack)
        # the model's facts (config, tokenizer, limits, draft), the same in every replica: the first one's
        self.engine, self.max_sessions = engines[0], max_sessions
        self.sampling_defaults = sampling_defaults or SamplingDefaults()    # serve --temp ...: requests that set none
        self.grammar_lock = threading.Lock()
        self.grammars_of_tokenizer = None       # text/grammar.py Grammars, made for the first structured output
        self.sessions_per_client = sessions_per_client or max_sessions
        self.traces = traces                    # serve/traces.py DaemonTraces; None: no trace_start
        self.vocab_size = self.engine.config.vocab_size
        self.counters = {"requests": 0, "errors": 0}     # the replicas count their steps (Replica.counters)
        self.connections: set[int] = set()
        self.draining = False
        self.handling = 0                       # requests whose handler has not returned
        self.decodes_sent = 0                   # decodes the step thread answers (it counts them out)
        self.queued_at_once = 0                 # of those, the ones the reader thread queued (only it counts)
        self.stats_at_once_count = 0            # stats requests the reader thread answered (only it counts)
        self.admit = threading.Lock()           # the reader thread's decodes against the start of a shutdown
        # Sessions reserved by an open still on the step thread, plus those open: --max-sessions counts these,
        # taken before the open's first await, so opens racing each other cannot pass the limit together.
        self.admission = Admission(max_sessions, max_queue)
        self.freed_pages = FreedPages()
        self.freed_pages.count_busy(lambda: self.held_sessions + self.handling)

    @property
    def held_sessions(self) -> int:
        return self.admission.held

    @property
    def inflight(self) -> int:
        return self.handling + self.decodes_sent + self.queued_at_once - self.replicas.answered

    def replica_of(self, session: Session) -> Replica:
        return self.replicas.of(session)

    def submit(self, job) -> None:
        """A step job (its session's) to the batcher of the replica that holds that session."""
        self.replicas.submit(job)

    def stop(self) -> None:
        """Every replica's step thread, once its queued calls have run."""
        self.replicas.stop()

    # -- requests --------------------------------------------------------------
    async def handle(self, conn: Connection, frame: Frame) -> tuple[dict, dict] | DecodeJob:
        """(header fields, arrays) of the response to one request, or a DecodeJob whose answer the step thread
        sends (Connection.send_from_step); raises a KestrelError to answer an error."""
        op = frame.header.get("op")
        handler = getattr(self, f"op_{op}", None) if isinstance(op, str) and op.isidentifier() else None
        if handler is None:
            raise ProtocolError(f"frame header: unknown op {op!r}")
        if self.draining and op not in ("close", "stats"):
            raise ShuttingDownError("the daemon is shutting down; no new work is accepted")
        self.counters["requests"] += 1
        self.handling += 1
        try:
            return await handler(conn, frame.header, frame.arrays)
        finally:
            self.handling -= 1

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
        wait = header.get("wait", False)
        if type(wait) is not bool:
            raise ProtocolError(f"open: field 'wait' must be true or false, got {wait!r}")
        if not wait and self.held_sessions >= self.max_sessions:    # the daemon's limit is named first: it is met
            raise self.sessions_held("open")
        if len(conn.sessions) >= self.sessions_per_client:
            raise CapacityError(f"open: this client already holds {len(conn.sessions)} sessions "
                                f"(--max-sessions-per-client {self.sessions_per_client})")
        # wait: a turn in the admission queue when every session is held (a client leaving meanwhile is cancelled
        # here, and its place in the queue freed)
        session, = await self.open_sessions(conn, length, wait=wait)
        return {"session": session.id, "max_seq_len": session.max_seq_len}, {}

    def sessions_held(self, what: str) -> CapacityError:
        return CapacityError(f"{what}: the daemon already holds {self.held_sessions} sessions "
                             f"(--max-sessions {self.max_sessions})")

    async def open_sessions(self, conn: Connection, length: int | None, count: int = 1,
                            wait: bool = False, what: str = "open", prompt=None,
                            scope: str | None = None, prefill: str | None = None, prefill_state=None) -> list[Session]:
        """``count`` new sessions of ``conn``, on one replica: their places reserved at once (CapacityError when
        all are held), or with ``wait`` after a turn in the admission queue (CapacityError when it is full).
        prompt: the ids they will prefill (in prefix cache ``scope``), where known: the replica that caches the
        longest prefix of them is preferred (serve/replicas.py).  prefill: what a lone session's prompt answers
        (want, k=1): the session is made, the prompt's cached prefix adopted and the rest queued for the next
        step in one visit to the step thread, ahead of the steps ready there (conn.prefilling, for
        prefill_cached); prefill_state: want "sample"'s sampling state (step_jobs.PrefillJob)."""
        if wait:
            await self.admission.take(count, what)
        elif not self.admission.try_take(count):
            raise self.sessions_held(what)
        replica = self.replicas.place(count, prompt, scope)
        opened: list[Session] = []
        try:
            for _ in range(count):
                # Shielded: a client leaving now (its request cancelled) must not drop a session the step thread
                # is making; it is registered below, with no await between, so the client's cleanup closes it.
                with anyio.CancelScope(shield=True):
                    if prefill is not None and count == 1 and prompt is not None:
                        session, job = await replica.steps.run_ahead(replica.open_prefilling, length, scope,
                                                                     np.asarray(prompt, np.int64), prefill, 1,
                                                                     prefill_state)
                        conn.prefilling[session.id] = job
                    else:
                        session = await replica.steps.run_ahead(replica.prefix_scopes.new_session, length)
                conn.sessions[session.id] = session     # from here close_sessions frees it and its place
                opened.append(session)
        except CapacityError:
            raise
        except Exception as e:          # e.g. the device arena has no room for one more KV cache
            raise CapacityError(f"{what}: the engine could not allocate a session ({type(e).__name__}: {e})") from e
        finally:
            if len(opened) < count:
                self.admission.give_back(count - len(opened))
                self.replicas.release(replica, count - len(opened))
        return opened

    async def op_prefill(self, conn, header, arrays):
        session = self.session_of(conn, header, "prefill")
        want, k = self.want_of(header, "prefill")
        ids = self.token_ids(arrays, "prefill")
        session.check_room(len(ids))
        job = await self.prefill_cached(session, ids, want, k)
        fields, out = job.result
        return {"position": job.position, **fields}, out

    async def prefill_cached(self, session: Session, ids: np.ndarray, want: str, k: int,
                             scope: str | None = None, queued: PrefillJob | None = None, state=None) -> PrefillJob:
        """self.prefill through the engine's prefix cache when only the last row is wanted: a fresh
        session adopts the cached prefix of the prompt, the batcher computes the rest, and the prompt's full
        blocks are cached after it, on the step thread once the step in progress ends (queue_ahead), not waited for
        (the first token goes out now).  scope: a request's cache (serve/prefix_scopes.py; None: the shared one);
        queued: the prompt's job, queued at the session's open (open_sessions' prefill); state: want "sample"'s
        sampling state (step_jobs.PrefillJob)."""
        replica = self.replica_of(session)
        if queued is None and (replica.engine.prefix_cache is None or want == "logits"):
            return await self.prefill(session, ids, want, k, state)
        if queued is None:          # adopted and queued in one visit, ahead of the steps ready there
            queued = await replica.steps.run_ahead(replica.queue_prompt, scope, session, ids, want, k, state)
        job = await queued.result_or_raise()
        if replica.engine.prefix_cache is not None:
            replica.steps.queue_ahead(replica.prefix_scopes.store, scope, session, ids).add_done_callback(
                report_unawaited)
        return job

    async def op_decode(self, conn, header, arrays):
        session, token, want, k = self.decode_request(conn, header)
        if conn.send_from_step is not None:
            return self.submit_answered(conn, header, session, token, want, k)
        job = await self.decode(session, token, want, k)
        fields, out = job.result
        return {"position": job.position, **fields}, out

    def decode_request(self, conn: Connection, header: dict) -> tuple[Session, int, str, int]:
        session = self.session_of(conn, header, "decode")
        want, k = self.want_of(header, "decode")
        want = "last" if want == "logits" else want           # one row: logits [V]
        return session, self.check_token(header.get("token"), "decode"), want, k

    def submit_answered(self, conn: Connection, header: dict, session: Session, token: int, want: str,
                        k: int, at_once: bool = False) -> DecodeJob:
        job = DecodeJob(session, token, want, k, header.get("id"), conn.send_from_step)
        if not at_once:
            self.decodes_sent += 1
        self.replicas.submit(job, at_once)
        return job

    def queue_decode(self, conn: Connection, header: dict) -> DecodeJob | None:
        """Reader thread: the decode request in ``header``, queued for the step thread, which answers it;
        None (nothing done) for any other request, or one that handle() must refuse.

        The connection's coroutine is waiting for a frame, so nothing else changes its sessions meanwhile;
        ``admit`` orders this against the start of a shutdown, which then waits for this decode too."""
        if header.get("op") != "decode" or conn.send_from_step is None:
            return None
        try:
            request = self.decode_request(conn, header)
        except KestrelError:
            return None
        with self.admit:
            if self.draining:
                return None
            self.queued_at_once += 1
        return self.submit_answered(conn, header, *request, at_once=True)

    def start_draining(self) -> None:
        """Loop: refuse new work from now on; what was admitted before counts in ``inflight``."""
        with self.admit:
            self.draining = True
        self.admission.refuse_all(ShuttingDownError("the daemon is shutting down; no new work is accepted"))

    async def op_generate(self, conn, header, arrays):
        """Text or ids in; sampled or greedy tokens out, each step batched with other sessions'
        (serve/generate_op.py); with stream: true one frame per token before the answer."""
        session = self.session_of(conn, header, "generate")
        await self.tokenizer()
        request = parse_generate(self.engine, header, arrays, session.max_seq_len, self.sampling_defaults)
        return await run_generation(self, session, request, conn.send_frame, header.get("id"))

    def grammars(self):
        """Worker threads: the tokenizer's Grammars (response_format), made once."""
        with self.grammar_lock:
            if self.grammars_of_tokenizer is None:
                from kestrel_stream.text.grammar import Grammars
                self.grammars_of_tokenizer = Grammars(self.engine.tokenizer)
            return self.grammars_of_tokenizer

    async def tokenizer(self):
        """The engine's tokenizer (None: the model has none), waited for on a worker thread while its
        background build runs, so the event loop keeps serving; UnavailableError where it cannot be built."""
        engine = self.engine
        try:
            return engine.tokenizer if engine.tokenizer_built else await anyio.to_thread.run_sync(
                lambda: engine.tokenizer)
        except ValueError as e:             # TokenizerError: its message names the file and the cause
            raise UnavailableError(str(e)) from None

    async def op_reset(self, conn, header, arrays):
        session = self.session_of(conn, header, "reset")
        await self.replica_of(session).steps.run(session.reset)
        return {"position": 0}, {}

    async def op_close(self, conn, header, arrays):
        session = self.session_of(conn, header, "close")
        await self.close_sessions(conn, [session.id])
        return {}, {}

    async def op_stats(self, conn, header, arrays):
        return {"stats": self.stats()}, {}

    async def op_trace_start(self, conn, header, arrays):
        trace = recorder_for(self.traces)
        path = await self.replicas[0].steps.run(self.traces.start, conn, header.get("path"), trace)
        return {"path": str(path)}, {}

    async def op_trace_stop(self, conn, header, arrays):
        trace = recorder_for(self.traces)
        written = await self.replicas[0].steps.run(self.traces.stop, conn, trace)
        return {"path": str(written) if written is not None else None}, {}

    # -- steps -----------------------------------------------------------------------
    async def prefill(self, session: Session, ids: np.ndarray, want: str, k: int, state=None) -> PrefillJob:
        """A prompt, in chunks beside other sessions' decodes as the batcher chooses; the handler answers."""
        return await self.run_job(PrefillJob(session, ids, want, k, state))

    async def decode(self, session: Session, token: int, want: str, k: int, state=None) -> DecodeJob:
        """One decode step, batched with other sessions' steps; the handler answers.  state: the sampling state
        of want "sample" (step_jobs.DecodeJob)."""
        return await self.run_job(DecodeJob(session, token, want, k, state=state))

    async def run_job(self, job):
        """Submit a step job to its replica's batcher and wait for it; its error is raised here."""
        self.submit(job)
        return await job.result_or_raise()

    # -- connections -----------------------------------------------------------------
    async def close_sessions(self, conn: Connection, session_ids) -> None:
        sessions = [conn.sessions.pop(sid) for sid in list(session_ids)]
        held: dict[Replica, list[Session]] = {}
        for session in sessions:
            held.setdefault(self.replica_of(session), []).append(session)
        with anyio.CancelScope(shield=True):
            try:
                for replica, closing in held.items():
                    try:
                        # ahead of the ready steps: a closing session waits for no step (its decodes are answered)
                        await replica.steps.run_ahead(replica.decode_steps.close_sessions, replica.batcher, closing)
                    finally:
                        self.replicas.release(replica, len(closing))
            finally:
                if sessions:
                    self.admission.give_back(len(sessions))     # to the oldest waiting generation first
        if sessions:
            self.freed_pages.give_back_soon()

    async def client_left(self, conn: Connection) -> None:
        """Its trace, if one records, is stopped and written."""
        if self.traces is not None and self.traces.owner is conn:
            with anyio.CancelScope(shield=True):
                await self.replicas[0].steps.run(self.traces.stop, conn, tracer())

    def stats_at_once(self) -> dict | None:
        """Reader thread: stats() while no engine call runs (it takes every step thread's turn for that long),
        so that a stats request of an idle connection needs no hop to the event loop; None when busy."""
        taken = []
        try:
            for replica in self.replicas:
                if not replica.steps.turn.acquire(blocking=False):
                    return None
                taken.append(replica.steps.turn)
            self.stats_at_once_count += 1
            return self.stats()
        finally:
            for turn in taken:
                turn.release()

    def stats(self) -> dict:
        """Totals in one engine's shape, and each replica's figures under "replicas" (serve/stats.py)."""
        return daemon_stats(self)
