"""Speculative decoding in the daemon: a generation's rounds, their verify passes batched with every session's steps.

Continuous batching mixes speculative and plain sessions in the same engine
steps this way: a round's drafting runs on the step thread between steps
(the draft model is an engine too, and the step thread owns the device), and
its verify pass (the last emitted token and k drafts, every row's logits) is
a job of the batcher like a prompt chunk: a multi-token entry of a step beside
other sessions' decode tokens and prompt chunks, under the step's token
budget.  The job keeps what the target accepts and rewinds the session's KV to
the kept path on the step thread, before any other job of that session runs.

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
from kestrel_stream.serve.step_jobs import PrefillJob
from kestrel_stream.spec.decoder import SpecStats


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
    """A verify pass: [token] + drafts with every row's logits; at its last chunk (step thread) the decoder keeps
    what the target accepts and the session's KV is rewound to the kept path."""
    __slots__ = ("decoder", "drafts", "q_rows", "history", "step", "out")
    op = "verify"

    def __init__(self, session, token: int, drafts: list[int], q_rows, decoder, history: list[int], step: int):
        super().__init__(session, np.asarray([token] + drafts, np.int64), "logits", 1)
        self.decoder, self.drafts, self.q_rows = decoder, drafts, q_rows
        self.history, self.step = history, step
        self.out: list[int] = []

    def take(self, rows, final: bool, greedy: bool) -> None:
        super().take(rows, final, greedy)
        if not final:
            return
        logits = self.result[1]["logits"]
        try:
            self.out = self.decoder.verify(logits, self.drafts, self.q_rows, self.history, self.step)
        except Exception as e:          # fails this job alone (DecodeSteps rewinds and answers it), not the step
            self.error = e
            return
        self.session.truncate(self.start_position + len(self.out))   # token and the kept drafts
        self.decoder.record(len(self.drafts), len(self.out))
        self.result = ({}, {"logits": logits[:len(self.out)]})


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

    def propose(self, history: list[int], budget: int, step: int):
        """Step thread: the round's k for the batch as it stands, and the drafts."""
        batch = self.replica.batcher.active_sessions(time.perf_counter())
        k = self.decoder.draft_length(budget, batch)
        return self.decoder.propose(history, k, step) if k > 0 else ([], None)

    async def round(self, token: int, history: list[int], step: int, budget: int):
        """(tokens emitted after `token`, their logits rows [n, V]) of a verified round, or None where the
        round drafts nothing: the caller then takes one plain step (already counted as a plain pass here)."""
        service = self.service
        drafts, q_rows = await self.replica.steps.run(self.propose, history, budget, step)
        if not drafts:
            self.record_plain()
            return None
        job = await service.run_job(VerifyJob(self.session, token, drafts, q_rows, self.decoder, history, step))
        self.replica.spec_totals.stats.record(len(drafts), len(job.out))
        return job.out, job.result[1]["logits"]

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
