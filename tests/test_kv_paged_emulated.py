"""gpu mode's paged KV pool: KV reserved only as sessions use it, many short and a few long sessions under
one budget, and f16 KV against the CPU engine over prefill + 64 decode steps.  Each test runs on the
emulated device and, marked `gpu`, on a real one where there is one."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fake_cuda
from hf_oracle import relative_error
from kestrel_stream.cuda import driver
from kestrel_stream.errors import CapacityError
from kestrel_stream.loading.presets import PRESETS
from bench.synthetic import random_q8_weights
from kestrel_stream.run.device.budget import arena_needs, plan_arena
from kestrel_stream.run.engine import Engine
from scheduler import WindowBudgetError

PROMPT = [5, 3, 200, 17, 42, 8, 1, 99, 250, 7, 64, 31]


@pytest.fixture(params=["emulated", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not driver.gpu_available(), reason=f"{driver.detect()}")])])
def emulated(request, monkeypatch):
    """The device the test's engines run on: the emulated one, or the real GPU."""
    if request.param == "emulated":
        fake_cuda.install(monkeypatch, mode="deferred")
    return request.param


def test_a_load_commits_no_kv_and_sessions_take_blocks_as_they_grow(emulated):
    engine = Engine(random_q8_weights(PRESETS["tiny"], seed=1), device="cuda", mode="gpu", max_seq_len=512,
                    max_batch=4)
    stats = engine.executor.kv_stats
    assert stats()["kv_blocks_used"] == 1                      # the scratch session's one block
    s = engine.new_session()
    assert stats()["kv_blocks_used"] == 1                      # opening reserves nothing
    s.prefill(PROMPT)
    assert stats()["kv_blocks_used"] == 2
    for token in range(5):
        s.decode(token)                                         # 17 positions: a second block
    assert stats()["kv_blocks_used"] == 3
    assert stats()["kv_bytes_used"] == 3 * stats()["kv_block_bytes"]
    s.reset()
    assert stats()["kv_blocks_used"] == 1
    engine.close()


