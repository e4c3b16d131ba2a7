"""Head dims 96, 128 and 256 (32, 64 and 80 are the architecture presets' own, test_archs_emulated.py) through
a whole model: the CPU engine against transformers, and every GPU path on the emulated device against it,
within 2e-3 with the same argmax over a 12-token prefill and 8 decode steps (4 layers, so that half the
weights hold the window's two streaming slots at head_dim 256)."""
from __future__ import annotations

import dataclasses

import pytest

import fake_cuda
import kestrel_stream as ks
from hf_oracle import assert_logits_match, hf_logits, hf_model_with_weights
from kestrel_stream.loading.presets import PRESETS, make_model
from kestrel_stream.run.engine import Engine
from test_archs_emulated import PROMPT, engine_for, run
from test_executors_emulated import MAX_BATCH, MAX_SEQ_LEN


@pytest.fixture(scope="module", params=[96, 128, 256])
def model(request, tmp_path_factory):
    d = request.param
    cfg = dataclasses.replace(PRESETS["llama3-tiny"], num_attention_heads=2, num_key_value_heads=1, head_dim=d,
                              hidden_size=128, intermediate_size=192, num_hidden_layers=4)
    model_dir = make_model(tmp_path_factory.mktemp(f"d{d}") / "m", cfg, seed=3, dtype="f32")
    weights = ks.load(model_dir, device="cpu").weights
    reference = run(Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH))
    return model_dir, weights, reference


def test_the_cpu_engine_matches_transformers(model):
    pytest.importorskip("transformers")
    model_dir, weights, reference = model
    tokens = PROMPT + [int(t) for t in reference[len(PROMPT) - 1:-1].argmax(axis=1)]
    expected = hf_logits(hf_model_with_weights(model_dir, weights), tokens)
    assert_logits_match(reference, expected)


@pytest.mark.parametrize("mode", ["gpu", "window", "gated", "layers=1"])
def test_every_gpu_path_matches_the_cpu_engine(model, mode, monkeypatch):
    fake_cuda.install(monkeypatch, mode="deferred")
    _, weights, reference = model
    engine = engine_for(weights, mode)
    ours = run(engine)
    assert_logits_match(ours, reference)
    engine.close()
