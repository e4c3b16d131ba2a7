"""The cost model of speculative decoding (spec/cost.py): the draft length from a pass-time curve, the running
acceptance, the draft's time and the batch, checked on synthetic curves; and the policy on a real engine."""
from __future__ import annotations

import pytest

from bench.synthetic import random_q8_weights
from kestrel_stream.run.engine import Engine
from kestrel_stream.spec.cost import (Acceptance, PassCurve, choose_draft_length, expected_tokens,
                                      tokens_per_s)
from kestrel_stream.spec.measure import measure_pass_curve
from kestrel_stream.spec.speculation import Speculation
from test_speculative import CONFIG, PROMPT

MS = 1e-3
# in VRAM: a pass of n tokens costs n times one
PROPORTIONAL = PassCurve((1, 2, 4, 8, 16), tuple(n * MS for n in (1, 2, 4, 8, 16)))
# offloaded: the weights' read dominates up to 64 tokens, then compute
FLAT_TO_64 = PassCurve((1, 2, 4, 8, 16, 32, 64, 128), (10 * MS, 10.1 * MS, 10.2 * MS, 10.4 * MS, 10.6 * MS,
                                                       10.8 * MS, 11 * MS, 22 * MS))
# flat to 16, then rising with the tokens
FLAT_TO_16 = PassCurve((1, 2, 4, 8, 16, 32, 64), (10 * MS, 10 * MS, 10 * MS, 10.2 * MS, 10.5 * MS, 21 * MS,
                                                  42 * MS))


def test_a_proportional_curve_turns_speculation_off_whatever_the_acceptance():
    for acceptance in (0.3, 0.9, 0.999, 1.0):
        assert choose_draft_length(PROPORTIONAL, acceptance, 8) == 0


def test_a_flat_curve_drafts_the_longest_chain_the_acceptance_pays_for():
    assert choose_draft_length(FLAT_TO_64, 0.9, 8) == 8
    assert choose_draft_length(FLAT_TO_64, 0.9, 3) == 3
    # a poor draft: each extra token adds less than the pass's rise
    assert choose_draft_length(FLAT_TO_64, 0.01, 8) == 0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75) and expected_tokens(1.0, 4) == 5.0


def test_speculation_shrinks_as_the_batch_grows_and_stops_once_the_batch_fills_the_flat_part():
    lengths = [choose_draft_length(FLAT_TO_16, 0.8, 8, batch=b) for b in (1, 2, 4, 8, 16, 32)]
    assert lengths[0] == 8
    assert all(a >= b for a, b in zip(lengths, lengths[1:])), lengths
    # the stated rule: batch x (k + 1) stays within the tokens a pass takes at the cost of one
    flat = FLAT_TO_16.flat_tokens()
    assert flat == 16
    for b, k in zip((1, 2, 4, 8, 16, 32), lengths):
        assert k == 0 or b * (k + 1) <= flat, (b, k)
    assert lengths[-2:] == [0, 0]


def test_a_slow_draft_is_not_worth_its_time():
    assert choose_draft_length(FLAT_TO_64, 0.9, 8, draft_s_per_token=0.1 * MS) == 8
    assert choose_draft_length(FLAT_TO_64, 0.9, 8, draft_s_per_token=20 * MS) == 0
    slow, fast = (tokens_per_s(FLAT_TO_64, 0.9, 4, draft_s_per_token=d) for d in (5 * MS, 0.0))
    assert slow < fast


def test_the_curve_interpolates_extrapolates_and_checks_its_points():
    assert FLAT_TO_16.time_s(12) == pytest.approx((10.2 + 10.5) / 2 * MS)
    assert FLAT_TO_16.time_s(128) == pytest.approx(84 * MS)         # the last segment's slope onwards
    assert PassCurve((1,), (2 * MS,)).time_s(4) == pytest.approx(8 * MS)
    assert FLAT_TO_64.flat_tokens() == 64 and PROPORTIONAL.flat_tokens() == 1
    assert "64 tokens at the cost of one" in FLAT_TO_64.describe()
    for tokens, seconds in (((2, 4), (1.0, 2.0)), ((1, 1), (1.0, 1.0)), ((1, 2), (1.0, 0.0)), ((1,), ())):
        with pytest.raises(ValueError, match="pass curve"):
            PassCurve(tokens, seconds)


