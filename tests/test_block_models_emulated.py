"""Models stored in 4/6-bit GGUF blocks in gpu mode, window mode (50 % of the weight bytes) and a split
mode, on the emulated device (fake_cuda + fake_block_kernels; gpu and window modes also on a real GPU,
marked `gpu`), against transformers on the same
dequantized weights: every position within 2e-3 relative, the same argmax.  A 12-token prefill runs
the tensor-core GEMM (q4_mma's 16-token tile), a 5-token one the GEMV (q4_gemv_m8 for 5 tokens), a
20-token one two 16-token tiles with K split, then 4 decode steps."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fake_cuda
from kestrel_stream.cuda import driver
from bench.make_gguf import write as write_gguf
from hf_oracle import assert_logits_match, hf_logits, hf_model_with_weights
from kestrel_stream.loading.loader import load_weights
from kestrel_stream.loading.presets import make_model
from kestrel_stream.model.quant4 import BlockTensor, RowStack
from kestrel_stream.run.engine import Engine
from kestrel_stream.run.compat import HybridExecutor
from kestrel_stream.run.device.weight_window import weight_tensors
from test_executors_emulated import MAX_BATCH, MAX_SEQ_LEN, gpu_needs
from test_quant4 import CFG, LLAMA
from kestrel_stream.run.device.budget import budget_for_weight_fraction

# every weight above the window's 64 KB "always resident" size in its format, so half a budget streams
QWEN3 = dataclasses.replace(CFG, hidden_size=512, intermediate_size=1024, num_attention_heads=8)
LLAMA_512 = dataclasses.replace(LLAMA, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                                num_key_value_heads=2)
MODELS = {"q4_k_m-qwen3": ("q4_k_m", QWEN3), "q4_0-llama": ("q4_0", LLAMA_512), "q6_k-qwen3": ("q6_k", QWEN3)}
PROMPTS = ([5, 3, 200, 17, 42, 8, 1, 99, 250, 7, 64, 31], [9, 8, 7, 6, 5], [(7 * i + 3) % 251 for i in range(20)])
DECODE_STEPS = 4


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory):
    mix, cfg = MODELS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    write_gguf(cfg, None, str(tmp / "m.gguf"), seed=11, mix=mix)
    weights = load_weights(tmp / "m.gguf")
    hf = hf_model_with_weights(make_model(tmp / "hf", cfg, seed=0, dtype="f32"), weights)
    return weights, hf


def run(engine, prompt):
    s = engine.new_session()
    steps = [s.prefill(prompt)]
    tokens = list(prompt)
    for _ in range(DECODE_STEPS):
        tokens.append(int(np.argmax(steps[-1][-1])))
        steps.append(s.decode(tokens[-1])[None])
    s.close()
    return np.concatenate(steps), tokens


def check_against_transformers(engine, hf):
    for prompt in PROMPTS:
        ours, tokens = run(engine, prompt)
        reference = hf_logits(hf, tokens)
        assert_logits_match(ours, reference)


@pytest.mark.parametrize("device", ["emulated", pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not driver.gpu_available(), reason="no GPU")])])
@pytest.mark.parametrize("fraction", [None, 0.5])
def test_gpu_and_window_modes(model, monkeypatch, fraction, device, request):
    weights, hf = model
    if fraction is not None and "q6_k" in request.node.name and device == "emulated":
        pytest.skip("one format throughout: the other two models stream")
    if device == "emulated":
        fake_cuda.install(monkeypatch, mode="deferred")
    c = weights.config
    budget = None if fraction is None else budget_for_weight_fraction(c, gpu_needs(c), fraction)
    engine = Engine(weights, device="cuda", mode="gpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH,
                    vram_budget=budget)
    window = engine.executor.backend.window
    assert bool(window.streamed) == (fraction is not None)
    if fraction is not None:   # what crosses PCIe per step is the weights' own bytes (plus alignment)
        tensors = weight_tensors(weights)
        planned = engine.executor.window_plan.streamed_bytes_per_step
        assert planned == sum(tensors[name][0].nbytes for name in window.streamed)
        assert planned <= window.streamed_bytes_per_step < planned + 256 * len(window.streamed)
    check_against_transformers(engine, hf)
    names = {launch.name for launch in engine.executor.steps.step_launches(1)}
    assert any(n.startswith(("q4_", "q6_")) for n in names), names
    engine.close()


def test_a_split_mode_uploads_blocks(model, monkeypatch, request):
    weights, hf = model
    if "q4_k_m" not in request.node.name:
        pytest.skip("the mix (both formats, a two-format QKV) covers the split modes' uploads")
    fake_cuda.install(monkeypatch, mode="deferred")
    engine = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    engine.device, engine.mode = "cuda", "layers=2"
    engine.executor = HybridExecutor(weights, "layers=2", None, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    check_against_transformers(engine, hf)
    engine.close()


def test_the_mix_keeps_two_formats_in_one_qkv(model):
    weights, _ = model
    kinds = {type(lw.wqkv) for lw in weights.layers}
    if weights.config.weight_formats and dict(weights.config.weight_formats).get(
            "model.layers.2.self_attn.v_proj.weight") == "Q6_K" and weights.config.arch == "qwen3" \
            and dict(weights.config.weight_formats).get("model.layers.2.self_attn.q_proj.weight") == "Q4_K":
        assert kinds == {BlockTensor, RowStack}
    else:
        assert kinds == {BlockTensor}
