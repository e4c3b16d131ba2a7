"""Prompt lookup: drafts copied from earlier in the sequence, no model.

The last n tokens (n from MAX_NGRAM down to 1) are looked for earlier in the
prompt and the output so far; the tokens that followed the most recent match
are the draft.  It pays where the output repeats its input (code given back
with a change, quoted passages, structured text).
"""
from __future__ import annotations

import numpy as np

from kestrel_stream.spec.tree import DraftTree, lookup_tree

MAX_NGRAM = 3


def lookup_draft(context: list[int], k: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of context's last n tokens."""
    if k <= 0 or len(context) < 2:
        return []
    seq = np.asarray(context, np.int64)
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        tail = seq[-n:]
        # windows starting at 0 .. len-n-1: every occurrence before the tail itself
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start:start + k].tolist()
    return []


class PromptLookup:
    """The draft of `--spec lookup`: one stream per generation, nothing to hold."""
    name = "lookup"
    proposes_trees = True       # its streams answer propose_tree (spec/tree.py)

    def open(self, max_seq_len: int) -> "LookupStream":
        return LookupStream()

    def token_seconds(self) -> float:
        return 0.0

    def device_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class LookupStream:
    def propose(self, context: list[int], k: int, params, seed: int, step: int):
        """(drafted tokens, None): lookup drafts are one-hot, whatever the sampling."""
        return lookup_draft(context, k), None

    def propose_tree(self, context: list[int], depth: int, budget: int, params) -> DraftTree:
        """Every earlier occurrence's continuation, merged into a tree (tree.lookup_tree)."""
        return lookup_tree(context, depth, budget, MAX_NGRAM)

    def close(self) -> None:
        pass