def test_the_acceptance_starts_from_its_prior_and_follows_the_rounds():
    a = Acceptance()
    assert a.rate == Acceptance.PRIOR == 0.75
    a.record(8, 8)                      # a fully kept chain: no miss
    assert a.rate == pytest.approx((0.9 * 3 + 8) / (0.9 * 4 + 8))
    for _ in range(10):
        a.record(4, 0)
    assert a.rate < 0.4
    for _ in range(10):                 # the text changed: the earlier misses fade
        a.record(4, 4)
    assert a.rate > 0.9


def test_a_draft_turned_off_by_misses_is_tried_again_after_plain_passes():
    from types import SimpleNamespace

    from kestrel_stream.spec.decoder import REPROBE_PASSES, SpecDecoder
    from kestrel_stream.text.sampling import SamplingParams
    speculation = Speculation(Repeater(), draft_max=8, curve=FLAT_TO_64)
    decoder = SpecDecoder(SimpleNamespace(position=0, max_seq_len=10**6), speculation.draft, 8, SamplingParams(), 0,
                          speculation)
    assert decoder.draft_length(100) == 8
    while (k := decoder.draft_length(100)) > 0:     # every draft missed
        decoder.record(k, 1)
    for _ in range(REPROBE_PASSES - 1):
        assert decoder.draft_length(100) == 0
        decoder.record(0, 1)
    decoder.record(0, 1)
    k = decoder.draft_length(100)
    assert k > 0                                      # one round at the prior's length
    decoder.record(k, k + 1)                          # kept whole: drafting is back
    assert decoder.draft_length(100) > 0


def test_the_measured_curve_starts_at_one_token_and_doubles():
    engine = Engine(random_q8_weights(CONFIG, seed=2), device="cpu", max_seq_len=64)
    curve = measure_pass_curve(engine, 16)
    assert curve.tokens[0] == 1 and all(b == 2 * a for a, b in zip(curve.tokens, curve.tokens[1:]))
    assert curve.tokens[-1] <= 16 and not engine.sessions          # the scratch session is closed
    engine.close()


def test_auto_follows_the_curve_and_keeps_the_tokens():
    """The same draft (the target itself) under "auto": off on a proportional curve, every round drafting on a
    flat one; greedy output equal to plain decoding's either way."""
    weights = random_q8_weights(CONFIG, seed=2)
    target = Engine(weights, device="cpu", max_seq_len=64)
    plain = target.generate(PROMPT, 30).tokens
    runs = {}
    # offloaded passes of ~10 s: the draft's own time, measured as it runs (a millisecond a token here, tens on a
    # loaded machine), stays too small beside a pass to turn a round into a plain one
    slow = PassCurve(FLAT_TO_64.tokens, tuple(1000 * s for s in FLAT_TO_64.seconds))
    for name, curve in (("vram", PROPORTIONAL), ("offloaded", slow)):
        draft = Engine(weights, device="cpu", max_seq_len=64)
        target.speculation = Speculation.model(draft, CONFIG.vocab_size)
        target.speculation.curve, target.speculation.draft_s_per_token = curve, 0.0
        out = target.generate(PROMPT, 30)
        assert out.tokens == plain, name
        runs[name] = out.stats
        target.speculation.close()
    assert runs["vram"]["spec_drafted"] == 0 and runs["vram"]["spec_plain_passes"] == runs["vram"]["spec_passes"]
    assert runs["offloaded"]["spec_plain_passes"] == 0 and runs["offloaded"]["spec_acceptance"] == 1.0
    assert runs["offloaded"]["spec_draft_length"] > 4
    target.close()


