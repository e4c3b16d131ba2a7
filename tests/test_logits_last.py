"""Logits only where asked: prefill(ids, logits="last") runs lm_head on the last row alone, on the CPU
engine and in gpu mode (the emulated device), and returns what the full prefill's last row is."""
from __future__ import annotations

import numpy as np
import pytest

import fake_cuda
from hf_oracle import relative_error
from bench.synthetic import random_q8_weights
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.run.engine import Engine

CONFIG = ModelConfig(arch="qwen3", hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=320,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                     max_position_embeddings=256)
PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, 320, 100)]


@pytest.fixture(scope="module")
def weights():
    return random_q8_weights(CONFIG, seed=11)


@pytest.fixture(scope="module")
def cpu(weights):
    return Engine(weights, device="cpu", max_seq_len=128)


def test_cpu_prefill_last_is_the_last_row(cpu):
    with cpu.new_session() as full, cpu.new_session() as last:
        want = full.prefill(PROMPT)[-1]
        got = last.prefill(PROMPT, logits="last")
        assert got.shape == (CONFIG.vocab_size,) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert last.position == len(PROMPT)
        with pytest.raises(ValueError, match=r"logits='first'.*'all', 'last'"):
            last.prefill([1, 2], logits="first")
        assert last.position == len(PROMPT), "a bad request changes nothing"


@pytest.fixture
def gpu(weights, monkeypatch):
    fake_cuda.install(monkeypatch, mode="deferred")
    from kestrel_stream.run.compat import GpuExecutor
    executor = GpuExecutor(weights, max_seq_len=128, max_batch=4, prefill_chunk=96)
    assert (executor.steps.max_tokens, executor.steps.logits_rows) == (96, 64)
    yield executor
    executor.close()


def cpu_last_rows(cpu, prompts):
    rows = []
    for prompt in prompts:
        with cpu.new_session() as s:
            rows.append(s.prefill(prompt, logits="last"))
    return rows


def test_gpu_prefill_last_runs_lm_head_once_and_copies_one_row(gpu, cpu):
    kv = gpu.alloc_kv(128)
    before = dict(gpu.stats)
    [last] = gpu.forward([(kv, np.array(PROMPT), 0)], logits="last")
    assert last.shape == (1, CONFIG.vocab_size)
    assert gpu.stats["syncs"] - before["syncs"] == 2, "chunks of max_tokens (96 + 4)"
    assert gpu.stats["d2h_bytes"] - before["d2h_bytes"] == 4 * CONFIG.vocab_size
    first_chunk = gpu.steps.step_launches(96, (0, 0))
    assert "lm_head" not in [launch.labels["op"] for launch in first_chunk]
    [want] = cpu_last_rows(cpu, [PROMPT])
    assert relative_error(last[0], want) < 2e-3 and int(np.argmax(last[0])) == int(np.argmax(want))
    before = dict(gpu.stats)
    [full] = gpu.forward([(kv, np.array(PROMPT), 0)])
    assert full.shape == (len(PROMPT), CONFIG.vocab_size)
    assert gpu.stats["syncs"] - before["syncs"] == 3, "a 96-token step, its lm_head on rows 0..63 then 64..95; 4"
    step_kernels = gpu.steps.kernel_count(gpu.steps.step_launches(96, (0, 64)))
    lm_head_kernels = sum(l.launch_count for l in gpu.steps.step_launches(96, (64, 32)) if l.labels["op"] == "lm_head")
    assert gpu.stats["kernels"] - before["kernels"] == (step_kernels + lm_head_kernels
                                                         + gpu.steps.kernel_count(gpu.steps.step_launches(4))), \
        "the layers run once per chunk"
    assert gpu.stats["d2h_bytes"] - before["d2h_bytes"] == 4 * CONFIG.vocab_size * len(PROMPT)
    assert relative_error(full[-1], last[0]) < 2e-3     # other chunks: GEMV vs GEMM for the last rows
    gpu.free_kv(kv)


@pytest.mark.parametrize("lengths,syncs", [((30, 50), 1), ((10, 80), 2)])
def test_gpu_last_rows_of_several_sessions(gpu, cpu, lengths, syncs):
    """Rows 29 and 79 fit one chunk and one 51-row lm_head; rows 9 and 89 span more than the 64
    logits rows, so the chunk ends after row 9."""
    prompts = [PROMPT[:n] for n in lengths]
    kvs = [gpu.alloc_kv(128) for _ in prompts]
    before = gpu.stats["syncs"]
    outs = gpu.forward([(kv, np.array(p), 0) for kv, p in zip(kvs, prompts)], logits="last")
    assert gpu.stats["syncs"] - before == syncs
    for got, want in zip(outs, cpu_last_rows(cpu, prompts)):
        assert got.shape == (1, CONFIG.vocab_size)
        assert relative_error(got[0], want) < 2e-3 and int(np.argmax(got[0])) == int(np.argmax(want))
    for kv in kvs:
        gpu.free_kv(kv)


def test_cpu_prefill_argmax_is_each_rows_argmax(cpu):
    with cpu.new_session() as full, cpu.new_session() as picks:
        want = np.argmax(full.prefill(PROMPT[:20]), axis=1)
        got = picks.prefill(PROMPT[:20], logits="argmax")
        assert got.dtype == np.int64 and np.array_equal(got, want)
        assert picks.position == 20


def test_gpu_argmax_rows_on_the_device_copy_four_bytes_a_row(gpu):
    """Two sessions, 100 rows: chunks of logits_rows (64 + 36), argmax_split on each, 4 bytes a row back;
    the picks are the argmax of the same step's logits."""
    prompts = [PROMPT[:70], PROMPT[:30]]
    kvs = [gpu.alloc_kv(128) for _ in prompts]
    before = dict(gpu.stats)
    picks = gpu.forward_argmax([(kv, np.array(p), 0) for kv, p in zip(kvs, prompts)])
    assert gpu.stats["syncs"] - before["syncs"] == 2
    assert gpu.stats["d2h_bytes"] - before["d2h_bytes"] == 4 * 100
    for kv in kvs:
        gpu.truncate_kv(kv, 0)
    full = gpu.forward([(kv, np.array(p), 0) for kv, p in zip(kvs, prompts)])
    for got, rows, p in zip(picks, full, prompts):
        assert got.dtype == np.int64 and got.shape == (len(p),)
        assert np.array_equal(got, np.argmax(rows, axis=1))
    for kv in kvs:
        gpu.free_kv(kv)
