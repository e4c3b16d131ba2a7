"""Sampling: llama.cpp's filters and order, reproducible draws, and chi-square tests of the distribution.

The expected distribution is computed here independently (sort, cut, renormalise) so an off-by-one in a
filter shows up: each case puts real mass on the token just past the cut."""
import math

import numpy as np
import pytest

from kestrel_stream.text.sampling import SamplingParams, apply_penalties, philox_uniform, sample_logits

DRAWS = 20_000
# chi-square critical value at p = 1e-4 for up to 40 degrees of freedom (Wilson-Hilferty approximation)


def chi2_critical(dof: int, z: float = 3.719) -> float:
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def expected_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    order = np.argsort(-logits, kind="stable")
    keep = order[:top_k] if top_k > 0 else order
    p = np.exp(logits[keep] - logits[keep].max())
    p /= p.sum()
    if top_p < 1:
        n = int(np.argmax(np.cumsum(p) >= top_p)) + 1          # llama.cpp: the prefix that reaches top_p
        keep = keep[:n]
    if min_p > 0:
        keep = keep[logits[keep] >= logits[keep].max() + np.log(min_p)]
    out = np.zeros_like(logits, dtype=np.float64)
    w = np.exp((logits[keep] - logits[keep].max()) / temperature)
    out[keep] = w / w.sum()
    return out


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    assert counts[probs == 0].sum() == 0, f"drew tokens the filters remove: {np.flatnonzero((probs == 0) & (counts > 0))}"
    nz = probs > 0
    expected = probs[nz] * counts.sum()
    return float(((counts[nz] - expected) ** 2 / expected).sum()), int(nz.sum()) - 1


# logits chosen so the token just past each cut carries a few percent of the mass
LOGITS = np.log(np.array([0.20, 0.16, 0.13, 0.11, 0.09, 0.08, 0.07, 0.06, 0.05, 0.03, 0.02]))[
    np.random.default_rng(3).permutation(11)].astype(np.float32)
CASES = {
    "temperature": dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0),
    "top_k": dict(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0),
    "top_p": dict(temperature=1.0, top_k=0, top_p=0.75, min_p=0.0),
    "min_p": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.42),
    "all": dict(temperature=1.3, top_k=8, top_p=0.9, min_p=0.3),
}


def draw_counts(params: SamplingParams, logits=LOGITS, seed: int = 11) -> np.ndarray:
    counts = np.zeros(len(logits), np.int64)
    for step in range(DRAWS):
        counts[sample_logits(logits, params, seed, step)] += 1
    return counts


@pytest.mark.parametrize("case", sorted(CASES))
def test_empirical_frequencies_match_the_filtered_distribution(case):
    probs = expected_probs(LOGITS.astype(np.float64), **CASES[case])
    stat, dof = chi_square(draw_counts(SamplingParams(**CASES[case])), probs)
    assert stat < chi2_critical(dof), f"{case}: chi-square {stat:.1f} over {dof} dof"


@pytest.mark.parametrize("case,off_by_one", [("top_k", dict(top_k=6)), ("top_p", dict(top_p=0.69)),
                                             ("min_p", dict(min_p=0.36))])
def test_the_chi_square_test_catches_a_filter_off_by_one(case, off_by_one):
    """The expected distribution of the case against the draws of a neighbouring cut: must fail."""
    probs = expected_probs(LOGITS.astype(np.float64), **CASES[case])
    wrong = SamplingParams(**(CASES[case] | off_by_one))
    counts = draw_counts(wrong)
    try:
        stat, dof = chi_square(counts, probs)
    except AssertionError:
        return                                  # drew a token the right filter removes
    assert stat > chi2_critical(dof)


def test_same_seed_same_tokens_and_different_seed_different_tokens():
    logits = np.random.default_rng(0).normal(size=500).astype(np.float32)
    params = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0)
    a = [sample_logits(logits, params, 42, s) for s in range(64)]
    assert a == [sample_logits(logits, params, 42, s) for s in range(64)]
    assert a != [sample_logits(logits, params, 43, s) for s in range(64)]


def test_philox_matches_the_random123_known_answers():
    # Philox4x32-10 KAT (Random123 kat_vectors): counter 0, key 0 -> 0x6627e8d5 as the first word
    assert philox_uniform(0, 0) == (0x6627E8D5 >> 8) / 2 ** 24
    u = np.array([philox_uniform(5, s) for s in range(20_000)])
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01


def test_greedy_is_argmax_and_penalties_follow_llama_cpp():
    logits = np.array([2.0, -1.0, 1.5, 0.5], np.float32)
    assert sample_logits(logits, SamplingParams(), 0, 0) == 0
    penalized = apply_penalties(logits, [0, 0, 1], SamplingParams(repeat_penalty=2.0, presence_penalty=0.1,
                                                                  frequency_penalty=0.2))
    assert penalized.tolist() == pytest.approx([2.0 / 2 - 0.1 - 0.4, -1.0 * 2 - 0.1 - 0.2, 1.5, 0.5])
    assert sample_logits(logits, SamplingParams(repeat_penalty=2.0), 0, 0, history=[0]) == 2


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(min_p=1.5), dict(repeat_penalty=0),
                                 dict(seed=-1), dict(top_k=1.5), dict(temperature=float("nan"))])
def test_bad_parameters_are_refused_with_their_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def whole_vocabulary_draw(x, threshold, temperature, u):
    """The inverse CDF written over every token, the dropped ones weighing 0 (the definition draw follows)."""
    top = float(np.max(x))
    weights = np.where(x >= threshold, np.exp((x.astype(np.float64) - top) / temperature), 0.0)
    cumulative = np.cumsum(weights)
    token = int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))
    while weights[min(token, len(x) - 1)] == 0.0:
        token = min(token, len(x) - 1) - 1
    return token


def test_the_draw_over_the_kept_tokens_is_the_whole_vocabularys():
    """draw sums the kept tokens' weights alone: the same token as the sum over the whole vocabulary for every
    filter, with ties, with weights that underflow to 0, and at u's ends."""
    from kestrel_stream.text.sampling import draw, filter_threshold
    rng = np.random.default_rng(0)
    for trial in range(600):
        x = (rng.standard_normal(int(rng.choice([7, 64, 300, 4096]))) * rng.choice([0.5, 3, 40])).astype(np.float32)
        if trial % 3 == 0:
            x = np.round(x * 2) / 2                   # ties at every cut
        params = SamplingParams(temperature=float(rng.choice([0.05, 0.7, 2.5])), top_k=int(rng.choice([-1, 1, 5, 40])),
                                top_p=float(rng.choice([1.0, 0.9, 0.5])), min_p=float(rng.choice([0.0, 0.05])))
        threshold = filter_threshold(x, params)
        for u in (0.0, float(rng.random()), 1.0 - 2 ** -24):
            assert draw(x, threshold, params.temperature, u) == whole_vocabulary_draw(x, threshold,
                                                                                       params.temperature, u)
