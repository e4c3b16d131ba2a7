"""The CPU engine against Hugging Face transformers (float32, same dequantized weights)."""
from __future__ import annotations

import numpy as np
import pytest

import kestrel_stream as ks
from kestrel_stream.loading.presets import make_model

from hf_oracle import assert_logits_match, hf_logits, hf_model_with_weights, relative_error

DECODE_STEPS = 10


@pytest.mark.parametrize("preset,dtype", [("tiny", "f32"), ("llama-tiny", "f32"), ("tiny", "bf16"),
                                          ("llama-tiny", "f16")])
def test_prefill_and_decode_match_transformers(tmp_path, preset, dtype):
    model_dir = make_model(tmp_path / preset, preset, seed=7, dtype=dtype)
    engine = ks.load(model_dir, device="cpu")
    hf = hf_model_with_weights(model_dir, engine.weights)

    prompt = [3, 17, 42, 5, 99, 1, 250]
    session = engine.new_session()
    steps = [session.prefill(prompt)]
    tokens = list(prompt)
    for _ in range(DECODE_STEPS):
        tokens.append(int(np.argmax(steps[-1][-1])))
        steps.append(session.decode(tokens[-1])[None])
    ours = np.concatenate(steps)
    reference = hf_logits(hf, tokens)

    assert ours.shape == (len(prompt) + DECODE_STEPS, engine.config.vocab_size)
    assert_logits_match(ours, reference)


ARCH_PRESETS = {
    "llama3-tiny": {},                                              # llama3 rope scaling, head_dim 32
    "llama3-linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "mistral-tiny": {},                                             # sliding window 6, head_dim 80
    "qwen2-tiny": {},                                               # q/k/v bias, YaRN
    "tiny": {},                                                     # qwen3
}


def _arch_model(tmp_path, name):
    import json
    preset = "llama3-tiny" if name == "llama3-linear" else name
    model_dir = make_model(tmp_path / name, preset, seed=11, dtype="f32")
    cfg_path = model_dir / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **ARCH_PRESETS[name]}))
    return model_dir


def _prefill_and_decode(engine, prompt, steps):
    session = engine.new_session()
    out = [session.prefill(prompt)]
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(np.argmax(out[-1][-1])))
        out.append(session.decode(tokens[-1])[None])
    return np.concatenate(out), tokens


@pytest.mark.parametrize("name", sorted(ARCH_PRESETS))
def test_each_architecture_matches_transformers(tmp_path, name):
    model_dir = _arch_model(tmp_path, name)
    engine = ks.load(model_dir, device="cpu")
    hf = hf_model_with_weights(model_dir, engine.weights)
    prompt = [3, 17, 42, 5, 99, 1, 250, 7, 64, 31, 8, 2]             # longer than mistral-tiny's window
    ours, tokens = _prefill_and_decode(engine, prompt, 8)
    reference = hf_logits(hf, tokens)
    assert_logits_match(ours, reference)


@pytest.mark.parametrize("name,plain", [("llama3-tiny", {"rope_scaling": None}),
                                        ("qwen2-tiny", {"rope_scaling": None}),
                                        ("mistral-tiny", {"sliding_window": None})])
def test_the_scaling_and_the_window_change_the_logits(tmp_path, name, plain):
    """The features above are live in these shapes: without them the logits move far past 2e-3."""
    import json
    model_dir = _arch_model(tmp_path, name)
    prompt = [3, 17, 42, 5, 99, 1, 250, 7, 64, 31, 8, 2]
    with_feature, _ = _prefill_and_decode(ks.load(model_dir, device="cpu", cache=False), prompt, 2)
    cfg_path = model_dir / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **plain}))
    without, _ = _prefill_and_decode(ks.load(model_dir, device="cpu", cache=False), prompt, 2)
    assert relative_error(without[-1], with_feature[-1]) > 1e-2
