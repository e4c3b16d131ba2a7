"""Speculative decoding in the daemon: a generation's rounds, their verify passes batched with every session's steps.

Continuous batching mixes speculative and plain sessions in the same engine
steps this way: a round's drafting runs on the step thread between steps
(the draft model is an engine too, and the step thread owns the device), and
its verify pass is a job of the batcher like a prompt chunk: a multi-token
entry of a step beside other sessions' decode tokens, prompt chunks and
verify passes, under the step's token budget.  The round is the in-process
one (spec/decoder.py's plan, verdict, keep): a token tree where the draft
grows one (every node's mask in the step: several sessions' trees verify in
one step), else a chain; a pass runs whole, never cut into chunks, and at
most a step's budget.  Greedy rounds without penalties ask the step for each
row's argmax alone (on the device in gpu mode) where the step's other jobs
need no more.  The job keeps what the target accepts and rewinds the
session's KV to the kept path on the step thread, before any other job of
that session runs; a pass that fails (a tree past the session's room, a bad
token) fails its generation alone.

The draft length comes from the engine's Speculation (spec/): under policy
"auto" the cost model weighs the target's measured pass times, the running
acceptance, the draft's time and the batch, the sessions that asked for a step
within the batcher's active horizon; as the batch grows, batch x (k + 1)
leaves the flat part of the pass-time curve and k shrinks, to 0 (a plain
decode job) once the batch alone fills it.

A request opts out with ``"speculative": false``; ``{"draft_max": N}`` caps
its chains.  Where the draft has no room for one more stream (a draft model's
KV pool is fixed), the generation decodes plainly.
"""
from __future__ import annotations

import time

import anyio
import numpy as np

from kestrel_stream.errors import CapacityError
from kestrel_stream.run.token_tree import TokenTree
from kestrel_stream.serve.step_jobs import PrefillJob
from kestrel_stream.spec.decoder import Round, SpecStats


def parse_speculative(value, speculation) -> tuple[bool, int | None]:
    """(speculate, draft_max or None) of a request's "speculative" field: absent/null (where the daemon has a
    draft), true, false, or {"draft_max": N}; ValueError naming what is wrong."""
    if value is None:
        return speculation is not None, None
    if value is False:
        return False, None
    draft_max = None
    if isinstance(value, dict):
        if set(value) - {"draft_max"}:
            raise ValueError(f"'speculative' takes only 'draft_max', got {sorted(value)}")
        draft_max = value.get("draft_max")
        if type(draft_max) is not int or draft_max < 1:
            raise ValueError(f"'speculative.draft_max' must be an integer >= 1, got {draft_max!r}")
    elif value is not True:
        raise ValueError(f"'speculative' must be true, false or {{\"draft_max\": N}}, got {value!r:.80}")
    if speculation is None:
        raise ValueError("'speculative': the daemon has no draft (start it with --model-draft PATH or "
                         "--spec lookup)")
    return True, draft_max


class VerifyJob(PrefillJob):
    """A verify pass: the round's tree (or chain) in one step, with every row's logits or argmax; then (step
    thread) the decoder keeps what the target accepts and the session's KV is rewound to the kept path."""
    __slots__ = ("decoder", "round", "history", "step", "picks", "tree", "out", "rows")
    op = "verify"
    whole = True                    # a tree's rows see each other in one step; a chain's verdict in one kind

    def __init__(self, session, spec_round: Round, decoder, history: list[int], step: int, picks: bool):
        super().__init__(session, np.asarray(spec_round.tree.tokens, np.int64), "logits", 1)
        self.decoder, self.round, self.history, self.step = decoder, spec_round, history, step
        self.picks = picks          # each row's argmax is all the verdict and the caller need
        self.tree = TokenTree(spec_round.tree.parents) if spec_round.branched else None
        self.out: list[int] = []
        self.rows = None            # the logits rows [len(out), V] the emitted tokens came from (logits only)

    def picks_enough(self, final: bool) -> bool:
        return self.picks

    def take(self, rows, final: bool, kind: str) -> None:
        spec_round = self.round
        try:
            path, out = self.decoder.verdict(rows, spec_round, self.history, self.step)
            self.decoder.keep(spec_round, self.start_position, path)
        except Exception as e:          # fails this job alone (DecodeSteps rewinds and answers it), not the step
            self.error = e
            return
        self.decoder.record(spec_round.drafted, len(out), spec_round.nodes)
        self.out, self.rows = out, (rows[path] if kind == "logits" else None)
        self.result = ({}, {})

    def rewind(self) -> None:
        """The pass failed: the session as before it (the tree's nodes and the pending tree forgotten)."""
        session = self.session
        if not session.closed and session.position > self.start_position:
            session.truncate(self.start_position)


