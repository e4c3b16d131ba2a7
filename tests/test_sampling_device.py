"""Sampled steps in gpu mode (kernels_ptx/sample.cu) on the emulated device, against the CPU engine,
and the kernel itself against the reference distribution on a real GPU."""
import numpy as np
import pytest

import fake_cuda
from bench.synthetic import random_q8_weights
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.run.engine import Engine
from test_sampling import CASES, LOGITS, chi2_critical, chi_square, expected_probs

CONFIG = ModelConfig(arch="qwen3", hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=512)
SAMPLED = dict(temperature=1.5, top_k=50, top_p=0.9, min_p=0.01)


@pytest.fixture(scope="module")
def weights():
    return random_q8_weights(CONFIG, seed=5)


def test_emulated_gpu_sampling_draws_the_cpu_engines_tokens(weights, monkeypatch):
    """The twin runs the reference sampler with the kernel's state words: with the same seed, the gpu
    path (a sampled decode step: one sync, 4 bytes back) gives the CPU engine's tokens."""
    cpu = Engine(weights, device="cpu", max_seq_len=64, max_batch=4)
    want = [cpu.generate([5, 3, 200, 17], 12, seed=seed, **SAMPLED).tokens for seed in (1, 2)]
    fake_cuda.install(monkeypatch, mode="deferred")
    gpu = Engine(weights, device="cuda", mode="gpu", max_seq_len=64, max_batch=4)
    gpu.chain_greedy = False                 # one sampled step per sync first; chained below
    for seed, expected in zip((1, 2), want):
        before = dict(gpu.executor.stats)
        result = gpu.generate([5, 3, 200, 17], 12, seed=seed, **SAMPLED)
        assert result.tokens == expected
        steps = len(result.tokens) - 1
        assert gpu.executor.stats["syncs"] - before["syncs"] == 1 + steps          # prefill + one per step
        # the prompt's last logits row once, then 4 bytes per sampled token
        assert gpu.executor.stats["d2h_bytes"] - before["d2h_bytes"] == CONFIG.vocab_size * 4 + 4 * steps   # the last row
    assert any(key[1] == "sample" for key in gpu.executor.steps._graphs)
    gpu.chain_greedy = True                  # chained on the device: the same draws, fewer syncs
    for seed, expected in zip((1, 2), want):
        before = dict(gpu.executor.stats)
        assert gpu.generate([5, 3, 200, 17], 12, seed=seed, **SAMPLED).tokens == expected
        assert gpu.executor.stats["syncs"] - before["syncs"] <= 1 + 1        # prefill + one chained run
    assert len(set(want[0])) > 2 and want[0] != want[1]                      # it did sample
    gpu.close()


