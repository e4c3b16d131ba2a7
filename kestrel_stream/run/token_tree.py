"""The shape of a token tree verified in one step: which node each drafted token hangs from.

A tree of n nodes is fed as n rows of one session's step.  Node 0 is the root
(the last emitted token); node i > 0 has a parent p < i.  Node i is written to
KV slot start + i, at rotary position start + depth(i), and sees the session's
keys before `start` and the slots of its ancestors and itself: a chain
(parent i - 1) is the causal step every backend already runs.  After the
target's verdict the accepted path's slots are moved to start, start + 1, ...
(Executor.move_kv), where their positions already are.

Kernels take the mask per row as three numbers (device_fields): `skip` = slot -
position, `span` = how many slots ending at the row's own slot the mask
covers, and `bits` (bit j: slot slot - span + 1 + j is visible).  A plain row
is (0, 0, 0).  Bits are one 64-bit word, so a tree has at most MAX_NODES nodes.
"""
from __future__ import annotations

import numpy as np

MAX_NODES = 64


class TokenTree:
    """parents [n] int (parents[0] = -1, parents[i] < i for i > 0): depths, visibility and the kernels' fields."""

    def __init__(self, parents):
        parents = np.asarray(parents, np.int64).reshape(-1)
        n = len(parents)
        if not 1 <= n <= MAX_NODES:
            raise ValueError(f"a token tree has 1..{MAX_NODES} nodes, got {n}")
        if parents[0] != -1 or any(not 0 <= parents[i] < i for i in range(1, n)):
            raise ValueError(f"token tree parents {parents.tolist()}: node 0 is the root (-1), "
                             "every other node's parent comes before it")
        self.parents = parents
        self.depth = np.zeros(n, np.int64)
        visible = np.eye(n, dtype=bool)             # [node, slot]: the node itself and its ancestors
        for i in range(1, n):
            self.depth[i] = self.depth[parents[i]] + 1
            visible[i] |= visible[parents[i]]
        self.visible = visible

    def __len__(self) -> int:
        return len(self.parents)

    @classmethod
    def chain(cls, n: int) -> "TokenTree":
        return cls(np.arange(-1, n - 1))

    @property
    def is_chain(self) -> bool:
        return bool(np.array_equal(self.parents, np.arange(-1, len(self) - 1)))

    def children(self, node: int) -> list[int]:
        return [int(i) for i in np.flatnonzero(self.parents == node)]

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root down to `node`."""
        path = [node]
        while path[-1] > 0:
            path.append(int(self.parents[path[-1]]))
        return path[::-1]

    def leaves(self) -> list[int]:
        has_child = np.zeros(len(self), bool)
        has_child[self.parents[1:]] = True
        return [int(i) for i in np.flatnonzero(~has_child)]

    def device_fields(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(skip int32 [n], span int32 [n], bits uint64 [n]): the mask as the kernels read it per row."""
        n = len(self)
        slots = np.arange(n)
        skip = (slots - self.depth).astype(np.int32)
        span = (slots + 1).astype(np.int32)
        weights = np.left_shift(np.uint64(1), slots.astype(np.uint64))
        bits = np.array([np.bitwise_or.reduce(weights[self.visible[i]]) for i in range(n)], np.uint64)
        return skip, span, bits


def step_tree_fields(batch, trees: list | None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """device_fields of a step's rows in order, plain sessions' rows (0, 0, 0); None where no session is a tree.
    batch: (kv, token ids [n_i], start) per session; trees: per session a TokenTree or None."""
    if trees is None or all(tree is None for tree in trees):
        return None
    parts = [tree.device_fields() if tree is not None else
             (np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.uint64))
             for tree, n in zip(trees, (len(np.atleast_1d(ids)) for _, ids, _ in batch))]
    return tuple(np.concatenate([part[i] for part in parts]) for i in range(3))


def visible_keys(span: np.ndarray, bits: np.ndarray, slots: np.ndarray, keys: int) -> np.ndarray:
    """[n, keys] bool: which of the session's first `keys` slots each row sees, from its device fields (span,
    bits) and its slot: the slots up to its own, less those of other branches (kv_cache.cuh TreeRow.sees)."""
    k, p = np.arange(keys)[None, :], np.asarray(slots)[:, None]
    lo = p - np.asarray(span)[:, None] + 1
    inside = np.clip(k - lo, 0, MAX_NODES - 1).astype(np.uint64)
    in_tree = ((np.asarray(bits, np.uint64)[:, None] >> inside) & np.uint64(1)).astype(bool)
    return (k <= p) & ((k < lo) | in_tree)
