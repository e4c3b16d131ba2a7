"""scheduler.kv_pool: blocks on growth, refcounted forks with copy-on-write, truncate, prefix reuse, LRU, sizing."""
from __future__ import annotations

import pytest

from scheduler.kv_pool import KVPool, PoolExhausted, block_hashes, kv_bytes_per_position, plan_kv_pool


def test_blocks_are_taken_as_a_session_grows_and_given_back_on_close():
    pool = KVPool(max_blocks=8, block_size=16)
    t = pool.open("a")
    assert pool.prepare_write("a", 0, 5) == [] and len(t.blocks) == 1 and t.length == 5
    pool.prepare_write("a", 5, 16)
    assert len(t.blocks) == 1                       # position 15 still in the first block
    pool.prepare_write("a", 16, 17)
    assert len(t.blocks) == 2 and pool.stats()["kv_blocks_used"] == 2
    pool.close("a")
    assert pool.stats()["kv_blocks_used"] == 0 and pool.stats()["kv_blocks_free"] == 8


def test_blocks_are_committed_in_chunks_only_as_needed():
    grown = []
    pool = KVPool(max_blocks=10, block_size=4, chunk_blocks=4, on_grow=lambda first, n: grown.append((first, n)))
    assert pool.committed_blocks == 0 and grown == []
    pool.open("a")
    pool.prepare_write("a", 0, 4 * 5)               # 5 blocks: two chunks
    assert grown == [(0, 4), (4, 4)] and pool.committed_blocks == 8
    pool.prepare_write("a", 20, 40)                 # 10 blocks in all: the last chunk is only 2
    assert grown[-1] == (8, 2) and pool.committed_blocks == 10


def test_exhaustion_raises_and_changes_nothing():
    pool = KVPool(max_blocks=3, block_size=4)
    t = pool.open("a")
    pool.prepare_write("a", 0, 8)
    before = (list(t.blocks), t.length, pool.stats())
    with pytest.raises(PoolExhausted, match="3 block"):
        pool.prepare_write("a", 8, 20)
    assert (t.blocks, t.length, pool.stats()) == before


def test_truncate_returns_whole_blocks_past_the_length():
    pool = KVPool(max_blocks=8, block_size=4)
    t = pool.open("a")
    pool.prepare_write("a", 0, 13)                  # 4 blocks
    pool.truncate("a", 5)
    assert len(t.blocks) == 2 and t.length == 5 and pool.stats()["kv_blocks_used"] == 2
    pool.truncate("a", 0)
    assert t.blocks == [] and pool.stats()["kv_blocks_used"] == 0


def test_fork_shares_blocks_and_copies_a_shared_block_on_first_write():
    pool = KVPool(max_blocks=8, block_size=4)
    a = pool.open("a")
    pool.prepare_write("a", 0, 6)                   # blocks 0 (full) and 1 (2 of 4 rows)
    b = pool.fork("a", "b")
    assert b.blocks == a.blocks and b.length == 6 and pool.stats()["kv_blocks_used"] == 2
    copies = pool.prepare_write("b", 6, 7)          # b writes row 2 of the shared block 1
    assert len(copies) == 1 and copies[0][0] == a.blocks[1] and copies[0][1] == b.blocks[1] != a.blocks[1]
    assert b.blocks[0] == a.blocks[0]               # the full block stays shared
    assert pool.prepare_write("a", 6, 7) == []      # a is the sole owner of its block 1 now
    pool.close("a")
    assert pool.refcount[b.blocks[0]] == 1
    pool.close("b")
    assert pool.stats()["kv_blocks_used"] == 0


def test_a_write_at_a_block_boundary_of_a_shared_block_copies_nothing():
    pool = KVPool(max_blocks=8, block_size=4)
    pool.open("a")
    pool.prepare_write("a", 0, 8)
    b = pool.fork("a", "b")
    pool.truncate("b", 4)                           # b rewrites from row 0 of block 1: nothing to copy
    assert pool.prepare_write("b", 4, 6) == [] and len(b.blocks) == 2


def test_block_hashes_chain_the_parent():
    assert len(block_hashes(list(range(10)), 4)) == 2          # the partial third block has no hash
    x, y = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4), block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert x[0] != y[0] and x[1] != y[1]            # same second block, different prefix: different name
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == x


