"""How a draft model's token tree grows (spec/tree.py): the best path reaches the round's depth whatever the
branches take, branches go only where the draft is unsure, and the top tokens of a row are a stable sort's."""
from __future__ import annotations

import numpy as np

from kestrel_stream.spec.tree import BRANCH_SHARE, DraftTree, grow_level, top_tokens


def test_top_tokens_are_a_stable_sorts_first_with_softmax_probabilities():
    rng = np.random.default_rng(0)
    for vocab, width in ((10, 4), (1000, 3), (151936, 4), (3, 5)):
        row = rng.integers(-8, 8, vocab).astype(np.float32)        # many ties
        ids, probs = top_tokens(row, width)
        expected = np.argsort(-row.astype(np.float64), kind="stable")[:width]
        assert ids.tolist() == expected.tolist()
        row64 = row.astype(np.float64)
        softmax = np.exp(row64 - row64.max()) / np.exp(row64 - row64.max()).sum()
        np.testing.assert_allclose(probs, softmax[expected], rtol=1e-12)


def rows_for(frontier, sure: bool, vocab: int = 50):
    """A draft's logits at each frontier node: one token at 0.95 (sure), or four near-equal ones (unsure)."""
    rows = np.full((len(frontier), vocab), -30.0)
    for i, node in enumerate(frontier):
        best = (node * 7 + 3) % vocab
        if sure:
            rows[i, best] = 0.0
            rows[i, (best + 1) % vocab] = np.log(0.05 / 0.95)
        else:
            rows[i, [best, (best + 1) % vocab, (best + 2) % vocab, (best + 3) % vocab]] = [0.0, -0.05, -0.1, -0.15]
    return rows


def grow(depth: int, budget: int, sure: bool) -> DraftTree:
    tree, frontier = DraftTree([1], [-1], [1.0]), [0]
    for level in range(depth):
        frontier = grow_level(tree, frontier, rows_for(frontier, sure), budget, level, reserve=depth - level - 1)
        if not frontier:
            break
    return tree


def test_the_best_path_reaches_the_depth_within_any_budget():
    for budget in (9, 12, 16, 32, 64):
        tree = grow(8, budget, sure=False)
        assert tree.depth == 8 and len(tree) <= budget, (budget, tree.depth, len(tree))
        assert len(tree) == budget or budget > 9 and len(tree) > 9   # unsure: the rest of the budget: branches


def test_a_sure_draft_grows_a_chain_an_unsure_one_branches():
    sure = grow(8, 32, sure=True)
    assert sure.is_chain and sure.depth == 8           # the 0.05 siblings are under BRANCH_SHARE of 0.95
    assert 0.05 < BRANCH_SHARE * 0.95
    unsure = grow(3, 32, sure=False)
    assert not unsure.is_chain and unsure.depth == 3
    children_of_root = [i for i, p in enumerate(unsure.parents) if p == 0]
    assert len(children_of_root) == 4