def test_auto_measures_the_curve_on_first_use():
    weights = random_q8_weights(CONFIG, seed=2)
    target = Engine(weights, device="cpu", max_seq_len=64)
    target.speculation = Speculation.lookup()
    assert target.speculation.curve is None and "measured on first use" in target.speculation.describe()
    target.generate(PROMPT, 4)
    assert target.speculation.curve is not None and target.speculation.curve.tokens[0] == 1
    assert "pass time" in target.speculation.describe()
    target.close()


class Repeater:
    """A draft of k copies of one token, as many as asked for, in no time (the draft protocol of spec/)."""
    name = "repeater"
    proposes_trees = False

    def open(self, max_seq_len):
        return self

    def propose(self, context, k, params, seed, step):
        return [7] * k, None

    def token_seconds(self):
        return 0.0

    def close(self):
        pass


def test_the_daemons_rounds_draft_less_as_its_batch_grows():
    """ServedSpeculation.plan takes the batch from its session's replica's batcher (the sessions that asked for a
    step lately) and the cost model shortens the chains as it grows: none once the batch alone fills the flat part
    of the curve."""
    from types import SimpleNamespace

    from kestrel_stream.serve.spec_rounds import ServedSpeculation
    from kestrel_stream.text.sampling import SamplingParams
    engine = Engine(random_q8_weights(CONFIG, seed=2), device="cpu", max_seq_len=64)
    speculation = Speculation(Repeater(), draft_max=8, curve=FLAT_TO_16)
    history = [1, 2, 3, 4] * 6
    lengths = {}
    with engine.new_session() as session:
        session.prefill(history[:-1])
        decoder = speculation.decoder(session, SamplingParams(), 0)
        for batch in (1, 2, 4, 8, 16):
            replica = SimpleNamespace(engine=engine, batcher=SimpleNamespace(active_sessions=lambda now, b=batch: b,
                                                                             step_tokens=256))
            service = SimpleNamespace(replica_of=lambda session, r=replica: r)
            spec_round = ServedSpeculation(service, session, decoder).plan(history, 20, len(history))
            lengths[batch] = spec_round.drafted if spec_round is not None else 0
    engine.close()
    assert lengths[1] == 8 and lengths[16] == 0, lengths
    assert all(lengths[a] >= lengths[b] for a, b in ((1, 2), (2, 4), (4, 8), (8, 16))), lengths
    assert all(k == 0 or b * (k + 1) <= FLAT_TO_16.flat_tokens() for b, k in lengths.items()), lengths


def test_the_daemons_trees_shrink_as_its_batch_grows():
    """ServedSpeculation.plan sizes a round's tree by the batch too (cost.choose_tree_nodes): branches while
    batch x nodes stays on the flat part of the curve, a chain or nothing beyond it; never past a step's budget."""
    from types import SimpleNamespace

    from kestrel_stream.serve.spec_rounds import ServedSpeculation
    from kestrel_stream.text.sampling import SamplingParams
    engine = Engine(random_q8_weights(CONFIG, seed=2), device="cpu", max_seq_len=64)
    speculation = Speculation.lookup(draft_max=8)
    speculation.curve = FLAT_TO_64
    history = [1, 2, 3, 5, 1, 2, 4, 6, 1, 2, 7, 8, 1, 2, 9, 10, 1, 2]     # "1 2" went on four ways
    nodes = {}
    with engine.new_session() as session:
        session.prefill(history[:-1])
        decoder = speculation.decoder(session, SamplingParams(), 0)
        for batch, step_tokens in ((1, 256), (2, 256), (8, 256), (32, 256), (1, 6)):
            batcher = SimpleNamespace(active_sessions=lambda now, b=batch: b, step_tokens=step_tokens)
            service = SimpleNamespace(replica_of=lambda session, r=SimpleNamespace(engine=engine, batcher=batcher): r)
            spec_round = ServedSpeculation(service, session, decoder).plan(history, 20, len(history))
            nodes[batch, step_tokens] = spec_round.nodes if spec_round is not None else 0
    engine.close()
    assert nodes[1, 256] > speculation.draft_max + 1, nodes          # more nodes than any chain: a tree
    assert nodes[1, 256] >= nodes[2, 256] >= nodes[8, 256] > nodes[32, 256], nodes
    assert 0 < nodes[1, 6] <= 6, nodes