class ServedSpeculation:
    """One generation's speculative rounds on its session in the daemon, on the replica that holds the session
    (its draft, its step thread, its batch)."""

    def __init__(self, service, session, decoder):
        self.service, self.session, self.decoder = service, session, decoder
        self.replica = service.replica_of(session)

    @classmethod
    async def open(cls, service, session, params, seed: int, draft_max: int | None) -> "ServedSpeculation | None":
        """The rounds of a generation on `session` (the pass-time curve measured first, once, on the step
        thread); None where the draft has no room for one more stream."""
        replica = service.replica_of(session)
        speculation = replica.engine.speculation
        try:
            decoder = await replica.steps.run(speculation.decoder, session, params, seed, draft_max)
        except CapacityError:
            replica.spec_totals.refused += 1
            return None
        return cls(service, session, decoder)

    def plain_next(self, budget: int) -> bool:
        """Loop: whether the next step is a plain one whatever the batch (even a lone session would draft
        nothing: e.g. in VRAM, where a pass of k tokens costs k times one); the caller then takes it at once,
        without asking the step thread, and it counts as a plain pass."""
        if self.decoder.draft_length(budget, 1) > 0:
            return False
        self.record_plain()
        return True

    def record_plain(self) -> None:
        self.decoder.record(0, 1)
        self.replica.spec_totals.stats.record(0, 1)

    def plan(self, history: list[int], budget: int, step: int) -> Round | None:
        """Step thread: the round for the batch as it stands (spec/decoder.py), its pass at most a step's budget;
        its tokens checked, so that a bad one fails this generation before its pass joins a step."""
        batcher = self.replica.batcher
        spec_round = self.decoder.plan(history, step, min(budget, batcher.step_tokens),
                                       batcher.active_sessions(time.perf_counter()), batcher.step_tokens)
        if spec_round is not None:
            self.replica.engine.check_tokens(spec_round.tree.tokens, f"verify (session {self.session.id})")
        return spec_round

    async def round(self, token: int, history: list[int], step: int, budget: int, picks: bool = False):
        """(tokens emitted after `token`, the logits rows [n, V] they came from, or None with `picks`: the
        caller needs only the tokens of a greedy round without penalties) of a verified round, or None where
        the round drafts nothing: the caller then takes one plain step (already counted as a plain pass here)."""
        spec_round = await self.replica.steps.run(self.plan, history, budget, step)
        if spec_round is None:
            self.record_plain()
            return None
        picks = picks and self.decoder.picks_enough
        job = await self.service.run_job(VerifyJob(self.session, spec_round, self.decoder, history, step, picks))
        self.replica.spec_totals.stats.record(spec_round.drafted, len(job.out), spec_round.nodes)
        return job.out, job.rows

    async def finish(self, fed: int | None) -> None:
        """The generation ended with `fed` tokens in the session's KV (plain decoding's count: the last emitted
        token is not fed; None: the session is closed next): tokens a round fed past a stop are dropped, and the
        draft's stream closed."""
        with anyio.CancelScope(shield=True):
            await self.replica.steps.run(self.close, fed)

    def close(self, fed: int | None) -> None:
        """Step thread."""
        if fed is not None and not self.session.closed and self.session.position > fed:
            self.session.truncate(fed)
        self.decoder.close()


class SpecTotals:
    """The daemon's speculation counters, for stats and /metrics (the loop thread writes them)."""

    def __init__(self, speculation):
        self.speculation = speculation
        self.stats = SpecStats()
        self.refused = 0            # generations that decoded plainly: the draft had no room for their stream

    def as_dict(self) -> dict | None:
        if self.speculation is None:
            return None
        curve = self.speculation.curve
        return {"kind": self.speculation.kind, "policy": self.speculation.policy,
                "draft_max": self.speculation.draft_max, **self.stats.as_dict(), "spec_refused": self.refused,
                "pass_curve": curve.as_dict() if curve is not None else None}
