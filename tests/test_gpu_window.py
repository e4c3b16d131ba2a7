"""`gpu` mode under a VRAM budget: streamed weights against the CPU engine (run on a GPU).

Budgets are KV + activations + a fraction of the weight bytes
(budget_for_weight_fraction), so the fraction is what the window has.  Every
check: prefill, then 32 decode steps teacher-forced with the CPU's greedy
tokens, within 2e-3 relative and identical argmax at every position.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import kestrel_stream as ks
from kestrel_stream.run.device.budget import budget_for_weight_fraction, gpu_mode_needs
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.run.compat import CpuExecutor
from kestrel_stream.model.quant import quantize
from kestrel_stream.model.weights import LayerWeights, ModelWeights

from hf_oracle import relative_error


@pytest.fixture(autouse=True)
def window_alone(monkeypatch):
    """These budgets test the window: gpu mode keeps it alone instead of becoming mode offload."""
    monkeypatch.setenv("KESTREL_OFFLOAD", "stream")


pytestmark = pytest.mark.gpu

SHAPES = {   # every Q8 weight above the 64 KB "always resident" size, so budgets really stream
    "qwen3": dict(arch="qwen3", hidden_size=256, intermediate_size=256, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512,
                  rope_theta=1e6, tie_word_embeddings=True),
    "llama": dict(arch="llama", hidden_size=256, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=64, vocab_size=384,
                  rope_theta=10000.0, tie_word_embeddings=False),
}
SEQ, BATCH, CHUNK, DECODE_STEPS = 64, 4, 16, 32
PROMPT = np.array([3, 141, 59, 26, 235, 89, 79, 32, 84, 62, 64, 33, 8, 127, 250, 28, 41, 97, 16, 9], np.int64)


def random_weights(arch: str, seed: int = 0) -> ModelWeights:
    c = ModelConfig(**SHAPES[arch])
    rng = np.random.default_rng(seed)
    linear = lambda n, k: quantize(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k))
    norm = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    H, I = c.hidden_size, c.intermediate_size
    layers = [LayerWeights(norm(H), linear(c.q_size + 2 * c.kv_size, H), linear(H, c.q_size), norm(H),
                           linear(2 * I, H), linear(H, I), norm(c.head_dim) if c.qk_norm else None,
                           norm(c.head_dim) if c.qk_norm else None) for _ in range(c.num_hidden_layers)]
    embed = quantize(rng.standard_normal((c.vocab_size, H)).astype(np.float32))
    lm_head = embed if c.tie_word_embeddings else linear(c.vocab_size, H)
    return ModelWeights(c, embed, layers, norm(H), lm_head, source=f"random {arch}")


def streaming_executor(weights, fraction, slots=2, distance=1):
    from kestrel_stream.run.compat import GpuExecutor
    needs = gpu_mode_needs(weights.config, BATCH, SEQ, CHUNK)
    budget = budget_for_weight_fraction(weights.config, needs, fraction, slots)
    gpu = GpuExecutor(weights, max_seq_len=SEQ, max_batch=BATCH, prefill_chunk=CHUNK, vram_budget=budget,
                      window_slots=slots, prefetch_distance=distance)
    assert gpu.steps.arena.capacity_bytes <= budget
    return gpu


def compare_decode(gpu, weights):
    cpu = CpuExecutor(weights)
    cpu_kv, gpu_kv = cpu.alloc_kv(SEQ), gpu.alloc_kv(SEQ)
    want = cpu.forward([(cpu_kv, PROMPT, 0)])[0]
    got = gpu.forward([(gpu_kv, PROMPT, 0)])[0]       # two eager chunks, each streaming every weight
    assert relative_error(got, want) < 2e-3
    np.testing.assert_array_equal(got.argmax(axis=1), want.argmax(axis=1))
    token, position = int(want[-1].argmax()), len(PROMPT)
    for step in range(DECODE_STEPS):                  # graph replays
        want = cpu.forward([(cpu_kv, np.array([token]), position)])[0]
        got = gpu.forward([(gpu_kv, np.array([token]), position)])[0]
        assert relative_error(got, want) < 2e-3, f"step {step}"
        assert int(got.argmax()) == int(want.argmax()), f"step {step}"
        token, position = int(want.argmax()), position + 1
    assert gpu.stats["graph_replays"] == DECODE_STEPS


def compare_mixed_steps(gpu, weights):
    """Consecutive steps of different token counts against the CPU engine: eager prefill chunks, decode graphs
    of three buckets (captured, then replayed in turn), graphs of one session's 2, 3 and 4 tokens between them
    (run/device/step_graphs.py) -- each step starts from the slots the one before it primed, whatever its
    kind."""
    cpu = CpuExecutor(weights)
    sessions = [(cpu.alloc_kv(SEQ), gpu.alloc_kv(SEQ)) for _ in range(3)]
    state = {}                      # session -> (next token, position)

    def step(rows):                 # rows: (session, tokens or None for its next token)
        batch = [(i, np.array([state[i][0]]) if t is None else np.asarray(t), 0 if t is not None and i not in state
                  else state[i][1]) for i, t in rows]
        want = cpu.forward([(sessions[i][0], t, p) for i, t, p in batch])
        got = gpu.forward([(sessions[i][1], t, p) for i, t, p in batch])
        for (i, t, p), w, g in zip(batch, want, got):
            assert relative_error(g, w) < 2e-3, f"session {i} at {p}"
            np.testing.assert_array_equal(g.argmax(axis=1), w.argmax(axis=1))
            state[i] = (int(w[-1].argmax()), p + len(t))
        return len(batch)

    passes, before, replays = 0, gpu.stats.get("streamed_bytes", 0), gpu.stats.get("graph_replays", 0)
    step([(0, PROMPT)]); passes += 2                              # two eager chunks
    step([(0, None)]); step([(0, None)]); passes += 2              # bucket 1: capture, replay
    step([(1, PROMPT[:3])]); passes += 1                          # a 3-token step: its graph
    step([(0, None), (1, None)]); passes += 1                     # bucket 2
    step([(0, None)]); passes += 1                                # bucket 1 again
    step([(1, [state[1][0], 7])]); passes += 1                    # two tokens of one session: a graph
    step([(2, PROMPT[5:9])]); passes += 1
    for _ in range(3):                                            # buckets 4, 1, 2 in turn
        step([(0, None), (1, None), (2, None)]); step([(2, None)]); step([(1, None), (0, None)]); passes += 3
    assert gpu.stats["streamed_bytes"] - before == passes * gpu.steps.window.streamed_bytes_per_step
    assert gpu.stats["graph_replays"] - replays == 13 + 3       # every step but the prompt's chunks


@pytest.mark.parametrize("slots,distance", [(2, 1), (3, 1), (3, 2)])
def test_consecutive_steps_of_different_token_counts(slots, distance):
    weights = random_weights("qwen3", seed=5)
    gpu = streaming_executor(weights, 0.25, slots, distance)
    assert len(gpu.steps.window.streamed) > 2 * slots
    compare_mixed_steps(gpu, weights)
    gpu.close()


@pytest.mark.parametrize("slots,distance", [(1, 0), (2, 1)])
def test_smallest_ring_reuses_slots_without_a_race(slots, distance):
    weights = random_weights("qwen3", seed=1)
    gpu = streaming_executor(weights, 0.25, slots, distance)
    window = gpu.window_plan
    assert window.slot_count == slots and len(window.streamed) > 4 * slots   # every slot is reused many times
    compare_decode(gpu, weights)
    passes = 2 + DECODE_STEPS                          # two prefill chunks, then one pass per decoded token
    assert gpu.stats["window_misses"] == passes * len(window.streamed)
    assert gpu.stats["streamed_bytes"] == passes * gpu.steps.window.streamed_bytes_per_step
    gpu.close()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_budgets_match_the_cpu_engine(arch, fraction):
    weights = random_weights(arch, seed=2)
    gpu = streaming_executor(weights, fraction)
    assert gpu.window_plan is not None and gpu.window_plan.streamed
    assert gpu.preload_line.startswith(f"preload: {len(gpu.window_plan.resident)}/")
    compare_decode(gpu, weights)
    gpu.close()


def test_batched_decode_streams_once_per_step():
    weights = random_weights("qwen3", seed=3)
    cpu, gpu = CpuExecutor(weights), streaming_executor(weights, 0.5)
    prompts = [PROMPT[:3], PROMPT[5:6], PROMPT[7:12]]
    sessions = [(cpu.alloc_kv(SEQ), gpu.alloc_kv(SEQ), p) for p in prompts]
    want = cpu.forward([(c, p, 0) for c, _, p in sessions])
    got = gpu.forward([(g, p, 0) for _, g, p in sessions])
    tokens, positions = [int(w[-1].argmax()) for w in want], [len(p) for p in prompts]
    before = gpu.stats["streamed_bytes"]
    for _ in range(4):
        want = cpu.forward([(c, np.array([tokens[i]]), positions[i]) for i, (c, _, _) in enumerate(sessions)])
        got = gpu.forward([(g, np.array([tokens[i]]), positions[i]) for i, (_, g, _) in enumerate(sessions)])
        for i, (g, w) in enumerate(zip(got, want)):
            assert relative_error(g, w) < 2e-3 and int(g.argmax()) == int(w.argmax())
            tokens[i], positions[i] = int(w.argmax()), positions[i] + 1
    assert gpu.stats["streamed_bytes"] - before == 4 * gpu.steps.window.streamed_bytes_per_step
    gpu.close()


def test_everything_fits_streams_nothing():
    weights = random_weights("llama", seed=4)
    gpu = streaming_executor(weights, 1.0)
    assert gpu.window_plan is None and gpu.steps.window.streamed == []
    total = len(gpu.steps.window.resident)
    assert gpu.preload_line.startswith(f"preload: {total}/{total} weights warmed in ")
    compare_decode(gpu, weights)
    assert gpu.stats["streamed_bytes"] == 0 and gpu.stats["window_misses"] == 0
    gpu.close()


def test_too_small_budget_fails_at_load_naming_the_numbers(llama_model):
    with pytest.raises(ValueError) as caught:
        ks.load(llama_model, device="cuda", mode="gpu", vram_budget="1MB")
    message = str(caught.value)
    assert "1000000 B" in message and "KV caches" in message and "--vram-budget" in message


def test_generate_json_reports_the_window(llama_model, capsys):
    from kestrel_stream.cli.main import main
    cpu = ks.load(llama_model, device="cpu")
    cfg = cpu.config            # the engine's defaults: max_batch 32 → 512-token steps, 64 logits rows
    needs = gpu_mode_needs(cfg, 32, cpu.max_seq_len)
    budget = budget_for_weight_fraction(cfg, needs, 0.5)
    common = ["generate", "--model", str(llama_model), "--prompt-ids", "5,3,200,17", "--max-new-tokens", "8",
              "--json"]
    assert main(common + ["--device", "cpu"]) == 0
    reference = json.loads(capsys.readouterr().out)
    assert main(common + ["--device", "cuda", "--mode", "gpu", "--vram-budget", str(budget)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["tokens"] == reference["tokens"]
    assert report["window"]["streamed_items"] > 0 and report["window"]["vram_budget_bytes"] == budget
    assert report["window_misses_per_token"] == report["window"]["streamed_items"]
    assert report["streamed_bytes_per_token"] > 0
    assert "preload: " in captured.err and "WARNING: only" in captured.err and "--vram-budget" in captured.err


def test_layers_mode_says_how_many_layers_are_offloaded(tiny_model, capsys):
    engine = ks.load(tiny_model, device="cuda", mode="layers=1")
    assert "offloaded 1/2 layers" in engine.executor.preload_line
    assert "offloaded 1/2 layers" in capsys.readouterr().err
    engine.close()
