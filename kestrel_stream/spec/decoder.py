"""The rounds of speculative decoding on one target session.

A round feeds the last emitted token and k drafted ones as ONE multi-token
step (Session.prefill with every row's logits, or, greedy without penalties,
every row's argmax: on the device in gpu mode), keeps what accept.py says,
and truncates the target's KV to the kept path: after a round the session
holds exactly what plain decoding's would (every emitted token but the last),
so a caller may stop, cut or continue as after a plain step.  k starts at
draft_max and follows the acceptance: +2 after a fully kept chain, -1 after a
miss (at least 1).
"""
from __future__ import annotations

from dataclasses import dataclass

from kestrel_stream.spec.accept import verify_argmax, verify_greedy, verify_sampled
from kestrel_stream.text.sampling import sample_logits


@dataclass
class SpecStats:
    drafted: int = 0        # tokens the draft proposed
    accepted: int = 0       # of them, kept by the target
    passes: int = 0         # target steps taken while speculating (with or without drafts)
    emitted: int = 0        # tokens those steps produced

    def as_dict(self) -> dict:
        return {"spec_drafted": self.drafted, "spec_accepted": self.accepted, "spec_passes": self.passes,
                "spec_acceptance": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
                "spec_tokens_per_pass": round(self.emitted / self.passes, 4) if self.passes else 0.0}


class DraftLength:
    """k, the chain length of the next round, from the running acceptance."""
    GROW, SHRINK = 2, 1

    def __init__(self, draft_max: int):
        self.max = draft_max
        self.k = draft_max

    def update(self, drafted: int, accepted: int) -> None:
        if drafted and accepted == drafted:
            self.k = min(self.max, self.k + self.GROW)
        elif drafted:
            self.k = max(1, self.k - self.SHRINK)


class SpecDecoder:
    def __init__(self, session, draft, draft_max: int, params, seed: int):
        self.session, self.params, self.seed = session, params, seed
        self.stream = draft.open(session.max_seq_len)
        self.length = DraftLength(draft_max)
        self.stats = SpecStats()

    def next_tokens(self, token: int, history: list[int], step: int, budget: int) -> list[int]:
        """Feed `token` (the last of `history`, every token of the sequence so far) and return the tokens
        after it, at least one and at most `budget`; the first is output index `step` of the sampler."""
        s, params = self.session, self.params
        k = min(self.length.k, budget - 1, s.max_seq_len - s.position - 1)
        drafts, q_rows = self.stream.propose(history, k, params, self.seed, step) if k > 0 else ([], None)
        drafts = drafts[:max(k, 0)]
        if not drafts:
            out = [self._plain(token, history, step)]
        else:
            start = s.position
            if params.greedy and not params.penalized:     # each row's argmax is all greedy needs
                out = verify_argmax(s.prefill([token] + drafts, logits="argmax"), drafts)
            else:
                rows = s.prefill([token] + drafts, logits="all")
                out = (verify_greedy(rows, drafts, params, history) if params.greedy else
                       verify_sampled(rows, drafts, q_rows, params, self.seed, step, history))
            s.truncate(start + len(out))          # token and the kept drafts; the last emitted is not fed
        kept = len(out) - 1
        self.length.update(len(drafts), kept)
        self.stats.drafted += len(drafts)
        self.stats.accepted += kept
        self.stats.passes += 1
        self.stats.emitted += len(out)
        return out

    def _plain(self, token: int, history: list[int], step: int) -> int:
        """One plain step, the draws plain decoding makes."""
        s, params = self.session, self.params
        if params.penalized:
            return sample_logits(s.decode(token), params, self.seed, step, history)
        return s.decode_greedy(token) if params.greedy else s.decode_sample(token, params, self.seed, step)

    def close(self) -> None:
        self.stream.close()
