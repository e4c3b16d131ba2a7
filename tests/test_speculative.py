"""Speculative decoding (spec/): greedy output equals plain decoding's token for token, with a draft model
that agrees everywhere (the target itself), somewhere (a perturbed copy) or nowhere (an unrelated model),
and with prompt lookup; on the CPU engine and on the emulated device (gpu, layers=1).  After a rejection the
target's KV holds the kept path only; stop strings, EOS and max_new_tokens cut inside a kept run; a draft of
another tokenizer is refused."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import fake_cuda
import kestrel_stream as ks
from bench.synthetic import random_q8_weights
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.model.quant import QTensor
from kestrel_stream.run.engine import Engine
from kestrel_stream.spec.speculation import Speculation
from kestrel_stream.spec.vocab_check import DraftMismatchError
from kestrel_stream.text.sampling import SamplingParams
from spec_engines import MODES, device_engine

CONFIG = ModelConfig(arch="qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=96,
                     rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=128)
PROMPT = [5, 3, 60, 17, 42, 8, 1, 33, 7]
NEW_TOKENS = 40


def perturbed(weights, seed: int, amplitude: int):
    """A copy of `weights` with every layer's output projections jittered: a draft that agrees in places."""
    rng = np.random.default_rng(seed)

    def jitter(q: QTensor) -> QTensor:
        qs = q.qs.astype(np.int16) + rng.integers(-amplitude, amplitude + 1, q.qs.shape)
        return QTensor(np.clip(qs, -127, 127).astype(np.int8), q.scales.copy())
    layers = [dataclasses.replace(l, wo=jitter(l.wo), w_down=jitter(l.w_down)) for l in weights.layers]
    return dataclasses.replace(weights, layers=layers)


DRAFTS = {"itself": lambda w: random_q8_weights(CONFIG, seed=2), "perturbed": lambda w: perturbed(w, 9, 60),
          "unrelated": lambda w: random_q8_weights(CONFIG, seed=7)}


def engine_for(mode: str, weights, monkeypatch):
    if mode != "cpu":
        fake_cuda.install(monkeypatch, mode="deferred")
    return device_engine(weights, mode, max_seq_len=64)


@pytest.mark.parametrize("mode", MODES, ids=["cpu", "whole-device", "layers", "window", "offload"])
def test_greedy_output_equals_plain_decoding_with_every_draft(mode, monkeypatch):
    """Token trees (and chains, where a draft's tree is one) in every placement; the draft model resident."""
    weights = random_q8_weights(CONFIG, seed=2)
    target = engine_for(mode, weights, monkeypatch)
    plain = target.generate(PROMPT, NEW_TOKENS)
    stats = {}
    for name, make in DRAFTS.items():
        draft = engine_for("cpu" if mode == "cpu" else "gpu", make(weights), monkeypatch)
        target.speculation = Speculation.model(draft, CONFIG.vocab_size, policy="always")
        out = target.generate(PROMPT, NEW_TOKENS)
        assert out.tokens == plain.tokens, name
        assert out.stats["spec_passes"] < NEW_TOKENS or name != "itself"
        stats[name] = out.stats
        target.speculation.close()
    target.speculation = Speculation.lookup(policy="always")
    out = target.generate(PROMPT, NEW_TOKENS)
    assert out.tokens == plain.tokens
    assert out.stats["spec_drafted"] > 0
    assert target.generate(PROMPT, NEW_TOKENS, speculative=False).stats.get("spec_passes") is None
    target.close()
    acceptance = {name: s["spec_acceptance"] for name, s in stats.items()}
    assert acceptance["itself"] == 1.0
    assert 0.0 < acceptance["perturbed"] < 1.0, acceptance
    assert acceptance["unrelated"] < 0.2, acceptance
    for name in DRAFTS:                  # trees: more nodes than their longest path
        assert stats[name]["spec_tree_nodes"] > stats[name]["spec_draft_length"] + 1, (name, stats[name])