def test_1000_short_and_4_long_sessions_fit_where_the_static_reservation_fails(emulated):
    budget, long_len, short_len = 400 << 20, 32768, 100
    config = dataclasses.replace(PRESETS["tiny"], max_position_embeddings=long_len)   # the engine checks it
    # today's reservation: float32 for every session at max_seq_len
    with pytest.raises(WindowBudgetError):
        plan_arena(config, arena_needs(config, 64, 1020 + 1, long_len, 16), budget)
    engine = Engine(random_q8_weights(config, seed=1), device="cuda", mode="gpu", max_seq_len=long_len,
                    max_batch=4, max_sessions=1020, vram_budget=budget)
    gpu = engine.executor
    short = [engine.new_session() for _ in range(1000)]
    long = [engine.new_session() for _ in range(4)]
    for s in short:                       # what a 100-token prefill reserves, without running 1000 of them
        gpu.backend.kv.prepare(s.kv, 0, short_len)
    for s in long:
        gpu.backend.kv.prepare(s.kv, 0, long_len)
    stats = gpu.kv_stats()
    blocks = 1000 * -(-short_len // 16) + 4 * (long_len // 16) + 1
    assert stats["kv_blocks_used"] == blocks and stats["kv_bytes_committed"] <= budget
    assert stats["kv_bytes_used"] == blocks * 16 * config.num_hidden_layers * 2 * config.kv_size * 2   # f16
    # the pool still computes: a new session among them matches the CPU engine
    cpu = Engine(gpu.weights, device="cpu", max_seq_len=64)
    with engine.new_session() as s, cpu.new_session() as ref:
        assert relative_error(s.prefill(PROMPT), ref.prefill(PROMPT)) < 2e-3
    extra = []
    with pytest.raises(CapacityError, match="KV pool"):  # more long sessions until the pool is spent
        for _ in range(stats["kv_blocks_max"] // (long_len // 16) + 1):
            extra.append(engine.new_session())
            gpu.backend.kv.prepare(extra[-1].kv, 0, long_len)
    assert gpu.backend.kv.length(extra[-1].kv) == 0               # the failed one took nothing
    for s in short + long + extra:
        s.close()
    assert gpu.kv_stats()["kv_blocks_used"] == 1
    engine.close()


def test_a_step_the_pool_cannot_hold_is_refused_before_it_runs(emulated):
    """A prefill in several chunks whose blocks the pool cannot all give is refused whole, before its first
    chunk: the session keeps its position, the pool its blocks; once blocks are free the same prefill runs
    and equals a session's that never failed."""
    block_bytes = 16 * PRESETS["tiny"].num_hidden_layers * 2 * PRESETS["tiny"].kv_size * 2
    config = dataclasses.replace(PRESETS["tiny"], max_position_embeddings=1024)
    weights = random_q8_weights(config, seed=1)
    engine = Engine(weights, device="cuda", mode="gpu", max_seq_len=1024, max_batch=4,
                    kv_pool_bytes=100 * block_bytes)
    a, b = engine.new_session(), engine.new_session()
    a.prefill([7] * 1000)                                # 63 blocks of 100 (and the scratch session's)
    used = engine.executor.kv_stats()["kv_blocks_used"]
    prompt = [int(t) % 250 + 1 for t in range(600)]
    with pytest.raises(CapacityError, match="the step needs 38 more block"):
        b.prefill(prompt)                  # chunks of 512 and 88 tokens: the first alone would fit
    assert b.position == 0 and not b.tokens and engine.executor.kv_stats()["kv_blocks_used"] == used
    a.close()
    refused_first = b.prefill(prompt)
    with engine.new_session() as fresh:                  # a session that never failed: the same numbers
        assert np.array_equal(refused_first, fresh.prefill(prompt))
    engine.close()


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_f16_kv_tracks_the_cpu_engine_over_64_decode_steps(emulated, preset):
    weights = random_q8_weights(PRESETS[preset], seed=7)
    cpu = Engine(weights, device="cpu", max_seq_len=128)
    gpu = Engine(weights, device="cuda", mode="gpu", max_seq_len=128, max_batch=4, kv_dtype="f16")
    with cpu.new_session() as ref, gpu.new_session() as s:
        expected, got = ref.prefill(PROMPT), s.prefill(PROMPT)
        worst = relative_error(got, expected)
        np.testing.assert_array_equal(got.argmax(axis=1), expected.argmax(axis=1))
        token = int(np.argmax(expected[-1]))
        for _ in range(64):
            expected, got = ref.decode(token), s.decode(token)
            worst = max(worst, relative_error(got, expected))
            assert int(np.argmax(got)) == int(np.argmax(expected))
            token = int(np.argmax(expected))
    assert worst < 2e-3, worst
    gpu.close()


def test_plan_shows_the_pool_where_the_static_reservation_did_not_fit(tmp_path):
    """qwen3-1.7b under 24 GiB: 65 float32 caches of 2,048 positions (today's reservation) need ~30 GB;
    the pool holds the weights resident and still has room for over 100 sessions of 2,048."""
    import json
    from test_cli import run_cli
    config = PRESETS["qwen3-1.7b"]
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    with pytest.raises(WindowBudgetError):
        plan_arena(config, arena_needs(config, 64, 65, 2048, 16), 24 << 30)
    out = json.loads(run_cli("plan", "--model", str(tmp_path), "--mode", "gpu", "--profile", "h200",
                             "--vram-budget", "24GiB", "--json").stdout)["window"]
    pool = out["kv_pool"]
    assert out["streamed_bytes_per_step"] == 0 and pool["kv_dtype"] == "f16" and pool["policy"] == "budget"
    assert pool["sessions_of_max_seq_len"] > 100 and out["arena_bytes"] + pool["max_bytes"] <= 24 << 30
    f32 = json.loads(run_cli("plan", "--model", str(tmp_path), "--mode", "gpu", "--profile", "h200",
                             "--vram-budget", "24GiB", "--kv-dtype", "f32", "--json").stdout)["window"]["kv_pool"]
    assert f32["block_bytes"] == 2 * pool["block_bytes"]