def test_where_auto_drafts_nothing_the_device_chains_plain_steps(monkeypatch):
    """In VRAM (a pass of k tokens costs k times one) "auto" turns the draft off; its plain passes then run
    chained on the device as decoding without a draft does (several steps a sync), not one sync a token:
    the same tokens, the same syncs as plain decoding, every pass counted plain."""
    import fake_cuda
    from spec_engines import device_engine
    fake_cuda.install(monkeypatch, mode="deferred")
    weights = random_q8_weights(CONFIG, seed=2)
    target = device_engine(weights, "gpu", max_seq_len=64)
    plain = target.generate(PROMPT, 30)
    assert plain.stats["syncs"] < 30                  # chained: the premise
    draft = device_engine(weights, "gpu", max_seq_len=64)
    target.speculation = Speculation.model(draft, CONFIG.vocab_size)
    target.speculation.curve, target.speculation.draft_s_per_token = PROPORTIONAL, 0.0
    out = target.generate(PROMPT, 30)
    assert out.tokens == plain.tokens
    assert out.stats["spec_drafted"] == 0 and out.stats["spec_plain_passes"] == out.stats["spec_passes"] == 29
    assert out.stats["syncs"] <= plain.stats["syncs"] + 1, (out.stats["syncs"], plain.stats["syncs"])
    target.speculation.close()
    target.close()


def test_plain_tokens_ahead_ends_at_the_reprobe():
    from types import SimpleNamespace

    from kestrel_stream.spec.decoder import REPROBE_PASSES, SpecDecoder
    from kestrel_stream.text.sampling import SamplingParams
    speculation = Speculation(Repeater(), draft_max=8, curve=PROPORTIONAL)
    decoder = SpecDecoder(SimpleNamespace(position=0, max_seq_len=10**6), speculation.draft, 8, SamplingParams(), 0,
                          speculation)
    assert decoder.plain_tokens_ahead(100) == REPROBE_PASSES
    assert decoder.plain_tokens_ahead(5) == 5 and decoder.plain_tokens_ahead(1) == 0
    decoder.record_plain(REPROBE_PASSES - 3)
    assert decoder.plain_tokens_ahead(100) == 3
    assert decoder.stats.plain_passes == decoder.stats.passes == REPROBE_PASSES - 3
    flat = Speculation(Repeater(), draft_max=8, curve=FLAT_TO_64)
    drafting = SpecDecoder(SimpleNamespace(position=0, max_seq_len=10**6), flat.draft, 8, SamplingParams(), 0, flat)
    assert drafting.plain_tokens_ahead(100) == 0      # the next round drafts: nothing to chain


def test_auto_grows_trees_only_while_their_drafting_costs_little_beside_the_pass():
    """A tree's levels are draft passes over the tree so far: where one costs far more than a chain's token, the
    rounds go back to chains (the same depth k); cheap levels keep the tree the curve allows."""
    from types import SimpleNamespace

    from kestrel_stream.spec.decoder import SpecDecoder
    from kestrel_stream.text.sampling import SamplingParams

    class TreeRepeater(Repeater):
        proposes_trees = True
    speculation = Speculation(TreeRepeater(), draft_max=8, curve=FLAT_TO_64, tree_nodes=32)
    decoder = SpecDecoder(SimpleNamespace(position=0, max_seq_len=10**6), speculation.draft, 8, SamplingParams(), 0,
                          speculation)
    decoder.draft_s_per_token = 1 * MS
    assert decoder.tree_nodes(8) > 9                 # not measured yet: a tree is tried
    decoder.tree_s_per_level = 1.05 * MS             # 8 levels 0.4 ms over the chain: within 10 % of a 10 ms pass
    assert decoder.tree_nodes(8) > 9
    decoder.tree_s_per_level = 5 * MS                # 32 ms over the chain's drafting
    assert decoder.tree_nodes(8) == 9


