"""Sampled speculative decoding keeps the target's distribution: the accept/reject step against exact
distributions (chi-square over >= 10,000 draws, fixed seeds), through the sampling filters, with one-hot
drafts (prompt lookup), and a round of real engines (a draft model unrelated to the target)."""
from __future__ import annotations

import numpy as np
import pytest

from bench.synthetic import random_q8_weights
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.run.engine import Engine
from kestrel_stream.spec.accept import ROW_DRAFT, accept_or_resample, distribution, draw_from, verify_sampled
from kestrel_stream.spec.speculation import Speculation
from kestrel_stream.text.sampling import SamplingParams, philox_uniform

DRAWS = 12_000
CHI2_999 = {5: 20.5, 7: 24.3, 11: 31.3, 15: 37.7}     # chi-square quantile 0.999 by degrees of freedom


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """(statistic, degrees of freedom) of observed `counts` against `probs`; bins expected < 5 pooled."""
    expected = probs * counts.sum()
    big = expected >= 5
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was drawn"
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def assert_matches(counts, probs):
    stat, dof = chi_square(np.asarray(counts, float), probs)
    limit = CHI2_999.get(dof) or dof + 4.0 * np.sqrt(2 * dof)
    assert stat < limit, (stat, dof, np.round(counts / counts.sum(), 3), np.round(probs, 3))


def test_accept_or_resample_draws_from_p_whatever_q():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(8))
    p[2] = 0.0
    p /= p.sum()
    for q in (rng.dirichlet(np.ones(8)), rng.dirichlet(0.3 * np.ones(8)), p.copy(), np.eye(8)[5]):
        counts = np.zeros(8)
        for _ in range(DRAWS):
            drafted = draw_from(q, rng.random())
            _, token = accept_or_resample(p, q, drafted, rng.random(), rng.random())
            counts[token] += 1
        assert_matches(counts, p)


def test_one_hot_drafts_keep_p():
    """Prompt lookup's drafts: q is one-hot at the drafted token, kept with probability p(x)."""
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(6))
    for drafted in (0, int(np.argmax(p)), int(np.argmin(p))):
        counts = np.zeros(6)
        for _ in range(DRAWS):
            counts[accept_or_resample(p, None, drafted, rng.random(), rng.random())[1]] += 1
        assert_matches(counts, p)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.3, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.3, presence_penalty=0.4),
], ids=["filters", "penalties"])
def test_verify_sampled_first_token_has_the_targets_distribution(params):
    """Both distributions through the same filters; the draft drawn with the decoder's Philox stream."""
    rng = np.random.default_rng(2)
    vocab, history = 16, [3, 4, 4, 9]
    target_rows = rng.normal(0, 1.5, (3, vocab)).astype(np.float32)
    draft_rows = (target_rows + rng.normal(0, 1.0, (3, vocab))).astype(np.float32)
    p0 = distribution(target_rows[0], params, history)
    counts = np.zeros(vocab)
    for seed in range(DRAWS):
        drafts, q_rows = [], []
        for i in range(2):
            q = distribution(draft_rows[i], params, history + drafts)
            q_rows.append(q)
            drafts.append(draw_from(q, philox_uniform(seed, 7 + i, ROW_DRAFT)))
        out = verify_sampled(target_rows, drafts, np.stack(q_rows), params, seed, 7, history)
        counts[out[0]] += 1
    assert_matches(counts, p0)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0),
                                    SamplingParams(temperature=1.2, top_k=8, top_p=0.95, min_p=0.0,
                                                   repeat_penalty=1.2)], ids=["plain", "filters"])
def test_a_token_trees_emitted_tokens_have_the_targets_distributions(params):
    """spec/tree.py: whatever the candidates at each node, the first token is a draw from p at the root and
    the second, given the first was a candidate, a draw from p at that child."""
    from kestrel_stream.spec.tree import DraftTree, verify_tree
    rng = np.random.default_rng(3)
    vocab, history = 12, [4, 4, 1]
    tree = DraftTree([1], [-1])
    for token in (2, 5, 7):                               # three candidates at the root, two under the first
        tree.add(0, token, 0.3)
    tree.add(1, 9, 0.1)
    tree.add(1, 3, 0.1)
    rows = rng.normal(0, 1.2, (len(tree), vocab)).astype(np.float32)
    p_root = distribution(rows[0], params, history)
    p_child = distribution(rows[1], params, history + [2])
    first, second = np.zeros(vocab), np.zeros(vocab)
    for seed in range(DRAWS):
        path, out = verify_tree(rows, tree, params, seed, 5, history)
        first[out[0]] += 1
        assert len(out) == len(path) and [tree.tokens[n] for n in path[1:]] == out[:-1]
        if out[0] == 2:
            second[out[1]] += 1
    assert_matches(first, p_root)
    assert_matches(second, p_child)


def test_a_round_of_real_engines_keeps_the_targets_distribution():
    config = ModelConfig(arch="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=12,
                         rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                         max_position_embeddings=64)
    target = Engine(random_q8_weights(config, seed=3), device="cpu", max_seq_len=32)
    draft = Engine(random_q8_weights(config, seed=4), device="cpu", max_seq_len=32)
    speculation = Speculation.model(draft, config.vocab_size, draft_max=2, policy="always")
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    prompt = [1, 5, 7, 2]
    with target.new_session() as s:
        s.prefill(prompt[:-1])
        p = distribution(s.decode(prompt[-1]), params, prompt)     # the target's next-token distribution
        s.truncate(len(prompt) - 1)
        counts = np.zeros(config.vocab_size)
        for seed in range(10_000):
            decoder = speculation.decoder(s, params, seed)
            out = decoder.next_tokens(prompt[-1], prompt, 1, budget=3)
            counts[out[0]] += 1
            decoder.close()
            s.truncate(len(prompt) - 1)
    assert_matches(counts, p)
    speculation.close()
    target.close()
