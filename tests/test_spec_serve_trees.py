"""The daemon's speculative rounds verify token trees, as in-process generation does: greedy output over the
socket and HTTP equals plain decoding's and the in-process speculative run's (the same rounds: drafted tokens,
passes and tree nodes alike) with a draft model and with prompt lookup; several sessions' trees verify in one
step; a tree that fails (past its session's room, a bad token) fails its generation alone; sampled rounds keep
the model's distribution (chi-square); the tree figures reach stats and /metrics."""
from __future__ import annotations

import threading
import urllib.request

import numpy as np
import pytest
from http_helpers import metric
from inprocess_daemon import InProcessDaemon
from test_spec_sampling import assert_matches
from test_spec_serve import (NEW_TOKENS, PROMPTS, batch_invariant_arithmetic, completion, models,  # noqa: F401
                             plain, run_threads)

import kestrel_stream as ks
from kestrel_stream.errors import CapacityError, InvalidTokenError
from kestrel_stream.spec.accept import distribution
from kestrel_stream.spec.decoder import Round, SpecDecoder
from kestrel_stream.spec.tree import DraftTree
from kestrel_stream.text.sampling import SamplingParams

# prompts for the test model (chat_model) in which the first generated token came before with several
# continuations, so prompt lookup drafts a tree at the first round: greedy (217 follows), and sampled with
# SAMPLED (its first token is one of 190, 217, 230)
LOOKUP_IDS = [217, 20, 21, 217, 30, 31, 217, 40, 41, 2, 6]
SAMPLED_IDS = [190, 50, 60, 190, 70, 80, 217, 51, 61, 217, 71, 81, 230, 52, 62, 230, 72, 82, 2, 12]
SAMPLED = dict(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
DRAWS = 1500
DRAFTS = {"model": {"draft": "perturbed"}, "lookup": {"spec": "lookup"}}


def load_of(draft: str, models) -> dict:
    load = {"spec_policy": "always", **DRAFTS[draft]}
    if "draft" in load:
        load["draft"] = str(models[load["draft"]])
    return load


def in_process(models, load: dict, prompts, **sampling) -> dict:
    """Engine.generate's speculative answers (tokens and figures) of each prompt."""
    engine = ks.load(str(models["itself"]), device="cpu", **load)
    try:
        return {tuple(p) if isinstance(p, list) else p: engine.generate(p, NEW_TOKENS, **sampling) for p in prompts}
    finally:
        engine.close()


def same_rounds(served: dict, expected: dict) -> None:
    for key in ("spec_drafted", "spec_accepted", "spec_passes", "spec_tree_nodes"):
        assert served[key] == expected[key], (key, served, expected)


@pytest.mark.parametrize("draft", sorted(DRAFTS))
def test_served_trees_give_plain_decodings_tokens_and_the_in_process_rounds(draft, models, plain, tmp_path):
    load = load_of(draft, models)
    prompts = list(PROMPTS) + [LOOKUP_IDS]
    expected = in_process(models, load, prompts)
    d = InProcessDaemon(models["itself"], tmp_path, load=load)
    try:
        with ks.Client(str(d.socket_path)) as client:
            for prompt in prompts:
                key = tuple(prompt) if isinstance(prompt, list) else prompt
                answer = client.generate(prompt, NEW_TOKENS)
                assert answer.tokens == expected[key].tokens, prompt
                if key in plain:
                    assert answer.tokens == plain[key].tokens, prompt
                same_rounds(answer.speculation, expected[key].stats)
        trees = expected[tuple(LOOKUP_IDS)].stats         # a tree: more nodes than its longest path
        assert trees["spec_tree_nodes"] > trees["spec_draft_length"] + 1, trees
        for prompt in PROMPTS:
            assert completion(d.http_port, prompt)["choices"][0]["text"] == plain[prompt].text
        stats = d.service.stats()["speculation"]
        assert stats["spec_tree_nodes"] > stats["spec_draft_length"] + 1
        with urllib.request.urlopen(f"http://127.0.0.1:{d.http_port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        assert metric(text, "kestrel_spec_tree_nodes") == pytest.approx(stats["spec_tree_nodes"])
        assert metric(text, "kestrel_spec_draft_length") == pytest.approx(stats["spec_draft_length"])
        assert d.settled_sessions() == 0
    finally:
        d.stop()


def counting_tree_steps(engine, monkeypatch) -> list[int]:
    """The token trees of each engine step with any (filled in as the daemon runs)."""
    per_step, real_step = [], engine.step

    def step(items, greedy=False, logits="all", trees=None):
        if trees is not None:
            per_step.append(sum(tree is not None for tree in trees))
        return real_step(items, greedy=greedy, logits=logits, trees=trees)
    monkeypatch.setattr(engine, "step", step)
    return per_step


def test_several_sessions_trees_verify_in_one_step(models, plain, tmp_path, monkeypatch):
    d = InProcessDaemon(models["itself"], tmp_path, max_sessions=8, load=load_of("model", models))
    per_step = counting_tree_steps(d.engine, monkeypatch)
    results, errors = {}, []

    def client(i: int) -> None:
        try:
            with ks.Client(str(d.socket_path)) as c:
                results[i] = c.generate(PROMPTS[i % len(PROMPTS)], NEW_TOKENS).tokens
        except Exception as e:
            errors.append(e)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    try:
        run_threads(threads, errors)
        assert {i: plain[PROMPTS[i % len(PROMPTS)]].tokens for i in range(6)} == results
        assert max(per_step) >= 2, per_step          # trees of several sessions in one step
        assert d.settled_sessions() == 0 and not d.engine.speculation.draft.engine.sessions
    finally:
        d.stop()


def failing_plan(vocab: int, failing: dict):
    """SpecDecoder.plan, except for a generation whose history starts with failing["prompt"]: its round is a tree
    of 64 nodes (past a session of 64 positions: failing["kind"] "room") or one with a token outside the
    vocabulary ("token")."""
    real_plan = SpecDecoder.plan

    def plan(self, history, step, budget, batch=1, max_nodes=None):
        prompt = failing.get("prompt")
        if prompt is None or history[:len(prompt)] != prompt:
            return real_plan(self, history, step, budget, batch, max_nodes)
        tree = DraftTree([history[-1]], [-1], [1.0])
        if failing["kind"] == "room":
            for token in range(1, 64):
                tree.add(0, token, 0.01)
        else:
            tree.add(0, vocab, 0.5)
        return Round(tree, None, branched=True)
    return plan


@pytest.mark.parametrize("kind", ["room", "token"])
def test_a_tree_that_fails_fails_its_generation_alone(kind, models, plain, tmp_path, monkeypatch):
    """One session's tree past its room (the verify pass fails in its step) or with a bad token (refused before
    it joins one), while other sessions speculate: that generation answers an error, the others their tokens,
    the connection serves on, no session is left open and the totals count the good rounds only."""
    d = InProcessDaemon(models["itself"], tmp_path, max_sessions=8,
                        load={**load_of("model", models), "max_seq_len": 64})
    vocab = d.engine.config.vocab_size
    bad_prompt = d.engine.tokenizer.encode("fail here", add_special=False)
    failing = {"prompt": bad_prompt, "kind": kind}
    monkeypatch.setattr(SpecDecoder, "plan", failing_plan(vocab, failing))
    good, errors, failed = {}, [], []
    expected_error = CapacityError if kind == "room" else InvalidTokenError

    def client(i: int) -> None:
        try:
            with ks.Client(str(d.socket_path)) as c:
                if i == 0:
                    with pytest.raises(expected_error) as info:
                        c.generate(bad_prompt, 16)
                    failed.append(info.value)
                    failing["prompt"] = None        # the same connection serves on
                    good[i] = c.generate(PROMPTS[0], 16)
                else:
                    good[i] = c.generate(PROMPTS[i % len(PROMPTS)], 16)
        except Exception as e:
            errors.append(e)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    try:
        run_threads(threads, errors)
        assert len(failed) == 1 and len(good) == 4
        for i, answer in good.items():
            assert answer.tokens == plain[PROMPTS[i % len(PROMPTS)]].tokens[:16], i
        stats = d.service.stats()
        spec = stats["speculation"]
        assert spec["spec_passes"] == sum(a.speculation["spec_passes"] for a in good.values())
        assert spec["spec_drafted"] == sum(a.speculation["spec_drafted"] for a in good.values())
        assert stats["step_errors"] == (1 if kind == "room" else 0)
        assert d.settled_sessions() == 0 and not d.engine.speculation.draft.engine.sessions
    finally:
        d.stop()


def test_sampled_served_lookup_trees_keep_the_models_distribution(models, tmp_path):
    """Prompt lookup drafts trees for sampled rounds too (its drafts are one-hot): the first two tokens of
    generations with seeds 0..N-1 (the second from the first round's tree) are drawn as the model's own joint
    distribution says, and a generation is the in-process one."""
    load = load_of("lookup", models)
    engine = ks.load(str(models["itself"]), device="cpu")
    sampling = SamplingParams(**SAMPLED)
    with engine.new_session() as s:
        p_first = distribution(s.prefill(SAMPLED_IDS)[-1], sampling, SAMPLED_IDS)
        joint = np.zeros((engine.config.vocab_size, engine.config.vocab_size))
        for first in np.flatnonzero(p_first):
            second = distribution(s.decode(int(first)), sampling, SAMPLED_IDS + [int(first)])
            joint[first] = p_first[first] * second
            s.truncate(len(SAMPLED_IDS))
    engine.close()
    support = np.flatnonzero(joint.reshape(-1))
    expected = in_process(models, load, [SAMPLED_IDS], seed=3, **SAMPLED)[tuple(SAMPLED_IDS)]
    d = InProcessDaemon(models["itself"], tmp_path, load=load)
    counts = np.zeros(joint.size)
    try:
        with ks.Client(str(d.socket_path)) as client:
            answer = client.generate(SAMPLED_IDS, NEW_TOKENS, seed=3, **SAMPLED)
            assert answer.tokens == expected.tokens
            same_rounds(answer.speculation, expected.stats)
            for seed in range(DRAWS):
                # three tokens: the round after the first may draft one level (a budget of two)
                first, second, _ = client.generate(SAMPLED_IDS, 3, seed=seed, **SAMPLED).tokens
                counts[first * joint.shape[1] + second] += 1
        stats = d.service.stats()["speculation"]
        # every second token came from a tree's round, every third from a plain pass (a budget of one)
        assert stats["spec_plain_passes"] == expected.stats["spec_plain_passes"] + DRAWS
        assert stats["spec_passes"] == expected.stats["spec_passes"] + 2 * DRAWS
        assert stats["spec_tree_nodes"] > stats["spec_draft_length"] + 1
    finally:
        d.stop()
    assert counts.sum() == counts[support].sum()
    assert_matches(counts[support], joint.reshape(-1)[support])
