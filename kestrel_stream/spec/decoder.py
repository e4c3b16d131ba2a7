"""The rounds of speculative decoding on one target session.

A round feeds the last emitted token and k drafted ones as ONE multi-token
step (Session.prefill with every row's logits, or, greedy without penalties,
every row's argmax: on the device in gpu mode), keeps what accept.py says,
and truncates the target's KV to the kept path: after a round the session
holds exactly what plain decoding's would (every emitted token but the last),
so a caller may stop, cut or continue as after a plain step.

k comes from the Speculation's policy: under "auto" the cost model
(cost.choose_draft_length: the pass-time curve, the running acceptance, the
draft's measured time per token and the batch), 0 meaning a plain step; where
a low acceptance turned drafting off, a round at the prior acceptance's length
every REPROBE_PASSES plain passes finds out whether the text changed (a
reprobe that keeps nothing doubles the passes to the next one, up to
REPROBE_PASSES << MAX_REPROBE_DOUBLINGS; one that keeps a draft resets them); under
"always" it starts at draft_max and follows the acceptance (+2 after a fully
kept chain, -1 after a miss, at least 1).

A round may verify a token tree instead of a chain (spec/tree.py): where the draft
grows trees and the verdict is the target's own token at each node (greedy, or
prompt lookup's one-hot drafts), the tree's nodes come from the cost model
(cost.choose_tree_nodes: what the pass carries at the cost of the chain alone)
or, under "always", the Speculation's tree_nodes; the target keeps one path
(Session.keep_branch).

A round has three parts a caller may run apart (the daemon runs the verify
pass as a job of its batched steps, several sessions' trees in one step):
``plan`` (the Round: the drafted tree or chain), ``verdict`` over the
target's rows for that tree, then ``keep`` and ``record``; ``next_tokens``
runs them in a row on the session.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from kestrel_stream.obs import trace
from kestrel_stream.spec.accept import verify_argmax, verify_greedy, verify_sampled
from kestrel_stream.spec.cost import FLAT_RATIO, Acceptance, choose_draft_length, choose_tree_nodes
from kestrel_stream.spec.tree import DraftTree, verify_tree, verify_tree_argmax
from kestrel_stream.text.sampling import sample_logits

DRAFT_TIME_WEIGHT = 0.2     # the weight of the latest round in the draft's running time per token
REPROBE_PASSES = 16         # after this many plain passes the acceptance turned off, one round at the prior's
MAX_REPROBE_DOUBLINGS = 4   # ... after each reprobe that kept nothing, twice as many, up to 16 x REPROBE_PASSES
EMPTY_BACKOFF_MAX = 4       # after n rounds in a row with nothing drafted, 2 ** min(n, this) plain passes chained


@dataclass
class SpecStats:
    drafted: int = 0        # tokens the draft proposed
    accepted: int = 0       # of them, kept by the target
    passes: int = 0         # target steps taken while speculating (with or without drafts)
    emitted: int = 0        # tokens those steps produced
    plain_passes: int = 0   # of the passes, those the policy ran without drafts
    draft_length: int = 0   # the latest round's k
    tree_nodes: int = 0     # nodes the drafting passes verified (a chain of k: k + 1)

    def record(self, drafted: int, emitted: int, nodes: int | None = None) -> None:
        """A pass that checked `drafted` drafts (a tree: its depth; 0: a plain step) in `nodes` tokens (None:
        a chain's drafted + 1) and emitted `emitted` tokens."""
        self.tree_nodes += (drafted + 1 if nodes is None else nodes) if drafted else 0
        self.drafted += drafted
        self.accepted += emitted - 1
        self.passes += 1
        self.emitted += emitted
        self.plain_passes += 0 if drafted else 1
        self.draft_length = drafted

    def as_dict(self) -> dict:
        drafting = self.passes - self.plain_passes
        return {"spec_drafted": self.drafted, "spec_accepted": self.accepted, "spec_passes": self.passes,
                "spec_plain_passes": self.plain_passes,
                "spec_acceptance": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
                "spec_tokens_per_pass": round(self.emitted / self.passes, 4) if self.passes else 0.0,
                "spec_draft_length": round(self.drafted / drafting, 4) if drafting else 0.0,
                "spec_tree_nodes": round(self.tree_nodes / drafting, 4) if drafting else 0.0}


@dataclass
class Round:
    """What one speculative round verifies: a tree of drafts (node 0: the last emitted token), a chain where not
    `branched` (verified by rejection sampling against q_rows where the draft sampled them)."""
    tree: DraftTree
    q_rows: object = None           # np.ndarray [depth, vocab] of a sampled chain's draft distributions, or None
    branched: bool = False          # verified as a tree (Session.keep_branch) rather than a chain

    @property
    def drafted(self) -> int:
        """The round's drafts as SpecStats counts them: a chain's length, a tree's depth."""
        return self.tree.depth

    @property
    def nodes(self) -> int:
        return len(self.tree)


class DraftLength:
    """k under policy "always": the chain length of the next round, from the running acceptance."""
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
    def __init__(self, session, draft, draft_max: int, params, seed: int, speculation):
        # draft_max: the longest chain of this generation (the engine's, or less where a request asks)
        # speculation: the spec.Speculation this comes from (policy, the measured curve, the draft's time)
        self.session, self.params, self.seed = session, params, seed
        self.speculation = speculation
        self.stream = draft.open(session.max_seq_len)
        self.length = DraftLength(draft_max)
        self.acceptance = Acceptance()
        self.draft_s_per_token = speculation.draft_s_per_token or 0.0
        self.tree_s_per_level: float | None = None     # a tree's drafting time per level, once one was grown
        self.plain_run = 0          # plain passes since the last drafting one
        self.failed_probes = 0      # reprobes in a row that kept nothing (each doubles the next one's wait)
        self.probing = False        # the latest plan's k came from a reprobe
        self.round_k = 0            # the latest plan's draft length (0: a plain pass by the policy)
        self.empty_rounds = 0       # rounds in a row whose draft had nothing to propose (a lookup without a match)
        self.stretched = False      # the latest passes ran as a chained stretch (plain_tokens_ahead)
        self.stats = SpecStats()
        # token trees (spec/tree.py) where the draft grows them and the verdict is a draw of the target's own:
        # greedy, or drafts without a distribution (a draft model's sampled chains keep rejection sampling)
        self.branches = (draft.proposes_trees and speculation.tree_nodes > 1
                         and (params.greedy or draft.name == "lookup"))

    def draft_length(self, budget: int, batch: int = 1) -> int:
        """k for the next round: at most `budget` - 1 (the tokens still wanted) and the session's room;
        `batch`: the sessions whose tokens share the target's steps."""
        s = self.session
        k_max = min(self.length.max, budget - 1, s.max_seq_len - s.position - 1)
        if k_max <= 0:
            return 0
        if self.speculation.policy == "always":
            return min(self.length.k, k_max)
        curve, batch = self.speculation.curve, max(batch, 1)
        k = choose_draft_length(curve, self.acceptance.rate, k_max, batch, self.draft_s_per_token)
        self.probing = k == 0 and self.plain_run >= self.reprobe_after
        if self.probing:
            k = choose_draft_length(curve, Acceptance.PRIOR, k_max, batch, self.draft_s_per_token)
        return k

    @property
    def reprobe_after(self) -> int:
        """Plain passes, once the policy turned drafting off, before a round at the prior's acceptance."""
        return REPROBE_PASSES << min(self.failed_probes, MAX_REPROBE_DOUBLINGS)

    def plain_tokens_ahead(self, budget: int) -> int:
        """The plain passes to run before the next round tries to draft, at most `budget` (0: try now).  Where
        the policy drafts nothing, those until the reprobe (the cost model's inputs do not change over plain
        passes); where the draft had nothing to propose for n rounds in a row (a lookup finds no match in
        prose), 2 ** min(n, EMPTY_BACKOFF_MAX), one round tried between stretches.  A caller may run them
        chained on the device (several steps, one sync) and record them with record_plain."""
        if self.speculation.policy != "auto" or budget <= 1:
            return 0
        if self.draft_length(budget) == 0:
            return min(budget, self.reprobe_after - self.plain_run % self.reprobe_after)    # past a "no": a stretch
        if self.stretched or not self.empty_rounds:
            return 0
        return min(budget, 2 ** min(self.empty_rounds, EMPTY_BACKOFF_MAX))

    def record_plain(self, passes: int) -> None:
        """`passes` plain passes run outside next_tokens (plain_tokens_ahead's), one token each."""
        for _ in range(passes):
            self.record(0, 1)
        self.stretched = True

    def tree_nodes(self, k: int, batch: int = 1) -> int:
        """The nodes of this round's tree of depth k (k + 1: a chain): under "auto" what the flat part of the
        pass-time curve carries (cost.choose_tree_nodes), under "always" the Speculation's tree_nodes; within
        the session's room."""
        if k <= 0 or not self.branches:
            return k + 1
        s, most = self.session, self.speculation.tree_nodes
        if self.speculation.policy == "auto":
            if not self.trees_pay(k, batch):
                return k + 1
            most = choose_tree_nodes(self.speculation.curve, k, max(batch, 1), most)
        return max(k + 1, min(most, s.max_seq_len - s.position))

    def trees_pay(self, k: int, batch: int = 1) -> bool:
        """Whether growing a tree of depth k costs the draft little beside the pass it rides on: its time over a
        chain's (a tree's levels are draft passes over the tree so far, each row's logits back) within what
        FLAT_RATIO allows a pass to grow.  Unknown before a first tree: tried."""
        if self.tree_s_per_level is None:
            return True
        extra = k * max(self.tree_s_per_level - self.draft_s_per_token, 0.0)
        return extra <= (FLAT_RATIO - 1.0) * self.speculation.curve.time_s(max(batch, 1) * (k + 1))

    def propose_tree(self, history: list[int], k: int, nodes: int) -> DraftTree:
        """A tree of depth <= k and <= `nodes` nodes after `history`; the draft's time is measured."""
        started = time.perf_counter()
        with trace.lane_span("draft", "draft", k=k, nodes=nodes):
            tree = self.stream.propose_tree(history, k, nodes, self.params)
        if len(tree) > 1:
            per_level = (time.perf_counter() - started) / tree.depth
            last = self.tree_s_per_level if self.tree_s_per_level is not None else per_level
            self.tree_s_per_level = last + DRAFT_TIME_WEIGHT * (per_level - last)
        return tree

    def propose(self, history: list[int], k: int, step: int):
        """(up to k drafted tokens after `history`, their q rows or None); the draft's time is measured."""
        started = time.perf_counter()
        with trace.lane_span("draft", "draft", k=k):
            drafts, q_rows = self.stream.propose(history, k, self.params, self.seed, step)
        drafts = drafts[:k]
        if drafts:
            per_token = (time.perf_counter() - started) / len(drafts)
            self.draft_s_per_token += DRAFT_TIME_WEIGHT * (per_token - self.draft_s_per_token)
        return drafts, (q_rows[:len(drafts)] if q_rows is not None else None)

    def verify(self, rows, drafts: list[int], q_rows, history: list[int], step: int) -> list[int]:
        """The tokens the target emits for `drafts`: rows [len(drafts) + 1, vocab], its logits after history
        and each drafted prefix."""
        if self.params.greedy:
            return verify_greedy(rows, drafts, self.params, history)
        return verify_sampled(rows, drafts, q_rows, self.params, self.seed, step, history)

    def record(self, drafted: int, emitted: int, nodes: int | None = None) -> None:
        """A pass that checked `drafted` drafts (a tree: its depth; 0: a plain step) in `nodes` tokens (None: a
        chain) and emitted `emitted` tokens."""
        if drafted:
            self.length.update(drafted, emitted - 1)
            self.acceptance.record(drafted, emitted - 1)
        if drafted and self.probing:
            self.failed_probes = self.failed_probes + 1 if emitted <= 1 else 0
        elif drafted and emitted > 1:
            self.failed_probes = 0
        self.plain_run = 0 if drafted else self.plain_run + 1
        self.stats.record(drafted, emitted, nodes)

    @property
    def picks_enough(self) -> bool:
        """Greedy without penalties: each row's argmax (on the device in gpu mode) is all a verdict needs."""
        return self.params.greedy and not self.params.penalized

    def plan(self, history: list[int], step: int, budget: int, batch: int = 1,
             max_nodes: int | None = None) -> "Round | None":
        """The round after `history` (its last token the tree's root): the drafted tree or chain, or None where
        it drafts nothing (a plain step).  `batch`: the sessions sharing the target's steps; `max_nodes`: the
        most tokens the verify pass may take (None: the session's room alone)."""
        k = self.round_k = self.draft_length(budget, batch)
        nodes = self.tree_nodes(k, batch)
        if max_nodes is not None:
            nodes = min(nodes, max(max_nodes, k + 1))
        if nodes > k + 1:
            tree = self.propose_tree(history, k, nodes)
            if len(tree) == 1:
                return None
            return Round(tree, None, branched=not tree.is_chain)
        drafts, q_rows = self.propose(history, k, step) if k > 0 else ([], None)
        return Round(DraftTree.chain(history[-1], drafts), q_rows, branched=False) if drafts else None

    def verdict(self, rows, spec_round: "Round", history: list[int], step: int) -> tuple[list[int], list[int]]:
        """(the kept path's nodes from the root, the tokens the round emits) from the target's rows over the
        round's tree: logits [n, vocab], or each node's argmax int [n] where picks_enough."""
        tree = spec_round.tree
        picks = rows.ndim == 1
        if spec_round.branched:
            return verify_tree_argmax(rows, tree) if picks else verify_tree(rows, tree, self.params, self.seed,
                                                                            step, history)
        drafts = tree.tokens[1:]
        out = verify_argmax(rows, drafts) if picks else self.verify(rows, drafts, spec_round.q_rows, history, step)
        return list(range(len(out))), out

    def keep(self, spec_round: "Round", start: int, path: list[int]) -> None:
        """The session after a verify pass from position `start`: the root and the kept drafts (the last emitted
        token is not fed), the other nodes forgotten."""
        if spec_round.branched:
            self.session.keep_branch(path)
        else:
            self.session.truncate(start + len(path))

    def next_tokens(self, token: int, history: list[int], step: int, budget: int) -> list[int]:
        """Feed `token` (the last of `history`, every token of the sequence so far) and return the tokens
        after it, at least one and at most `budget`; the first is output index `step` of the sampler."""
        s = self.session
        self.stretched = False
        spec_round = self.plan(history, step, budget)
        self.empty_rounds = 0 if spec_round is not None else self.empty_rounds + (self.round_k > 0)
        if spec_round is None:
            out = [self._plain(token, history, step)]
            self.record(0, 1)
            return out
        start, kind = s.position, "argmax" if self.picks_enough else "all"
        tree = spec_round.tree
        rows = (s.prefill_tree(tree.tokens, tree.parents, logits=kind) if spec_round.branched
                else s.prefill(tree.tokens, logits=kind))
        path, out = self.verdict(rows, spec_round, history, step)
        self.keep(spec_round, start, path)
        self.record(spec_round.drafted, len(out), len(tree))
        return out

    def _plain(self, token: int, history: list[int], step: int) -> int:
        """One plain step, the draws plain decoding makes."""
        s, params = self.session, self.params
        if params.penalized:
            return sample_logits(s.decode(token), params, self.seed, step, history)
        return s.decode_greedy(token) if params.greedy else s.decode_sample(token, params, self.seed, step)

    def close(self) -> None:
        self.stream.close()
