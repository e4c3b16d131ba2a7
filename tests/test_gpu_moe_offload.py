"""Mixture-of-experts models in mode offload on the device (skipped without a GPU): Qwen3-MoE and Mixtral
with attention resident or streamed on the GPU and the router and experts on the host, against the CPU
engine's logits (2e-3 relative, the same argmax), prefill and decode, a batch of sessions, and gpu mode
becoming offload for them -- the checks of test_moe_offload_emulated.py on the real kernels."""
from __future__ import annotations

import numpy as np
import pytest

from hf_oracle import assert_logits_match
from test_moe_offload_emulated import GIVEN, assert_batched_decode_matches, MAX_SEQ_LEN, PROMPTS, model, offload_engine, run  # noqa: F401

pytestmark = pytest.mark.gpu


def test_attention_resident_and_experts_on_the_host_on_the_device(model):  # noqa: F811
    weights, _, reference = model
    engine = offload_engine(weights)
    assert set(engine.executor.placement.homes) <= {"attention", "resident"}
    for prompt, expected in zip(PROMPTS, reference):
        assert_logits_match(run(engine, prompt), expected)
    engine.close()


@pytest.mark.parametrize("which", range(3))
def test_homes_given_on_the_device(model, monkeypatch, which):  # noqa: F811
    """qkv and o streamed through the ring, on the host, or resident, a dense layer's every home."""
    weights, _, reference = model
    homes = GIVEN["mixtral-tiny" if weights.config.arch == "mixtral" else "qwen3-moe-tiny"][which]
    monkeypatch.setenv("KESTREL_OFFLOAD_HOMES", homes)
    engine = offload_engine(weights)
    for prompt, expected in zip(PROMPTS, reference):
        assert_logits_match(run(engine, prompt), expected)
    engine.close()


def test_a_batch_of_sessions_on_the_device(model):  # noqa: F811
    weights, cpu, _ = model
    engine = offload_engine(weights)
    assert_batched_decode_matches(engine, cpu)
    kvs = [engine.executor.alloc_kv(MAX_SEQ_LEN) for _ in PROMPTS]
    together = engine.executor.forward([(kv, np.array(p), 0) for kv, p in zip(kvs, PROMPTS)])
    for prompt, ours in zip(PROMPTS, together):
        with cpu.new_session() as s:
            assert_logits_match(ours, s.prefill(prompt))
    for kv in kvs:
        engine.executor.free_kv(kv)
    engine.close()


def test_gpu_mode_runs_a_moe_model_as_offload_on_the_device(model):  # noqa: F811
    weights, _, reference = model
    engine = offload_engine(weights, mode="gpu")
    assert engine.executor.mode == "offload"
    assert_logits_match(run(engine, PROMPTS[1]), reference[1])
    engine.close()
