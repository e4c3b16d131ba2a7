"""Prompt-prefix reuse (run/prefix_cache.py) on the CPU engine: a second prompt sharing a 1,000-token
prefix computes only its suffix and generates the same tokens as a fresh run; LRU within the budget."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hf_oracle import relative_error
from kestrel_stream.loading.presets import PRESETS
from bench.synthetic import random_q8_weights
from kestrel_stream.run.engine import Engine

RNG = np.random.default_rng(11)
PREFIX = [int(t) for t in RNG.integers(0, 256, 1000)]


@pytest.fixture(scope="module")
def weights():
    # the tiny preset with a 4,096-position context (its own is 512), for the 1,000-token prefixes
    return random_q8_weights(dataclasses.replace(PRESETS["tiny"], max_position_embeddings=4096), seed=2)


def greedy(engine, session, logits, n):
    tokens = [int(np.argmax(logits[-1]))]
    while len(tokens) < n:
        tokens.append(int(np.argmax(session.decode(tokens[-1]))))
    return tokens


def test_a_shared_prefix_is_adopted_and_the_tokens_match_a_fresh_run(weights):
    engine = Engine(weights, device="cpu", max_seq_len=1100)
    cache = engine.enable_prefix_cache(budget_positions=4096)
    first = engine.new_session()
    cache.prefill_last(first, PREFIX + [1, 2, 3])
    assert cache.stats["prefix_misses"] == 1 and cache.cached_positions == 992     # 62 full blocks of 16
    suffix = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 200, 100]
    before = engine.executor.stats["tokens"]
    second = engine.new_session()
    logits = cache.prefill_last(second, PREFIX + suffix)
    assert engine.executor.stats["tokens"] - before == 1000 + len(suffix) - 992    # only past the prefix
    assert cache.stats["prefix_hits"] == 1 and cache.stats["prefix_reused_tokens"] == 992
    assert second.position == 1000 + len(suffix) and second.tokens == PREFIX + suffix
    ours = greedy(engine, second, logits, 16)

    fresh_engine = Engine(weights, device="cpu", max_seq_len=1100)
    with fresh_engine.new_session() as fresh:
        expected_logits = fresh.prefill(PREFIX + suffix)
        assert relative_error(logits[-1], expected_logits[-1]) < 1e-4
        assert ours == greedy(fresh_engine, fresh, expected_logits, 16)
    first.decode(5)                                  # the first session is untouched by the second
    engine.close()


def test_a_prompt_wholly_cached_still_computes_its_last_token(weights):
    engine = Engine(weights, device="cpu", max_seq_len=64)
    cache = engine.enable_prefix_cache(budget_positions=64)
    prompt = list(range(32))                         # exactly two blocks
    cache.prefill_last(engine.new_session(), prompt)
    s = engine.new_session()
    logits = cache.prefill_last(s, prompt)
    assert logits.shape[0] == 16 and cache.stats["prefix_reused_tokens"] == 16   # the first block only
    engine.close()


def test_least_recently_used_prefixes_go_first_within_the_budget(weights):
    engine = Engine(weights, device="cpu", max_seq_len=64)
    cache = engine.enable_prefix_cache(budget_positions=64)
    prompts = {name: [base + i for i in range(33)] for name, base in (("a", 0), ("b", 40), ("c", 80))}
    for name in ("a", "b"):
        cache.prefill_last(engine.new_session(), prompts[name])
    cache.prefill_last(engine.new_session(), prompts["a"])          # a is now the most recent
    cache.prefill_last(engine.new_session(), prompts["c"])          # 96 > 64 positions: b goes
    assert cache.stats["prefix_evictions"] == 1 and cache.cached_positions == 64
    hits = cache.stats["prefix_hits"]
    cache.prefill_last(engine.new_session(), prompts["b"])
    assert cache.stats["prefix_hits"] == hits                       # b was evicted
    cache.prefill_last(engine.new_session(), prompts["c"])
    assert cache.stats["prefix_hits"] == hits + 1
    engine.close()


def test_shared_prefix_blocks_survive_the_eviction_of_their_first_owner(weights):
    engine = Engine(weights, device="cpu", max_seq_len=80)
    cache = engine.enable_prefix_cache(budget_positions=80)
    common = list(range(100, 132))                                  # two blocks both prompts share
    cache.prefill_last(engine.new_session(), common + [1] * 17)     # entry 1: 48 positions
    cache.prefill_last(engine.new_session(), common + [2] * 17)     # entry 2: 48: entry 1 evicted
    assert cache.stats["prefix_evictions"] == 1
    before = cache.stats["prefix_reused_tokens"]
    s = engine.new_session()
    cache.prefill_last(s, common + [2] * 16 + [7])
    assert cache.stats["prefix_reused_tokens"] - before == 48       # found through entry 2's hashes
    engine.close()


def test_gpu_mode_entries_share_the_pools_blocks(weights, monkeypatch):
    import fake_cuda
    fake_cuda.install(monkeypatch, mode="deferred")
    engine = Engine(weights, device="cuda", mode="gpu", max_seq_len=128, max_batch=4)
    cache = engine.enable_prefix_cache(budget_positions=256)
    used = lambda: engine.executor.kv_stats()["kv_blocks_used"]      # noqa: E731
    base = used()
    prompt = list(range(40))
    first = engine.new_session()
    cache.prefill_last(first, prompt)
    assert used() == base + 3                        # 40 positions: 3 blocks, the entry shares 2 of them
    second = engine.new_session()
    logits = cache.prefill_last(second, prompt[:32] + [7, 7, 7])
    assert cache.stats["prefix_reused_tokens"] == 32 and logits.shape[0] == 3
    with engine.new_session() as fresh:
        assert relative_error(logits[-1], fresh.prefill(prompt[:32] + [7, 7, 7])[-1]) < 2e-3
    first.close()
    second.close()
    engine.close()


def test_cached_prefixes_give_way_to_new_sessions_when_the_tables_are_full(weights, monkeypatch):
    """gpu mode with 6 block-table rows: 5 prompts each leave a cached entry (a row each) after their
    sessions close; 5 new sessions at once still open (the oldest entries are evicted, one per session that
    needs its row), a sixth takes the last entry's row, and a seventh fails with the table's CapacityError."""
    import fake_cuda
    from kestrel_stream.errors import CapacityError
    fake_cuda.install(monkeypatch, mode="deferred")
    engine = Engine(weights, device="cuda", mode="gpu", max_seq_len=64, max_batch=4, max_sessions=6)
    cache = engine.enable_prefix_cache(budget_positions=1024)
    for i in range(5):
        with engine.new_session() as s:
            cache.prefill_last(s, [i + 1] * 20)
    assert len(cache.entries) == 5
    sessions = [engine.new_session() for _ in range(5)]
    assert len(cache.entries) == 1 and cache.stats["prefix_evictions"] == 4
    assert cache.prefill_last(sessions[0], [5] * 20).shape[0] == 4      # the newest entry's 16 positions adopted
    sessions.append(engine.new_session())
    assert not cache.entries
    with pytest.raises(CapacityError, match="session tables"):
        engine.new_session()
    for s in sessions:
        s.close()
    engine.close()


def test_the_cached_length_of_a_prompt_is_what_adopt_takes_and_asking_changes_nothing(weights):
    """The replica router's question (serve/replicas.py): how much of a prompt a cache holds, without a hit counted
    or an entry made more recent."""
    engine = Engine(weights, device="cpu", max_seq_len=1100)
    cache = engine.enable_prefix_cache(budget_positions=4096)
    cache.prefill_last(engine.new_session(), PREFIX[:100])
    cache.prefill_last(engine.new_session(), [7] * 40)
    prompt = PREFIX[:60] + [1, 2, 3]
    stats, order = dict(cache.stats), list(cache.entries)
    assert cache.cached_length(cache.prompt_hashes(prompt)) == 48       # three full blocks of 16
    assert cache.cached_length(cache.prompt_hashes([3] * 40)) == 0
    assert cache.cached_length(cache.prompt_hashes(PREFIX[:96] + [0])) == 96
    assert cache.stats == stats and list(cache.entries) == order
    assert cache.adopt(engine.new_session(), prompt) == 48
