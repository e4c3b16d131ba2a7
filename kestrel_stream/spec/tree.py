"""Token trees of drafts: how a draft grows one, and what the target keeps of it.

A tree's node 0 is the last emitted token; every other node is a drafted token
after its parent's path (run/token_tree.py is the shape the target's step
takes).  The target verifies all of it in one step (Session.prefill_tree) and
keeps one path: at each node, starting from the root, it takes the token it
would emit itself after that node's path (the greedy pick, or a draw from its
distribution with the Philox numbers plain decoding uses for that output
index) and moves to the child holding that token; where no child does, that
token is emitted and the round ends.  The tokens a round emits are therefore
draws from the target's own distributions whatever the draft proposed: greedy
output equals plain decoding's, and sampled output has the target's
distribution (the candidates of a node are fixed before the target's draw, so
keeping the child that equals the draw is exact, the multi-candidate form of
rejection sampling for deterministic drafts).

Growth (draft models): best first by the draft's chance of each path (the
product of its probabilities along it), level by level: each level adds, to
the nodes the level before added, at most BRANCH_WIDTHS[depth] children each,
the most likely first, up to the round's node budget less a node for each level
still to grow (so the best path reaches the round's depth), and beside the
level's best candidate only those with BRANCH_SHARE of its chance (a branch
where the draft is unsure); the first levels branch, the deeper ones follow
the draft's best token.  Prompt lookup branches where
earlier occurrences of the tail continued differently (lookup_tree).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kestrel_stream.spec.accept import ROW_TARGET, distribution, draw_from
from kestrel_stream.text.sampling import philox_uniform, sample_logits

BRANCH_WIDTHS = (4, 3, 2, 2)    # children a node may get at depth 0, 1, 2, 3; deeper: 1
MIN_PATH_SCORE = 1e-3           # a candidate whose path the draft gives less chance is not drafted
BRANCH_SHARE = 0.1              # nor one under this share of its level's best candidate's chance


@dataclass
class DraftTree:
    tokens: list[int]                       # node 0: the last emitted token
    parents: list[int]                      # parents[0] = -1, parents[i] < i
    scores: list[float] = field(default_factory=list)   # the draft's chance of each node's path (root: 1)

    @classmethod
    def chain(cls, root: int, drafts: list[int]) -> "DraftTree":
        return cls([root] + list(drafts), list(range(-1, len(drafts))), [1.0] * (len(drafts) + 1))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))

    @property
    def depth(self) -> int:
        depth = [0] * len(self.tokens)
        for i in range(1, len(self.tokens)):
            depth[i] = depth[self.parents[i]] + 1
        return max(depth)

    def child_with(self, node: int, token: int) -> int | None:
        for i in range(node + 1, len(self.tokens)):
            if self.parents[i] == node and self.tokens[i] == token:
                return i
        return None

    def add(self, parent: int, token: int, score: float) -> int:
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.scores.append(float(score))
        return len(self.tokens) - 1


def walk(tree: DraftTree, pick) -> tuple[list[int], list[int]]:
    """(the kept path's nodes from the root, the tokens the round emits): pick(node, emitted so far) is the
    target's own token after that node."""
    node, path, out = 0, [0], []
    while True:
        token = int(pick(node, out))
        out.append(token)
        child = tree.child_with(node, token)
        if child is None:
            return path, out
        path.append(child)
        node = child


def verify_tree(rows: np.ndarray, tree: DraftTree, params, seed: int, step: int,
                history: list[int]) -> tuple[list[int], list[int]]:
    """walk() with the target's logits rows [len(tree), vocab]: greedy picks (penalties over the history and
    the path) or draws from its distributions, output index `step` first.  history: every token so far, the
    root's last."""
    if params.greedy:
        return walk(tree, lambda node, out: sample_logits(rows[node], params, 0, 0, history + out))
    return walk(tree, lambda node, out: draw_from(distribution(rows[node], params, history + out),
                                                  philox_uniform(seed, step + len(out), ROW_TARGET)))


def verify_tree_argmax(picks: np.ndarray, tree: DraftTree) -> tuple[list[int], list[int]]:
    """verify_tree, greedy without penalties, from each node's argmax (int [len(tree)])."""
    return walk(tree, lambda node, out: picks[node])


def top_tokens(row: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(the `width` most likely tokens of a logits row, the most likely first and the lower id first on ties,
    their probabilities): a partition and one pass of exp over the row, not a sort of the vocabulary."""
    row = np.asarray(row, np.float64)
    width = min(width, len(row))
    kth = np.partition(row, len(row) - width)[len(row) - width]
    ids = np.flatnonzero(row >= kth)
    ids = ids[np.lexsort((ids, -row[ids]))][:width]
    top = row.max()
    return ids, np.exp(row[ids] - top) / np.exp(row - top).sum()


def grow_level(tree: DraftTree, frontier: list[int], rows: np.ndarray, budget: int, level: int,
               reserve: int = 0) -> list[int]:
    """Children for the nodes of `frontier` (added by the level before; rows: the draft's logits at each of
    them, [len(frontier), vocab]), best first, while the tree has fewer than `budget` nodes less `reserve` (one
    for each level still to grow: the best path reaches the round's depth whatever the branches take); the new
    nodes.  Beside the level's best candidate, a candidate needs BRANCH_SHARE of its score: a branch goes where
    the draft's distribution is flat, not beside a token it is sure of."""
    width = BRANCH_WIDTHS[level] if level < len(BRANCH_WIDTHS) else 1
    candidates = []
    for node, row in zip(frontier, rows):
        ids, probs = top_tokens(row, width)
        for token, prob in zip(ids.tolist(), probs.tolist()):
            score = tree.scores[node] * prob
            if score >= MIN_PATH_SCORE or token == int(ids[0]):
                candidates.append((-score, node, int(token)))
    candidates.sort()
    if candidates:
        floor = BRANCH_SHARE * -candidates[0][0]
        candidates = candidates[:1] + [c for c in candidates[1:] if -c[0] >= floor]
    room = max(budget - len(tree) - reserve, 1 if budget > len(tree) else 0)
    return [tree.add(node, token, -neg) for neg, node, token in candidates[:room]]


def lookup_tree(context: list[int], depth: int, budget: int, max_ngram: int) -> DraftTree:
    """Prompt lookup's tree: the continuations of every earlier occurrence of the context's last n tokens (the
    longest n with one), the latest first, merged where they agree, at most `depth` deep and `budget` nodes.
    A node's score is the share of occurrences through it."""
    tree = DraftTree([int(context[-1])], [-1], [1.0])
    if depth <= 0 or len(context) < 2:
        return tree
    seq = np.asarray(context, np.int64)
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))[::-1]
        if hits.size:
            break
    else:
        return tree
    share = 1.0 / hits.size
    for hit in hits:
        node = 0
        for token in seq[hit + n:hit + n + depth].tolist():
            child = tree.child_with(node, token)
            if child is None:
                if len(tree) >= budget:
                    break
                child = tree.add(node, token, 0.0)
            tree.scores[child] += share
            node = child
    return tree
