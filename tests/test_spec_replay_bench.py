"""bench/spec_replay.py: the rounds each drafting policy makes over a target's text and a draft's rows (what a
round keeps, drafts and costs, checked by hand on a short text), and the bench end to end on a tiny model
drafting for itself (every drafted token kept)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bench import spec_replay
from bench.spec_replay import Policy, Rows, replay
from kestrel_stream.spec.cost import PassCurve

CURVE = PassCurve((1, 16), (0.010, 0.025))      # 10 ms, then 1 ms a token more
TEXT = [10, 11, 12, 13, 14, 15, 16, 17]


def rows(misses: dict[int, tuple[int, float]]) -> Rows:
    """The draft's first candidate is the text's token at 0.9, except at the positions in `misses`: there the
    text's token is its second candidate, at the chance given (the first one, 99, at 0.5)."""
    top = np.array([[t, 99, 98, 97] for t in TEXT], np.int64)
    chance = np.tile([0.9, 0.05, 0.03, 0.02], (len(TEXT), 1))
    for j, (second, p) in misses.items():
        top[j, :2], chance[j, :2] = (99, second), (0.5, p)
    return Rows(np.array(TEXT, np.int64), top, chance)


def test_chains_keep_the_run_before_the_first_miss_and_the_targets_token_there():
    r = replay(rows({3: (13, 0.4)}), Policy("chain", 4), CURVE, 0.001)
    # round 1: drafts 10..13, keeps 3 (13 missed), emits 4 (position 4); round 2: drafts 4 (kept), emits 5
    assert (r.tokens, r.passes, r.drafted) == (8, 2, 7)
    # passes of 5 and 4 nodes (10 ms + 1 ms a node past the first) and 7 drafted tokens at 1 ms
    assert r.seconds == pytest.approx(0.014 + 0.013 + 0.007)


def test_a_sibling_leaf_holding_the_targets_token_keeps_it_and_the_token_after():
    r = replay(rows({3: (13, 0.4)}), Policy("sibling", 4, 0.5), CURVE, 0.001)
    # round 1: the leaf at position 3 (0.4 >= 0.5 * 0.5) was the target's token: 3 kept + leaf + its next = 5
    assert (r.tokens, r.passes) == (8, 2)
    assert r.seconds == pytest.approx(0.015 + 0.012 + 0.006)     # round 1's leaf is a node of its pass
    weak = replay(rows({3: (13, 0.2)}), Policy("sibling", 4, 0.5), CURVE, 0.001)
    assert weak.passes == 2 and weak.seconds == pytest.approx(0.014 + 0.013 + 0.007)    # no leaf, as a chain


def test_a_round_after_a_fully_kept_chain_pays_the_drafts_catch_up():
    r = replay(rows({}), Policy("chain", 3), CURVE, 0.001)
    # rounds at 0 and 4 keep all 3 drafts and emit 4 each; the second drafts after a kept chain, so its draft
    # first feeds the first chain's last token: one more draft pass
    assert (r.tokens, r.passes, r.drafted) == (8, 2, 6)
    assert r.seconds == pytest.approx(2 * 0.013 + 6 * 0.001 + 0.001)


def test_a_gate_stops_drafting_where_the_draft_is_unsure():
    r = replay(rows({3: (13, 0.4)}), Policy("gate", 8, 0.6), CURVE, 0.001)
    # round 1 drafts 3 (position 3's 0.5 < 0.6), keeps them, emits 4; round 2 drafts the last 3 of 4 left
    assert (r.passes, r.drafted) == (2, 6)


def test_the_bench_on_a_model_drafting_for_itself_keeps_every_drafted_token(tiny_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox\n---\nOnce upon a time")
    out = spec_replay.main(["--target", str(tiny_model), "--draft", str(tiny_model), "--prompts", str(prompts),
                            "-n", "12", "--policy", "chain 4", "--policy", "auto 4", "--out", str(tmp_path / "out")])
    chains = [r for r in out if r["policy"] == "chain 4" and r["prompt"] != "geometric mean"]
    assert len(chains) == 2
    for r in chains:     # 12 tokens in rounds of 5 kept (4 drafted + the target's), the last round short
        assert r["tokens"] == 12 and r["tokens_per_pass"] == pytest.approx(12 / 3)
    means = {r["policy"]: r["modeled_speedup"] for r in out if r["prompt"] == "geometric mean"}
    assert set(means) == {"chain 4", "auto 4"} and means["chain 4"] > 1
    saved = json.loads(next((tmp_path / "out").glob("*-spec-replay.json")).read_text())
    assert saved["rows"] == out


def test_a_bad_policy_or_curve_is_a_clear_error(tiny_model, tmp_path):
    with pytest.raises(SystemExit, match="policy 'tree 4'"):
        spec_replay.main(["--target", "t", "--draft", "d", "--prompts", "p", "--policy", "tree 4"])
    with pytest.raises(SystemExit, match="--curve"):
        spec_replay.main(["--target", "t", "--draft", "d", "--prompts", "p", "--curve", "1-10"])
