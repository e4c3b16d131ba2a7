"""`gpu` mode against the numpy engine on random Qwen3 and Llama models (run on a GPU)."""
import numpy as np
import pytest

from kestrel_stream.model.config import ModelConfig
from kestrel_stream.run.compat import CpuExecutor
from kestrel_stream.cuda import driver
from kestrel_stream.model.quant import quantize
from kestrel_stream.model.weights import LayerWeights, ModelWeights

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not driver.gpu_available(), reason=f"{driver.detect()}")]

SHAPES = {
    # Qwen3: hidden != heads*head_dim, K of the down projection (544) a multiple of 32 not 256, GQA 2
    "qwen3": dict(arch="qwen3", hidden_size=320, intermediate_size=544, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=128, vocab_size=1000,
                  rope_theta=1e6, tie_word_embeddings=True),
    # Llama: GQA 4, untied lm_head, head_dim 64
    "llama": dict(arch="llama", hidden_size=256, intermediate_size=480, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=64, vocab_size=777,
                  rope_theta=10000.0, tie_word_embeddings=False),
}


def random_weights(arch: str, seed: int = 0) -> ModelWeights:
    c = ModelConfig(**SHAPES[arch])
    rng = np.random.default_rng(seed)

    def linear(n, k):
        return quantize(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k))

    def norm(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    H, I = c.hidden_size, c.intermediate_size
    layers = [LayerWeights(attn_norm=norm(H), wqkv=linear(c.q_size + 2 * c.kv_size, H), wo=linear(H, c.q_size),
                           mlp_norm=norm(H), w_gate_up=linear(2 * I, H), w_down=linear(H, I),
                           q_norm=norm(c.head_dim) if c.qk_norm else None,
                           k_norm=norm(c.head_dim) if c.qk_norm else None)
              for _ in range(c.num_hidden_layers)]
    embed = quantize(rng.standard_normal((c.vocab_size, H)).astype(np.float32))
    lm_head = embed if c.tie_word_embeddings else linear(c.vocab_size, H)
    return ModelWeights(c, embed, layers, norm(H), lm_head, source=f"random {arch}")


def relative(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_gpu_mode_matches_cpu_over_prefill_and_16_decode_steps(arch):
    from kestrel_stream.run.compat import GpuExecutor
    weights = random_weights(arch)
    cpu = CpuExecutor(weights)
    gpu = GpuExecutor(weights, max_seq_len=64, max_batch=4, prefill_chunk=16, verify=True)
    # 21 tokens: a 16-token chunk (tensor-core GEMM) then a 5-token chunk (GEMV) over the cache so far
    prompt = np.array([3, 141, 59, 26, 535, 89, 79, 32, 384, 62, 64, 33, 8, 327, 750, 28, 641, 97, 16, 9, 3],
                      np.int64)
    cpu_kv, gpu_kv = cpu.alloc_kv(64), gpu.alloc_kv(64)
    want = cpu.forward([(cpu_kv, prompt, 0)])[0]
    got = gpu.forward([(gpu_kv, prompt, 0)])[0]
    assert relative(got, want) < 2e-3
    np.testing.assert_array_equal(got.argmax(axis=1), want.argmax(axis=1))
    token, position = int(want[-1].argmax()), len(prompt)
    syncs_before = gpu.stats["syncs"]
    for _ in range(16):
        want = cpu.forward([(cpu_kv, np.array([token]), position)])[0]
        got = gpu.forward([(gpu_kv, np.array([token]), position)])[0]
        assert relative(got, want) < 2e-3
        assert int(got.argmax()) == int(want.argmax())
        token, position = int(want.argmax()), position + 1
    assert gpu.stats["syncs"] - syncs_before == 16, "exactly one host sync per decoded step"
    assert gpu.stats["graphs_captured"] == 1 and gpu.stats["graph_replays"] == 16
    assert gpu.stats["verify_mismatches"] == 0 and gpu.stats["verify_rows"] == len(prompt) + 16
    gpu.close()


def test_batched_decode_uses_padded_buckets_and_matches_cpu():
    from kestrel_stream.run.compat import GpuExecutor
    weights = random_weights("qwen3", seed=5)
    cpu = CpuExecutor(weights)
    gpu = GpuExecutor(weights, max_seq_len=32, max_batch=4, prefill_chunk=16)
    prompts = [np.array([1, 2, 3]), np.array([9]), np.array([400, 7, 7, 7, 8])]
    sessions = [(cpu.alloc_kv(32), gpu.alloc_kv(32), p) for p in prompts]
    # one mixed step prefills all three sessions together
    want = cpu.forward([(c, p, 0) for c, _, p in sessions])
    got = gpu.forward([(g, p, 0) for _, g, p in sessions])
    for g, w in zip(got, want):
        assert relative(g, w) < 2e-3
    tokens = [int(w[-1].argmax()) for w in want]
    positions = [len(p) for p in prompts]
    for step in range(4):
        # 3 sessions → the 4-slot graph with one padded slot; then 2 sessions → the 2-slot graph
        active = sessions if step < 2 else sessions[:2]
        want = cpu.forward([(c, np.array([tokens[i]]), positions[i]) for i, (c, _, _) in enumerate(active)])
        got = gpu.forward([(g, np.array([tokens[i]]), positions[i]) for i, (_, g, _) in enumerate(active)])
        for i, (g, w) in enumerate(zip(got, want)):
            assert relative(g, w) < 2e-3 and int(g.argmax()) == int(w.argmax())
            tokens[i], positions[i] = int(w.argmax()), positions[i] + 1
    assert gpu.stats["graphs_captured"] == 2
    used_before = gpu.kv_stats()["kv_blocks_used"]        # a freed session's blocks go back to the KV pool
    gpu.free_kv(sessions[0][1])
    assert gpu.kv_stats()["kv_blocks_used"] < used_before
    gpu.close()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_generate_takes_the_argmax_on_the_device(arch):
    """generate() in gpu mode: each decode step's argmax on the device, 4 bytes back, one sync; the
    same tokens as the CPU engine."""
    from kestrel_stream.run.engine import Engine
    weights = random_weights(arch, seed=6)
    prompt = [3, 141, 59, 26, 235, 89, 79]
    want = Engine(weights, device="cpu", max_seq_len=64).generate(prompt, 16)
    engine = Engine(weights, device="cuda", mode="gpu", max_seq_len=64)
    engine.chain_greedy = False
    got = engine.generate(prompt, 16)
    assert got.tokens == want.tokens
    assert got.stats["syncs_per_token"] == 1 and got.stats["d2h_bytes"] == 4 * 15
    assert (1, True) in engine.executor.steps._graphs
    engine.chain_greedy = True                  # chained on the device: runs of 6 steps per host sync
    engine.executor.steps.chain.steps_per_sync = 6
    chained = engine.generate(prompt, 16)
    assert chained.tokens == want.tokens and chained.stats["syncs"] == 3   # 15 steps: 6 + 6 + 3
    engine.close()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_batched_decode_of_9_to_64_sessions_and_last_row_prefill_match_cpu(arch):
    """Decode batches of 11 and 40 sessions (the bucket-16 and bucket-64 graphs, tensor-core GEMM)
    and a 300-token prefill asking for its last row only, against the numpy engine: 2e-3, same argmax."""
    from kestrel_stream.run.compat import GpuExecutor
    weights = random_weights(arch, seed=2)
    cpu = CpuExecutor(weights)
    gpu = GpuExecutor(weights, max_seq_len=320, max_batch=64, max_sessions=41)
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, weights.config.vocab_size, 300)
    cpu_kv, gpu_kv = cpu.alloc_kv(320), gpu.alloc_kv(320)
    [want] = cpu.forward([(cpu_kv, prompt, 0)], logits="last")
    [got] = gpu.forward([(gpu_kv, prompt, 0)], logits="last")
    assert relative(got, want) < 2e-3 and np.argmax(got) == np.argmax(want)
    for count in (11, 40):
        pairs = [(cpu.alloc_kv(8), gpu.alloc_kv(8)) for _ in range(count)]
        prompts = [rng.integers(0, weights.config.vocab_size, 3) for _ in range(count)]
        for (ckv, gkv), p in zip(pairs, prompts):
            cpu.forward([(ckv, p, 0)])
            gpu.forward([(gkv, p, 0)])
        tokens = rng.integers(0, weights.config.vocab_size, count)
        want = cpu.forward([(ckv, np.array([t]), 3) for (ckv, _), t in zip(pairs, tokens)])
        got = gpu.forward([(gkv, np.array([t]), 3) for (_, gkv), t in zip(pairs, tokens)])
        for g, w in zip(got, want):
            assert relative(g[0], w[0]) < 2e-3 and np.argmax(g[0]) == np.argmax(w[0])
        for ckv, gkv in pairs:
            gpu.free_kv(gkv)
    assert {16, 64} <= {bucket for bucket, _ in gpu.steps._graphs}
    gpu.close()
