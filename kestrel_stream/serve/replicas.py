"""The daemon's replicas: one engine per device behind the same socket and HTTP front (``serve --devices 0,1``).

A replica is an engine and what runs it: its batcher, its step thread (every
call of that engine runs there; one engine alone also runs a lone session's
short steps inline on the reader thread), the answering of its steps (DecodeSteps), its prefix caches (PrefixScopes), its
speculation totals and its own counters.  Replicas share the front and
nothing else: admission (--max-sessions, --max-queue) is the service's,
across them all, and each replica forms its own steps.

A session lives where it was opened.  Every request naming it goes to the
replica whose engine holds it (found from the session's engine, so no table
can go stale), and what comes of it stays there: its prefix-cache forks, its
speculative rounds, the n choices of one HTTP request (opened together, so the
first choice's prompt is the others' cached prefix).  A new session goes
where scheduler/replica_choice.py says: the least-loaded replica, unless one
whose prefix cache holds a longer prefix of the prompt is within the slack
(the prompt is known for HTTP generations; a socket ``open`` carries none, so
balance alone places it).  Session ids come from one counter the engines
share, so an id names one session across replicas.

``held``, ``placed`` and the load are read and written on the event loop; a
replica's own objects are touched only by its step thread (and, for one
engine, the reader thread's inline steps, under the same ``turn``).
"""
from __future__ import annotations

import itertools

import numpy as np

from scheduler.batcher import StepBatcher
from scheduler.replica_choice import DEFAULT_PREFIX_SLACK, choose_replica

from kestrel_stream.run.engine import Engine, Session
from kestrel_stream.serve.decode_steps import DecodeSteps
from kestrel_stream.serve.prefix_scopes import PrefixScopes
from kestrel_stream.serve.spec_rounds import SpecTotals
from kestrel_stream.serve.step_jobs import PrefillJob
from kestrel_stream.serve.step_thread import StepThread


class Replica:
    def __init__(self, index: int, device: str, engine: Engine, batcher: StepBatcher, inline_max_s: float):
        """device: its name in stats and /metrics (cpu, cuda:0, ...).  Call on the event loop (the step thread
        answers it)."""
        self.index, self.device, self.engine, self.batcher = index, device, engine, batcher
        # Built once: the plan is fixed for the engine's mode, and stats() should stay a cheap round trip.
        self.plan = engine.plan_summary()
        window = engine.executor.window_plan
        self.residency = window.describe().splitlines()[0] if window is not None else None
        self.counters = {"decode_steps": 0, "generated_tokens": 0,
                         "decode_step_s": 0.0}      # engine time of the decode steps, on the step thread
        self.decode_steps = DecodeSteps(engine, self.counters, batcher)
        self.prefix_scopes = PrefixScopes(engine)
        self.spec_totals = SpecTotals(engine.speculation)     # speculative rounds of both transports
        self.steps = StepThread(batcher, self.decode_steps.run, inline_max_s)
        self.held = 0                   # sessions placed here and not closed yet (open, or being opened)
        self.placed = 0                 # sessions placed here in all
        self.placed_by_prefix = 0       # of those, sessions a cached prefix brought here over a less loaded replica

    @property
    def load(self) -> int:
        """Its work: the sessions it holds and the requests waiting in its batcher."""
        return self.held + self.batcher.depth

    def open_prefilling(self, max_seq_len: int | None, scope: str | None, prompt: np.ndarray, want: str,
                        k: int, state=None) -> tuple[Session, PrefillJob]:
        """Step thread (StepThread.run_ahead): a new session, the prompt's cached prefix adopted in ``scope``, and
        the rest of the prompt queued in the batcher for the next step; (the session, its prompt's job).  state:
        want "sample"'s (step_jobs.PrefillJob)."""
        if self.engine.prefix_cache is not None:
            session, reused = self.prefix_scopes.new_session_adopting(max_seq_len, scope, prompt)
        else:
            session, reused = self.prefix_scopes.new_session(max_seq_len), 0
        return session, self.queue(session, prompt, reused, want, k, state)

    def queue_prompt(self, scope: str | None, session: Session, prompt: np.ndarray, want: str, k: int,
                     state=None) -> PrefillJob:
        """Step thread (StepThread.run_ahead): the prompt of an open session, its cached prefix adopted in
        ``scope`` (a fresh session's), the rest queued in the batcher for the next step."""
        return self.queue(session, prompt, self.prefix_scopes.adopt(scope, session, prompt), want, k, state)

    def queue(self, session: Session, prompt: np.ndarray, reused: int, want: str, k: int, state=None) -> PrefillJob:
        job = PrefillJob(session, prompt[reused:], want, k, state)
        job.cached_tokens = reused
        self.batcher.add(session.id, job, job.arrived_s, job.tokens, job.whole)
        return job

    def cached_length(self, tokens, scope: str | None) -> int:
        return self.prefix_scopes.cached_length(scope, tokens)