def test_chains_and_trees_keep_plain_decodings_tokens():
    """tree_nodes=1 drafts chains; trees of the same draft keep at least as many tokens a pass."""
    weights = random_q8_weights(CONFIG, seed=2)
    target = Engine(weights, device="cpu", max_seq_len=64)
    plain = target.generate(PROMPT, NEW_TOKENS)
    per_pass = {}
    for nodes in (1, 32):
        target.speculation = Speculation.model(Engine(perturbed(weights, 9, 60), device="cpu", max_seq_len=64),
                                               CONFIG.vocab_size, policy="always", tree_nodes=nodes)
        out = target.generate(PROMPT, NEW_TOKENS)
        assert out.tokens == plain.tokens
        per_pass[nodes] = out.stats["spec_tokens_per_pass"]
        assert (out.stats["spec_tree_nodes"] == out.stats["spec_draft_length"] + 1) == (nodes == 1)
        target.speculation.close()
    assert per_pass[32] > per_pass[1], per_pass
    target.speculation = None
    target.close()


class Scripted:
    """A draft that proposes given chains, one per round (the draft protocol of spec/)."""
    name = "scripted"
    proposes_trees = False

    def __init__(self, chains):
        self.chains = list(chains)

    def open(self, max_seq_len):
        return self

    def propose(self, context, k, params, seed, step):
        return self.chains.pop(0)[:k], None

    def device_bytes(self):
        return 0

    def close(self):
        pass


def test_after_a_rejection_the_kv_holds_the_kept_path_only(monkeypatch):
    monkeypatch.setenv("KESTREL_HOST_KERNELS", "numpy")     # a row's numbers whatever the step's size
    engine = Engine(random_q8_weights(CONFIG, seed=2), device="cpu", max_seq_len=64)
    plain = engine.generate(PROMPT, 8).tokens
    wrong = (plain[3] + 1) % CONFIG.vocab_size
    params = SamplingParams()
    with engine.new_session() as s:
        first = int(np.argmax(s.prefill(PROMPT, logits="last")))
        speculation = Speculation(Scripted([[plain[1], plain[2], wrong, plain[4]]]), draft_max=4, policy="always")
        decoder = speculation.decoder(s, params, 0)
        out = decoder.next_tokens(first, PROMPT + [first], 1, budget=20)
        assert out == plain[1:4]                      # two kept, then the target's own token
        assert s.position == len(PROMPT) + 3 and s.tokens == PROMPT + plain[:3]
        after = s.decode(out[-1])
    with engine.new_session() as ref:
        ref.prefill(PROMPT)
        for token in plain[:3]:
            ref.decode(token)
        expected = ref.decode(plain[3])
    np.testing.assert_allclose(after, expected, rtol=1e-5, atol=1e-5)
    assert decoder.stats.as_dict()["spec_acceptance"] == 0.5
    engine.close()


@pytest.fixture(scope="module")
def text_engine(tiny_model):
    engine = ks.load(tiny_model, device="cpu", max_seq_len=128, draft=tiny_model, draft_max=8, spec_policy="always")
    yield engine
    engine.close()


def test_stops_cut_inside_a_kept_run(text_engine):
    prompt = "The quick brown fox"
    plain = text_engine.generate(prompt, 40, speculative=False)
    assert text_engine.generate(prompt, 40).stats["spec_tokens_per_pass"] > 4
    for n in (1, 2, 5, 11):                           # max_new_tokens inside a round of 8
        out = text_engine.generate(prompt, n)
        assert (out.tokens, out.text, out.stop_reason) == (plain.tokens[:n], plain.text[:len(out.text)], "length")
    stop = plain.text[5:7]
    cut = text_engine.generate(prompt, 40, stop=[stop])
    assert cut.stop_reason == "stop" and (cut.tokens, cut.text) == (lambda r: (r.tokens, r.text))(
        text_engine.generate(prompt, 40, stop=[stop], speculative=False))
    tokenizer = text_engine.tokenizer
    eos = plain.tokens[6]
    text_engine.tokenizer = dataclasses.replace(tokenizer, eos_ids=frozenset({eos}))
    try:
        out = text_engine.generate(prompt, 40)
        assert out.stop_reason == "eos" and out.tokens == plain.tokens[:plain.tokens.index(eos) + 1]
    finally:
        text_engine.tokenizer = tokenizer


