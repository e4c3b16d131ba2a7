"""The KV pool: fixed-size blocks of positions shared by every session.  Pure Python, no CUDA.

Each session has a block table (block ids in position order); a position p of a
session lives in block ``table[p // block_size]`` at row ``p % block_size``.
Blocks are taken as a session grows and given back on close, truncate and
reset.  A fork shares its parent's blocks (refcounts); the first write into a
shared block, or into one that holds a cached prefix, copies it first
(copy-on-write), so a block is only ever written by its one owner.

Prefix reuse: a full block is named by a chained hash of its tokens and its
parent block's hash, so equal hashes mean equal whole prefixes.  `register`
publishes a session's full blocks; `match` finds the longest published prefix
of a prompt.  A published block whose last user went away stays cached (its
contents still valid) on an LRU list, at most `max_cached_blocks` of them, and
is the first thing taken back when the pool has no free block left.

The pool commits blocks in chunks (`chunk_blocks`) up to `max_blocks`, calling
`on_grow(first, count)` so the executor can back them with device memory only
as sessions use them.  What the executor does with block ids — addresses,
copies — is its own affair: this module returns ids and copy pairs.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

ROOT_HASH = 0


class PoolExhausted(RuntimeError):
    """No free block: every block is in use by a session (cached blocks were already evicted)."""


def block_hashes(tokens: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """The chained hash of each full block of `tokens` (a trailing partial block has none).

    blake2b rather than hash(): the same prompt must name the same blocks in every process."""
    out = []
    for lo in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.blake2b(digest_size=8)
        h.update(parent.to_bytes(8, "little"))
        h.update(b"".join(int(t).to_bytes(4, "little") for t in tokens[lo:lo + block_size]))
        parent = int.from_bytes(h.digest(), "little")
        out.append(parent)
    return out


NOWHERE = 1 << 62      # a position past every session's capacity


@dataclass
class BlockTable:
    blocks: list[int]
    length: int = 0        # positions written (valid) so far
    # positions from here to the end of the last block lie in blocks this session alone holds and no prefix
    # names: writing there takes, copies and publishes nothing, so the caller may skip prepare_write and
    # only advance `length` (a decode step inside its block).  Forks, adoption and publishing reset it.
    writable_from: int = NOWHERE


class KVPool:
    def __init__(self, max_blocks: int, block_size: int, chunk_blocks: int | None = None,
                 max_cached_blocks: int | None = None, on_grow: Callable[[int, int], None] | None = None):
        if max_blocks <= 0 or block_size <= 0:
            raise ValueError(f"KV pool: max_blocks={max_blocks} and block_size={block_size} must be positive")
        self.max_blocks, self.block_size = max_blocks, block_size
        self.chunk_blocks = min(chunk_blocks or max_blocks, max_blocks)
        self.max_cached_blocks = max_blocks if max_cached_blocks is None else max_cached_blocks
        self.on_grow = on_grow
        self.committed_blocks = 0
        self.refcount: list[int] = []
        self._free: list[int] = []                           # committed, holding nothing
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced, holding a published prefix; LRU first
        self._hash_of: dict[int, int] = {}                   # block -> its prefix hash (published blocks)
        self._block_of: dict[int, int] = {}                  # prefix hash -> block
        self.tables: dict[Hashable, BlockTable] = {}
        self.evictions = 0

    # ---- sessions ---------------------------------------------------------------------------
    def open(self, sid: Hashable) -> BlockTable:
        assert sid not in self.tables, f"KV pool: session {sid!r} is already open"
        table = self.tables[sid] = BlockTable([])
        return table

    def close(self, sid: Hashable) -> None:
        table = self.tables.pop(sid)
        for block in reversed(table.blocks):      # the tail reaches the LRU list first, so it goes first
            self._release(block)

    def truncate(self, sid: Hashable, length: int) -> None:
        """Keep the first `length` positions; blocks past them go back to the pool."""
        table = self.tables[sid]
        assert 0 <= length <= table.length, (length, table.length)
        keep = -(-length // self.block_size)
        for block in reversed(table.blocks[keep:]):
            self._release(block)
        del table.blocks[keep:]
        table.length = length

    def fork(self, sid: Hashable, new_sid: Hashable) -> BlockTable:
        """A new session sharing every block of `sid` (copy-on-write)."""
        parent = self.tables[sid]
        table = self.open(new_sid)
        table.blocks, table.length = list(parent.blocks), parent.length
        for block in table.blocks:
            self.refcount[block] += 1
        parent.writable_from = NOWHERE          # its blocks are shared now
        return table

    def blocks_needed(self, sid: Hashable, start: int, end: int) -> int:
        """New blocks prepare_write(sid, start, end) would take (appended, or replacing shared ones)."""
        table = self.tables[sid]
        bs = self.block_size
        first, last = start // bs, -(-end // bs)
        replace = sum(1 for i in range(first, min(last, len(table.blocks)))
                      if self.refcount[table.blocks[i]] > 1 or table.blocks[i] in self._hash_of)
        return replace + max(last - len(table.blocks), 0)

    def prepare_write(self, sid: Hashable, start: int, end: int) -> list[tuple[int, int]]:
        """Make positions [start, end) writable for `sid` and mark [0, end) valid.

        Takes new blocks as needed; a block in the range that is shared or published is
        replaced by a fresh one.  Returns (source, destination) block copies the caller must
        make before the write (rows below `start` of a replaced block hold earlier positions).
        Raises PoolExhausted (changing nothing) when the pool cannot supply the blocks."""
        table = self.tables[sid]
        assert 0 <= start <= table.length and start <= end, (start, end, table.length)
        bs = self.block_size
        first, last = start // bs, -(-end // bs)        # blocks [first, last) are written
        replace = [i for i in range(first, min(last, len(table.blocks)))
                   if self.refcount[table.blocks[i]] > 1 or table.blocks[i] in self._hash_of]
        needed = len(replace) + max(last - len(table.blocks), 0)
        if needed > self.available_blocks():
            raise PoolExhausted(f"KV pool: {needed} block(s) of {bs} positions needed, "
                                f"{self.available_blocks()} of {self.max_blocks} available")
        copies = []
        for i in replace:
            old, new = table.blocks[i], self._take()
            if i * bs < start:                          # earlier rows of this block are still needed
                copies.append((old, new))
            table.blocks[i] = new
            self._release(old)
        while len(table.blocks) < last:
            table.blocks.append(self._take())
        table.length = max(table.length, end)
        table.writable_from = first * bs        # blocks first.. are this session's alone, unnamed
        return copies

    # ---- prefix reuse -------------------------------------------------------------------------
    def register(self, sid: Hashable, tokens: Sequence[int]) -> int:
        """Publish the full blocks of `sid` whose positions hold `tokens` (its first len(tokens)
        positions); returns how many blocks are published under their hash now."""
        table = self.tables[sid]
        assert len(tokens) <= table.length, (len(tokens), table.length)
        table.writable_from = NOWHERE           # some of its blocks may be named now
        published = 0
        for block, h in zip(table.blocks, block_hashes(tokens, self.block_size)):
            owner = self._block_of.get(h)
            if owner is None and block not in self._hash_of:
                self._block_of[h], self._hash_of[block] = block, h
                owner = block
            published += owner is not None
        return published

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Blocks holding the longest published prefix of `tokens`, in full blocks."""
        blocks = []
        for h in block_hashes(tokens, self.block_size):
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def adopt(self, sid: Hashable, blocks: list[int]) -> int:
        """Give an empty session the matched `blocks` (shared); returns the positions they hold."""
        table = self.tables[sid]
        assert not table.blocks and table.length == 0, "adopt needs an empty session"
        for block in blocks:
            if self.refcount[block] == 0:
                del self._cached[block]
            self.refcount[block] += 1
        table.blocks, table.length = list(blocks), len(blocks) * self.block_size
        table.writable_from = NOWHERE           # shared and named blocks
        return table.length

    # ---- blocks ---------------------------------------------------------------------------------
    def available_blocks(self) -> int:
        """Blocks a write could take now: free, not yet committed, or cached (evictable)."""
        return len(self._free) + (self.max_blocks - self.committed_blocks) + len(self._cached)

    def _take(self) -> int:
        if not self._free and self.committed_blocks < self.max_blocks:
            count = min(self.chunk_blocks, self.max_blocks - self.committed_blocks)
            first = self.committed_blocks
            if self.on_grow is not None:
                self.on_grow(first, count)
            self.committed_blocks += count
            self.refcount.extend([0] * count)
            self._free.extend(range(first + count - 1, first - 1, -1))   # lowest id taken first
        if not self._free:
            if not self._cached:
                raise PoolExhausted(f"KV pool: all {self.max_blocks} blocks are in use")
            self._evict()
        block = self._free.pop()
        self.refcount[block] = 1
        return block

    def _evict(self) -> None:
        block, _ = self._cached.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        self._free.append(block)
        self.evictions += 1

    def _release(self, block: int) -> None:
        self.refcount[block] -= 1
        assert self.refcount[block] >= 0, f"block {block} released twice"
        if self.refcount[block]:
            return
        if block in self._hash_of:
            self._cached[block] = None
            while len(self._cached) > self.max_cached_blocks:
                self._evict()
        else:
            self._free.append(block)

    def stats(self) -> dict:
        used = self.committed_blocks - len(self._free) - len(self._cached)
        return {"kv_block_size": self.block_size, "kv_blocks_max": self.max_blocks,
                "kv_blocks_committed": self.committed_blocks, "kv_blocks_used": used,
                "kv_blocks_cached": len(self._cached), "kv_blocks_free": self.max_blocks - used - len(self._cached),
                "kv_evictions": self.evictions}