class Replicas:
    """Every replica of the daemon, in --devices order, and where a new session goes."""

    def __init__(self, engines: list[Engine], batchers: list[StepBatcher], inline_max_s: float,
                 devices: list[str] | None = None, prefix_slack: int = DEFAULT_PREFIX_SLACK):
        assert engines and len(engines) == len(batchers)
        devices = devices or [engine.device for engine in engines]
        # A lone session's inline step runs on the one reader thread, which reads no other connection meanwhile:
        # with several replicas their lone sessions' steps would take turns there instead of running at once on
        # their devices, so every step runs on its replica's step thread.
        inline_max_s = inline_max_s if len(engines) == 1 else 0.0
        self.all = [Replica(i, device, engine, batcher, inline_max_s)
                    for i, (device, engine, batcher) in enumerate(zip(devices, engines, batchers))]
        self.by_engine = {id(replica.engine): replica for replica in self.all}
        self.prefix_slack = prefix_slack
        if len(engines) > 1:            # one id space (ids of sessions open before now are not reused)
            first = 1 + max((sid for engine in engines for sid in engine.sessions), default=0)
            shared = itertools.count(first)
            for engine in engines:
                engine.session_ids = shared

    def __iter__(self):
        return iter(self.all)

    def __len__(self) -> int:
        return len(self.all)

    def __getitem__(self, index: int) -> Replica:
        return self.all[index]

    def of(self, session: Session) -> Replica:
        """The replica that holds ``session``."""
        return self.by_engine[id(session.engine)]

    def place(self, count: int, tokens=None, scope: str | None = None) -> Replica:
        """Loop: the replica for ``count`` new sessions of one request (a prompt ``tokens`` for the prefix
        preference, read in ``scope``'s prefix cache), its places reserved there at once so that opens racing
        each other see them; ``release`` what is not opened after all."""
        if len(self.all) == 1:
            replica = self.all[0]
        else:
            cached = [replica.cached_length(tokens, scope) if tokens is not None else 0 for replica in self.all]
            index, by_prefix = choose_replica([replica.load for replica in self.all], cached, self.prefix_slack)
            replica = self.all[index]
            replica.placed_by_prefix += count if by_prefix else 0
        replica.held += count
        replica.placed += count
        return replica

    def release(self, replica: Replica, count: int) -> None:
        """Loop: ``count`` of its sessions are closed (or were never opened)."""
        replica.held -= count
        assert replica.held >= 0, "more sessions released than placed"

    def submit(self, job, at_once: bool = False) -> None:
        """A step job to the replica that holds its session (StepThread.submit)."""
        self.of(job.session).steps.submit(job, at_once)

    @property
    def answered(self) -> int:
        """Jobs the step threads answered themselves."""
        return sum(replica.decode_steps.answered for replica in self.all)

    def stop(self) -> None:
        """Every step thread, after its queued calls (StepThread.stop)."""
        for replica in self.all:
            replica.steps.stop()