def test_prefix_reuse_matches_published_blocks_and_copies_before_writing():
    pool = KVPool(max_blocks=16, block_size=4)
    prompt = list(range(100, 111))                  # 11 tokens: 2 full blocks
    a = pool.open("a")
    pool.prepare_write("a", 0, len(prompt))
    assert pool.register("a", prompt) == 2
    other = [100, 101, 102, 103, 104, 105, 106, 107, 7, 7, 7, 7, 7]
    assert pool.match(other) == a.blocks[:2]
    assert pool.match([100, 101, 102, 999, 104]) == []
    b = pool.open("b")
    assert pool.adopt("b", pool.match(other)) == 8
    # b writes from position 8 (a fresh block); a published block is never written in place
    assert pool.prepare_write("b", 8, 13) == [] and b.blocks[:2] == a.blocks[:2]
    pool.truncate("b", 6)
    copies = pool.prepare_write("b", 6, 8)
    assert copies == [(a.blocks[1], b.blocks[1])] and b.blocks[1] != a.blocks[1]


def test_cached_blocks_outlive_their_session_and_are_evicted_least_recently_used_first():
    pool = KVPool(max_blocks=4, block_size=2)
    for sid, prompt in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7, 8])):
        pool.open(sid)
        pool.prepare_write(sid, 0, 4)
        pool.register(sid, prompt)
        pool.close(sid)
    assert pool.stats()["kv_blocks_cached"] == 4 and pool.stats()["kv_blocks_used"] == 0
    c = pool.open("c")                              # touch a's prefix: b's becomes the least recent
    pool.adopt("c", pool.match([1, 2, 3, 4]))
    pool.close("c")
    pool.open("d")
    pool.prepare_write("d", 0, 2)                   # takes one block: evicts the tail of b's prefix
    assert pool.evictions == 1 and len(pool.match([5, 6, 7, 8])) == 1 and len(pool.match([1, 2, 3, 4])) == 2
    assert "c" not in pool.tables


def test_the_cache_budget_bounds_unreferenced_cached_blocks():
    pool = KVPool(max_blocks=8, block_size=2, max_cached_blocks=1)
    pool.open("a")
    pool.prepare_write("a", 0, 4)
    pool.register("a", [1, 2, 3, 4])
    pool.close("a")
    stats = pool.stats()
    assert stats["kv_blocks_cached"] == 1 and stats["kv_evictions"] == 1
    assert len(pool.match([1, 2, 3, 4])) == 1       # the tail went, the parent block stays reachable


def test_sizing_from_the_budget_and_the_other_way_round():
    per_position = kv_bytes_per_position(28, 8, 128, "f16")
    assert per_position == 28 * 2 * 8 * 128 * 2 and kv_bytes_per_position(28, 8, 128, "f32") == 2 * per_position
    block = 16 * per_position
    plan = plan_kv_pool(block, 16, left_bytes=10 * block + 5, min_positions=100, default_positions=64)
    assert plan.max_blocks == 10 and plan.policy == "budget" and plan.max_bytes == 10 * block
    small = plan_kv_pool(block, 16, left_bytes=block, min_positions=100, default_positions=64)
    assert small.max_blocks == 7                    # at least one session of 100 positions: weights stream
    fixed = plan_kv_pool(block, 16, left_bytes=None, min_positions=16, default_positions=64, fixed_bytes=3 * block)
    assert fixed.max_blocks == 3 and fixed.policy == "fixed" and "3 blocks of 16" in fixed.describe()
    assert plan_kv_pool(block, 16, left_bytes=None, min_positions=16, default_positions=64).max_blocks == 4
    with pytest.raises(ValueError, match="kv_pool_bytes"):
        plan_kv_pool(block, 16, left_bytes=None, min_positions=100, default_positions=64, fixed_bytes=block)
    with pytest.raises(ValueError, match="kv_dtype"):
        kv_bytes_per_position(1, 1, 64, "q4")


def test_a_write_inside_blocks_a_session_alone_holds_needs_no_pool_work():
    """BlockTable.writable_from: after prepare_write the written blocks are the session's own; a fork, a
    publish or an adoption makes them shared or named again, and the next write copies."""
    pool = KVPool(max_blocks=8, block_size=4)
    pool.open("a")
    pool.prepare_write("a", 0, 3)
    table = pool.tables["a"]
    assert table.writable_from == 0 and 3 <= len(table.blocks) * 4          # position 3: in place
    pool.fork("a", "b")
    assert table.writable_from > 3 and pool.tables["b"].writable_from > 3     # shared: copy first
    assert pool.prepare_write("a", 3, 4) == [(0, 1)]                          # the copy-on-write still happens
    assert table.writable_from == 0
    pool.register("a", [1, 2, 3, 4])
    assert table.writable_from > 4                                            # named: a write copies it
    pool.open("c")
    pool.prepare_write("c", 0, 1)
    pool.truncate("c", 0)
    pool.adopt("c", pool.match([1, 2, 3, 4]))
    assert pool.tables["c"].writable_from > 4
