"""A draft model: a small model of the target's tokenizer, an engine of its own with its own sessions and KV.

Each generation opens a stream: one draft session that follows the target's
sequence.  Before a round the session is rewound to what it shares with the
target's sequence (the drafts the target rejected go) and fed the rest; then
it drafts k tokens, greedy (chained on the device in gpu mode: k steps, one
sync) or drawn one step each with the generation's sampling parameters (the q
that rejection sampling divides by).  The draft's
rows are read in the target's vocabulary (cut, or padded with tokens it never
draws), so p and q line up.
"""
from __future__ import annotations

import numpy as np

from kestrel_stream.spec.accept import ROW_DRAFT, distribution, draw_from
from kestrel_stream.spec.tree import DraftTree, grow_level
from kestrel_stream.text.sampling import philox_uniform, sample_logits


class DraftModel:
    name = "draft"
    proposes_trees = True       # its streams answer propose_tree (spec/tree.py)

    def __init__(self, engine, target_vocab: int):
        self.engine, self.target_vocab = engine, target_vocab

    def open(self, max_seq_len: int) -> "DraftModelStream":
        return DraftModelStream(self, min(max_seq_len, self.engine.max_seq_len))

    @property
    def source(self) -> str:
        return str(self.engine.weights.source)

    def token_seconds(self) -> float:
        """The draft's one-token pass time (the engine's thread), before its rounds measure it."""
        from kestrel_stream.spec.measure import measure_pass_curve
        return measure_pass_curve(self.engine, 1).seconds[0]

    def device_bytes(self) -> int:
        if self.engine.mode != "gpu":
            return 0
        memory = self.engine.executor.backend.memory
        return memory.arena_bytes + memory.kv.max_bytes          # the pool is fixed (ks.load's kv_pool_bytes)

    def close(self) -> None:
        self.engine.close()


class DraftModelStream:
    def __init__(self, model: DraftModel, max_seq_len: int):
        self.model = model
        self.session = model.engine.new_session(max_seq_len)

    def _rows_in_target_vocab(self, logits: np.ndarray) -> np.ndarray:
        vocab = self.model.target_vocab
        if len(logits) >= vocab:
            return logits[:vocab]
        return np.concatenate([logits, np.full(vocab - len(logits), -np.inf, np.float32)])

    def _rewind(self, context: list[int]) -> int:
        """Rewind the session to what it shares with context[:-1] (the drafts the target rejected go); that length."""
        s = self.session
        common = 0
        for mine, theirs in zip(s.tokens, context[:-1]):
            if mine != theirs:
                break
            common += 1
        if common < s.position:
            s.truncate(common)
        return common

    def _catch_up(self, ids: list[int]) -> None:
        """Feed the tokens the session lacks, their logits unused: on the device each row's argmax comes back
        (4 bytes a row) instead of a row of the vocabulary; on the host the last row's logits alone are made."""
        self.session.prefill(ids, logits="argmax" if self.model.engine.device == "cuda" else "last")

    def propose(self, context: list[int], k: int, params, seed: int, step: int):
        """(up to k drafted tokens after `context`, their q rows [n, vocab] or None when greedy)."""
        s, vocab = self.session, self.model.target_vocab
        k = min(k, s.max_seq_len - len(context) + 1)          # the k-th draft is not fed
        if k <= 0 or len(context) > s.max_seq_len:
            return [], None
        device_greedy = params.greedy and not params.penalized
        common = self._rewind(context)
        if device_greedy and self.model.engine.device == "cuda":     # k steps chained on the device, one sync
            if common < len(context) - 1:
                self._catch_up(context[common:-1])
            chained = self.model.engine.generate_chained(s, context[-1], k)
            if chained is not None:
                cut = next((i for i, t in enumerate(chained) if t >= vocab), len(chained))
                return chained[:cut], None
            common = len(context) - 1
        logits = s.prefill(context[common:], logits="last")
        drafts, q_rows = [], []
        for i in range(k):
            if i > 0:
                if device_greedy:
                    token = s.decode_greedy(drafts[-1])
                    if token >= vocab:                      # a padding row of a larger draft vocabulary
                        break
                    drafts.append(token)
                    continue
                logits = s.decode(drafts[-1])
            row = self._rows_in_target_vocab(logits)
            history = context + drafts
            if params.greedy:
                drafts.append(sample_logits(row, params, 0, 0, history))
            else:
                q = distribution(row, params, history)
                q_rows.append(q)
                drafts.append(draw_from(q, philox_uniform(seed, step + i, ROW_DRAFT)))
        return drafts, (np.stack(q_rows) if q_rows else None)

    def propose_tree(self, context: list[int], depth: int, budget: int, params) -> DraftTree:
        """A tree of at most `budget` nodes and `depth` levels after `context` (its root: context[-1]), grown
        best first (tree.grow_level): one draft pass a level over the tree so far (Session.prefill_tree),
        the session rewound to context[:-1] after each."""
        s = self.session
        tree = DraftTree([int(context[-1])], [-1], [1.0])
        budget = min(budget, s.max_seq_len - len(context) + 1)       # the tree's slots follow context[:-1]
        depth = min(depth, budget - 1)
        if depth <= 0:
            return tree
        common = self._rewind(context)
        if common < len(context) - 1:
            self._catch_up(context[common:-1])
        base, frontier = s.position, [0]
        for level in range(depth):
            rows = s.prefill_tree(tree.tokens, tree.parents)
            s.truncate(base)
            frontier = grow_level(tree, frontier, [self._rows_in_target_vocab(rows[i]) for i in frontier], budget,
                                  level, reserve=depth - level - 1)
            if not frontier:
                break
        return tree

    def close(self) -> None:
        self.session.close()