def test_stream_and_sampled_generations_repeat_with_a_seed(text_engine):
    pieces = list(text_engine.generate("Once upon", 20, stream=True))
    assert [p.token for p in pieces] == text_engine.generate("Once upon", 20, speculative=False).tokens
    a = text_engine.generate("Once upon", 30, temperature=0.9, seed=11)
    b = text_engine.generate("Once upon", 30, temperature=0.9, seed=11)
    assert a.tokens == b.tokens and a.stats["spec_passes"] > 0


def test_a_draft_of_another_tokenizer_is_refused(tiny_model, tmp_path):
    from kestrel_stream.loading.presets import make_model
    other = make_model(tmp_path / "other", "tiny", seed=3, dtype="f32")
    vocab = json.loads((other / "tokenizer.json").read_text())
    table = vocab["model"]["vocab"]
    a, b = [k for k, v in table.items() if v in (65, 66)]
    table[a], table[b] = table[b], table[a]
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    with pytest.raises(DraftMismatchError) as info:
        ks.load(tiny_model, device="cpu", draft=other)
    message = str(info.value)
    assert str(other) in message and str(tiny_model) in message and "token 65" in message
    (other / "tokenizer.json").unlink()
    with pytest.raises(DraftMismatchError, match="no tokenizer"):
        ks.load(tiny_model, device="cpu", draft=other)
    with pytest.raises(ValueError, match="one draft"):
        ks.load(tiny_model, device="cpu", draft=other, spec="lookup")


def test_speculative_true_without_a_draft_is_an_error(tiny_model):
    engine = ks.load(tiny_model, device="cpu", max_seq_len=64)
    with pytest.raises(ValueError, match="no draft"):
        engine.generate([1, 2, 3], 4, speculative=True)
    engine.close()


def test_a_draft_takes_its_share_of_the_vram_budget(tiny_model, monkeypatch):
    """On the (emulated) device the draft is loaded first, all resident with a fixed KV pool; a byte budget is
    the pair's, and a budget the draft alone fills is refused, saying so."""
    from kestrel_stream.errors import DeviceError
    fake_cuda.install(monkeypatch, mode="deferred")
    budget = 128 << 20
    engine = ks.load(tiny_model, device="cuda", mode="gpu", vram_budget=budget, draft=tiny_model, max_seq_len=64,
                     spec_policy="always")
    share = engine.speculation.device_bytes()
    assert 0 < share < budget and engine.speculation.draft.engine.mode == "gpu"
    assert engine.executor.backend.memory.budget_bytes == budget - share
    out = engine.generate([1, 2, 3], 20)
    assert out.tokens == engine.generate([1, 2, 3], 20, speculative=False).tokens
    assert out.stats["spec_acceptance"] == 1.0
    engine.close()
    with pytest.raises(DeviceError, match="the draft model alone takes"):
        ks.load(tiny_model, device="cuda", mode="gpu", vram_budget=share - 1, draft=tiny_model, max_seq_len=64)


def test_penalized_greedy_output_equals_plain_decoding():
    """Greedy with penalties picks over the history, drafted tokens included, as plain decoding does."""
    weights = random_q8_weights(CONFIG, seed=2)
    target = Engine(weights, device="cpu", max_seq_len=64)
    kw = dict(repeat_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1)
    plain = target.generate(PROMPT, NEW_TOKENS, **kw)
    for speculation in (Speculation.model(Engine(perturbed(weights, 9, 60), device="cpu", max_seq_len=64),
                                          CONFIG.vocab_size, policy="always"),
                        Speculation.lookup(draft_max=4, policy="always")):
        target.speculation = speculation
        out = target.generate(PROMPT, NEW_TOKENS, **kw)
        assert out.tokens == plain.tokens
        assert out.stats["spec_drafted"] > 0 or speculation.kind == "lookup"   # penalties repeat little
        speculation.close()
    target.close()


def test_prompt_lookup_continues_the_latest_longest_match():
    from kestrel_stream.spec.lookup import lookup_draft
    assert lookup_draft([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4], 3) == [7, 8, 2]   # the 3-gram's latest match
    assert lookup_draft([1, 2, 3, 9, 5, 3], 4) == [9, 5, 3]                          # a 1-gram, cut at the end
    assert lookup_draft([1, 2, 3], 4) == [] and lookup_draft([4], 4) == [] and lookup_draft([1, 1], 0) == []
