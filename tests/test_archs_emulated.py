"""Llama 3.x (rope scaling, head_dim 32), Mistral (sliding window, head_dim 80), Qwen2 (q/k/v bias, YaRN)
and Qwen3 on the emulated device (fake_cuda), in every GPU mode, against the CPU engine.

The CPU engine itself matches transformers on these presets (test_oracle.py); here each GPU path —
one graph (gpu), the residency window streaming half the weights (window), the gate (gated, a link
fast enough that projections go to the GPU) and layers=1 — must give the same logits within 2e-3
with identical argmax over a 12-token prefill (longer than mistral-tiny's window of 6) and 8 decode
steps; and the same against transformers on the same weights (within 2e-3 of both, not only by way of
the CPU engine).
"""
from __future__ import annotations

import numpy as np
import pytest

import fake_cuda
import kestrel_stream as ks
from hf_oracle import assert_logits_match, hf_logits, hf_model_with_weights, relative_error
from kestrel_stream.loading.presets import make_model
from kestrel_stream.run.device.budget import budget_for_weight_fraction, gpu_mode_needs
from kestrel_stream.run.engine import Engine
from kestrel_stream.run.compat import GpuExecutor
from test_executors_emulated import FAST_LINK, MAX_BATCH, MAX_SEQ_LEN, hybrid_engine

PRESETS = ("llama3-tiny", "mistral-tiny", "qwen2-tiny", "tiny")
PROMPT = [5, 3, 200, 17, 42, 8, 1, 99, 250, 7, 64, 31]
DECODE_STEPS = 8


def run(engine):
    s = engine.new_session()
    steps = [s.prefill(PROMPT)]
    for _ in range(DECODE_STEPS):
        steps.append(s.decode(int(np.argmax(steps[-1][-1])))[None])
    s.close()
    return np.concatenate(steps)


@pytest.fixture(scope="module", params=PRESETS)
def model(request, tmp_path_factory):
    model_dir = make_model(tmp_path_factory.mktemp(request.param) / "m", request.param, seed=5, dtype="f32")
    weights = ks.load(model_dir, device="cpu").weights
    CHECKPOINT_OF[id(weights)] = model_dir
    return weights, run(Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH))


CHECKPOINT_OF: dict = {}     # id(weights) -> the checkpoint they came from (transformers reads its config.json)


def transformers_logits(weights, reference) -> np.ndarray:
    """transformers' logits at every position of the CPU engine's tokens (prompt + its greedy decode)."""
    pytest.importorskip("transformers")
    tokens = PROMPT + [int(t) for t in reference[len(PROMPT) - 1:-1].argmax(axis=1)]
    return hf_logits(hf_model_with_weights(CHECKPOINT_OF[id(weights)], weights), tokens)


def engine_for(weights, mode):
    if mode in ("gpu", "window"):
        budget = None
        if mode == "window":
            c = weights.config
            budget = budget_for_weight_fraction(c, gpu_mode_needs(c, MAX_BATCH, MAX_SEQ_LEN), 0.5)
        engine = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
        engine.device, engine.mode = "cuda", "gpu"
        # these models' weights are all "small items" (kept resident) unless the threshold drops
        engine.executor = GpuExecutor(weights, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH, vram_budget=budget,
                                      small_item_bytes=1024)
        if mode == "window":
            assert engine.executor.backend.window.streamed, "the budget should stream some weights"
        return engine
    return hybrid_engine(weights, mode, FAST_LINK if mode == "gated" else None)


@pytest.mark.parametrize("mode", ["gpu", "window", "gated", "layers=1"])
def test_every_gpu_path_matches_the_cpu_engine(model, mode, monkeypatch):
    fake_cuda.install(monkeypatch, mode="deferred")
    weights, reference = model
    engine = engine_for(weights, mode)
    if mode == "gated":
        assert engine.executor.plan(1).syncs_per_step > 0, "the fast link should offload some projections"
    ours = run(engine)
    assert_logits_match(ours, reference)
    engine.close()


@pytest.mark.parametrize("mode", ["gpu", "window", "gated", "layers=1"])
def test_every_gpu_path_matches_transformers(model, mode, monkeypatch):
    fake_cuda.install(monkeypatch, mode="deferred")
    weights, reference = model
    expected = transformers_logits(weights, reference)
    engine = engine_for(weights, mode)
    ours = run(engine)
    assert_logits_match(ours, expected)
    engine.close()


def test_a_head_dim_no_kernel_serves_stays_on_the_host_or_is_refused_by_name(tmp_path, monkeypatch):
    """head_dim 48: gated keeps rope and attention on the host and matches; gpu and layers=N say why."""
    import dataclasses
    from kestrel_stream.loading.presets import PRESETS
    fake_cuda.install(monkeypatch, mode="deferred")
    cfg = dataclasses.replace(PRESETS["llama3-tiny"], num_attention_heads=2, num_key_value_heads=1, head_dim=48,
                              hidden_size=96, intermediate_size=160)
    weights = ks.load(make_model(tmp_path / "d48", cfg, seed=1, dtype="f32"), device="cpu").weights
    reference = run(Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH))
    gated = engine_for(weights, "gated")
    assert gated.executor.plan(1).syncs_per_step > 0, "projections should still go to the GPU"
    ours = run(gated)
    assert relative_error(ours, reference) < 2e-3
    np.testing.assert_array_equal(ours.argmax(axis=1), reference.argmax(axis=1))
    for mode in ("gpu", "layers=1"):
        with pytest.raises(ValueError, match="head_dim=48"):
            engine_for(weights, mode)