@pytest.mark.gpu
@pytest.mark.parametrize("two_launches", [False, True], ids=["sample_rows", "candidates_then_finish"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sample_kernel_matches_the_reference_distribution(case, two_launches):
    """20,000 rows of the same logits, row r drawing with step r: sample_rows, or sample_candidates then
    sample_finish (the path gpu mode takes), then a chi-square test."""
    from kestrel_stream.cuda import driver
    from kestrel_stream.cuda.kernels import KernelSet
    from kestrel_stream.run.device.sampler import SAMPLE_CAP, candidate_splits, pack_state
    from kestrel_stream.text.sampling import SamplingParams
    if not driver.gpu_available():
        pytest.skip(driver.detect())
    device = driver.Device(0)
    kernels, arena, stream = KernelSet(device), driver.Arena(64 << 20), driver.Stream()
    draws, V = 20_000, len(LOGITS)
    params = SamplingParams(**CASES[case])
    state = np.stack([pack_state(params, 11, step) for step in range(draws)])
    logits_ptr, state_ptr, out_ptr = arena.alloc(draws * V * 4), arena.alloc(state.nbytes), arena.alloc(draws * 4)
    driver.h2d_sync(logits_ptr, np.ascontiguousarray(np.tile(LOGITS, (draws, 1))))
    driver.h2d_sync(state_ptr, state)
    if two_launches:
        S = candidate_splits(V)
        cand = arena.alloc(draws * S * (2 * SAMPLE_CAP + 4) * 4)
        kernels.launch("sample_candidates", (S, draws), (256,), "pipp", [logits_ptr, V, state_ptr, cand]).enqueue(stream)
        kernels.launch("sample_finish", (draws,), (1024,), "pippip",
                       [logits_ptr, V, state_ptr, cand, S, out_ptr]).enqueue(stream)
    else:
        kernels.launch("sample_rows", (draws,), (1024,), "pipp", [logits_ptr, V, state_ptr, out_ptr]).enqueue(stream)
    tokens = np.empty(draws, np.int32)
    driver.d2h_async(tokens, out_ptr, tokens.nbytes, stream)
    stream.synchronize()
    counts = np.bincount(tokens, minlength=V)
    stat, dof = chi_square(counts, expected_probs(LOGITS.astype(np.float64), **CASES[case]))
    assert stat < chi2_critical(dof), f"{case}: chi-square {stat:.1f} over {dof} dof"


def test_emulated_candidates_then_finish_draw_the_reference_tokens(monkeypatch):
    """The twins of the two-launch sampler: candidates per slice (top_k 1, 40, 64), the whole row for top_k
    0 and 65 and for a slice that left out ties at the row's k-th value; every token is the reference's."""
    from fake_sample import cand_views
    from kestrel_stream.cuda import driver
    from kestrel_stream.run.device.sampler import SAMPLE_CAP, candidate_splits, pack_state
    from kestrel_stream.text.sampling import SamplingParams, sample_logits
    fake_cuda.install(monkeypatch)
    rng, V, T = np.random.default_rng(14), 4096, 20
    logits = (3 * rng.standard_normal((T, V))).astype(np.float32)
    logits[T // 2:] = np.round(logits[T // 2:] * 4) / 4
    logits[T - 5:, 10:110] = 20.0              # 100 ties at the top inside slice 0
    params = [SamplingParams(temperature=0.8, top_k=[1, 40, 64, 0, 65][t % 5], top_p=0.95, min_p=0.01)
              for t in range(T)]
    state = np.stack([pack_state(p, 7, 1000 + t) for t, p in enumerate(params)])
    S, arena, stream, kernels = candidate_splits(V), driver.Arena(8 << 20), driver.Stream(), fake_cuda.FakeKernelSet()
    data, state_ptr = arena.alloc(logits.nbytes), arena.alloc(state.nbytes)
    cand, result = arena.alloc(T * S * (2 * SAMPLE_CAP + 4) * 4), arena.alloc(T * 4)
    driver.h2d_sync(data, logits)
    driver.h2d_sync(state_ptr, state)
    kernels.launch("sample_candidates", (S, T), (256,), "pipp", [data, V, state_ptr, cand]).enqueue(stream)
    kernels.launch("sample_finish", (T,), (1024,), "pippip", [data, V, state_ptr, cand, S, result]).enqueue(stream)
    tokens = fake_cuda.dev(result, T * 4, np.int32)
    assert tokens.tolist() == [sample_logits(logits[t], params[t], 7, 1000 + t) for t in range(T)]
    assert fake_cuda.dev(state_ptr, state.nbytes, np.uint32).reshape(T, 8)[:, 6].tolist() == list(range(1001, 1001 + T))
    _, _, meta = cand_views(cand, 1, S)                            # top_k 40 of random logits
    assert meta[:, 0].tolist() == [40] * S and not meta[:, 1].any()
    _, ids, meta = cand_views(cand, T - 4, S)                      # top_k 40 of the 100 ties: left out
    assert meta[0, :2].tolist() == [40, 1] and ids[0, :40].tolist() == list(range(10, 50))