# ---- sizing ----------------------------------------------------------------------------------------
KV_DTYPE_BYTES = {"f16": 2, "f32": 4}


def kv_bytes_per_position(n_layers: int, n_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """K and V of every layer for one position."""
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"kv_dtype {kv_dtype!r}: expected one of {', '.join(KV_DTYPE_BYTES)}")
    return n_layers * 2 * n_kv_heads * head_dim * KV_DTYPE_BYTES[kv_dtype]


@dataclass(frozen=True)
class KVPoolPlan:
    """How many blocks the pool may commit, and why."""
    block_size: int
    block_bytes: int
    max_blocks: int
    policy: str            # "budget" (what the VRAM budget leaves), "fixed" (kv_pool_bytes), "default"

    @property
    def max_bytes(self) -> int:
        return self.max_blocks * self.block_bytes

    @property
    def max_positions(self) -> int:
        return self.max_blocks * self.block_size

    def describe(self) -> str:
        return (f"KV pool: up to {self.max_blocks} blocks of {self.block_size} positions "
                f"({self.max_bytes / 2**20:.1f} MiB, {self.max_positions} positions; {self.policy}), "
                f"committed as sessions grow")


def plan_kv_pool(block_bytes: int, block_size: int, *, left_bytes: int | None, min_positions: int,
                 default_positions: int, fixed_bytes: int | None = None) -> KVPoolPlan:
    """The pool's size: `fixed_bytes` when given; else what the budget leaves after weights and
    activations (`left_bytes`), at least `min_positions` (one full-length session, the caller
    streams weights to make room); with no budget (`left_bytes` None) `default_positions`."""
    need = -(-min_positions // block_size)
    if fixed_bytes is not None:
        blocks, policy = fixed_bytes // block_bytes, "fixed"
        if blocks < need:
            raise ValueError(f"kv_pool_bytes={fixed_bytes}: {blocks} blocks of {block_bytes} B hold fewer than "
                             f"{min_positions} positions (one session of max_seq_len plus the scratch block)")
    elif left_bytes is None:
        blocks, policy = max(-(-default_positions // block_size), need), "default"
    else:
        blocks, policy = max(left_bytes // block_bytes, need), "budget"
    return KVPoolPlan(block_size, block_bytes, blocks, policy)