def test_rounds_with_nothing_drafted_back_off_into_chained_stretches(monkeypatch):
    """Prompt lookup in prose finds no match: after n such rounds in a row the next 2 ** n (at most 16) plain
    passes run chained, one round tried between stretches, back to every round at the first match."""
    from types import SimpleNamespace

    from kestrel_stream.spec.decoder import EMPTY_BACKOFF_MAX, SpecDecoder
    from kestrel_stream.text.sampling import SamplingParams
    speculation = Speculation(Repeater(), draft_max=8, curve=FLAT_TO_64)
    decoder = SpecDecoder(SimpleNamespace(position=0, max_seq_len=10**6), speculation.draft, 8, SamplingParams(), 0,
                          speculation)
    assert decoder.plain_tokens_ahead(100) == 0                       # drafting, nothing missed yet
    for n in range(1, EMPTY_BACKOFF_MAX + 3):
        decoder.stretched, decoder.empty_rounds = False, n
        assert decoder.plain_tokens_ahead(100) == 2 ** min(n, EMPTY_BACKOFF_MAX)
        decoder.record_plain(3)
        assert decoder.plain_tokens_ahead(100) == 0                   # a round is tried after each stretch
    assert decoder.plain_tokens_ahead(1) == 0

    # end to end on the emulated device: a lookup over a prompt without repeats, greedy under "auto"
    import fake_cuda
    from spec_engines import device_engine
    fake_cuda.install(monkeypatch, mode="deferred")
    target = device_engine(random_q8_weights(CONFIG, seed=2), "gpu", max_seq_len=64)
    plain = target.generate(PROMPT, 40)
    target.speculation = Speculation.lookup()
    target.speculation.curve = FLAT_TO_64
    out = target.generate(PROMPT, 40)
    assert out.tokens == plain.tokens
    passes, drafting = out.stats["spec_passes"], out.stats["spec_passes"] - out.stats["spec_plain_passes"]
    assert out.stats["syncs"] < passes - drafting, out.stats             # plain passes chained, not one sync each
    target.close()


def test_a_reprobe_that_keeps_nothing_doubles_the_wait_for_the_next_one():
    from types import SimpleNamespace

    from kestrel_stream.spec.decoder import MAX_REPROBE_DOUBLINGS, REPROBE_PASSES, SpecDecoder
    from kestrel_stream.text.sampling import SamplingParams
    speculation = Speculation(Repeater(), draft_max=8, curve=FLAT_TO_64)
    decoder = SpecDecoder(SimpleNamespace(position=0, max_seq_len=10**6), speculation.draft, 8, SamplingParams(), 0,
                          speculation)
    while (k := decoder.draft_length(100)) > 0:     # every draft missed: drafting turned off
        decoder.record(k, 1)
    waits = []
    for _ in range(MAX_REPROBE_DOUBLINGS + 2):
        passes = 0
        while decoder.draft_length(100) == 0:
            assert decoder.plain_tokens_ahead(1000) == decoder.reprobe_after - passes
            decoder.record(0, 1)
            passes += 1
        waits.append(passes)
        decoder.record(decoder.draft_length(100), 1)  # the reprobe misses
    assert waits == [REPROBE_PASSES << min(i, MAX_REPROBE_DOUBLINGS) for i in range(MAX_REPROBE_DOUBLINGS + 2)]
    while decoder.draft_length(100) == 0:
        decoder.record(0, 1)
    k = decoder.draft_length(100)
    decoder.record(k, k + 1)                          # a reprobe keeps its drafts: the wait is back to the first
    assert decoder.failed_probes == 0 and decoder.reprobe_after == REPROBE_PASSES
