"""Mode offload on the device (skipped without a GPU): the placements the cost model can choose -- host
layers and streamed layers together, host only, ring only, lm_head on the host -- against the CPU engine's
logits (2e-3 relative, the same argmax), prefill and decode, and a batch of sessions."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bench.synthetic import random_q8_weights
from hf_oracle import assert_logits_match
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.run.engine import Engine
from kestrel_stream.run.step_executor import StepExecutor
from test_exact_q8 import negated_halves
from test_offload_emulated import PROFILES, budget_for

pytestmark = pytest.mark.gpu

CONFIG = ModelConfig(arch="qwen3", hidden_size=256, intermediate_size=256, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                     max_position_embeddings=512)
PROMPT = [5, 3, 200, 17, 42, 8, 1, 99, 250, 7, 64, 31]


def run(engine, steps: int = 12) -> np.ndarray:
    s = engine.new_session()
    out = [s.prefill(PROMPT)]
    token = int(np.argmax(out[0][-1]))
    for _ in range(steps):
        out.append(s.decode(token)[None])
        token = int(np.argmax(out[-1][-1]))
    s.close()
    return np.concatenate(out)


@pytest.fixture(scope="module")
def model():
    weights = random_q8_weights(CONFIG, seed=5)
    return weights, run(Engine(weights, device="cpu", max_seq_len=32, max_batch=4))


@pytest.mark.parametrize("kind,fraction", [("mixed", 0.5), ("host", 0.5), ("ring", 0.3), ("mixed", 0.12)])
def test_offload_on_the_device_matches_the_cpu_engine(model, kind, fraction):
    weights, reference = model
    executor = StepExecutor(weights, "offload", PROFILES[kind], max_seq_len=32, max_batch=4,
                            vram_budget=budget_for(fraction, PROFILES[kind]))
    engine = Engine(weights, device="cpu", max_seq_len=32, max_batch=4)
    engine.device, engine.mode, engine.executor = "cuda", "offload", executor
    assert_logits_match(run(engine), reference)
    assert executor.stats.get("graph_replays"), "12 decode steps of one size: replays of one step graph"
    sessions = [engine.new_session() for _ in range(3)]
    for i, s in enumerate(sessions):
        s.prefill(PROMPT[:4 + i])
    batched = engine.decode_batch([(s, 11) for s in sessions])
    cpu = Engine(weights, device="cpu", max_seq_len=32, max_batch=4)
    for i, row in enumerate(batched):
        with cpu.new_session() as s:
            s.prefill(PROMPT[:4 + i])
            assert_logits_match(row[None], s.decode(11)[None])
    engine.close()


@pytest.mark.parametrize("mode", ["gpu", "offload"])
def test_negative_q8_0_scales_give_the_cpu_engines_logits(model, mode):
    weights, reference = model
    flipped = negated_halves(weights)
    assert (flipped.layers[0].wo.scales < 0).mean() > 0.3 and flipped.tied
    assert np.array_equal(flipped.layers[0].wo.dequantize(), weights.layers[0].wo.dequantize())
    if mode == "gpu":
        engine = Engine(flipped, device="cuda", mode="gpu", max_seq_len=32, max_batch=4)
    else:
        executor = StepExecutor(flipped, "offload", PROFILES["mixed"], max_seq_len=32, max_batch=4,
                                vram_budget=budget_for(0.5, PROFILES["mixed"]))
        engine = Engine(flipped, device="cpu", max_seq_len=32, max_batch=4)
        engine.device, engine.mode, engine.executor = "cuda", "offload", executor
    assert_logits_match(run(engine), reference)
    engine.close()
