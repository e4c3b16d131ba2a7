"""The CPU engine against Hugging Face transformers (float32, same dequantized weights)."""
from __future__ import annotations

import numpy as np
import pytest

import kestrel_stream as ks
from kestrel_stream.loading.presets import make_model

from hf_oracle import hf_logits, hf_model_with_weights, relative_error

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
    for position in range(len(tokens)):
        assert relative_error(ours[position], reference[position]) < 2e-3, f"position {position}"
    np.testing.assert_array_equal(ours.argmax(axis=1), reference.argmax(axis=1))
