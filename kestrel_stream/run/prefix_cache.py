"""Prompt-prefix reuse across sessions: a later prompt that starts with an earlier one's full blocks
starts from a copy of that KV instead of computing it again (llama-server's cache_prompt, vLLM's
prefix caching).

After a fresh session's prefill, the cache keeps a fork of its KV cut to the prompt's last full
block (an "entry": in gpu mode the fork shares the pool's blocks, elsewhere it is a copy of that
many positions) and names every full block by scheduler.kv_pool.block_hashes, a chain over the
tokens, so one hash names a whole prefix.  A new prompt walks its own block hashes to the longest
cached prefix, leaving at least its last token to compute (its logits are the answer), and the
session adopts a fork of that entry.  Entries count against `budget_positions`; the least recently
used go first.

Only the rows of the prompt past the reused prefix get logits, so callers use it where only the
last row is wanted (the daemon's generate and its prefill with want=last/token/topk).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from kestrel_stream.errors import CapacityError
from scheduler.kv_pool import block_hashes

DEFAULT_BLOCK_SIZE = 16
MAX_ENTRIES = 32       # each entry holds a cache handle (in gpu mode a block-table row, see --max-sessions)


def alloc_kv_making_room(executor, cache: "PrefixCache | None", length: int):
    """A cache for a new session; where the KV (block-table rows, pool blocks) is full, the prefix cache's
    entries give way, least recently used first: a live session outranks a cached prompt."""
    while True:
        try:
            return executor.alloc_kv(length)
        except CapacityError:
            if cache is None or not cache.evict_oldest():
                raise


@dataclass
class Entry:
    kv: object                 # the executor's cache handle, holding `length` positions
    length: int
    hashes: list[int] = field(default_factory=list)


class PrefixCache:
    def __init__(self, engine, budget_positions: int, block_size: int = DEFAULT_BLOCK_SIZE):
        if budget_positions < 0 or block_size <= 0:
            raise ValueError(f"prefix cache: budget_positions={budget_positions} must be >= 0 and "
                             f"block_size={block_size} > 0")
        self.engine, self.budget_positions, self.block_size = engine, budget_positions, block_size
        self.entries: OrderedDict[int, Entry] = OrderedDict()    # id(entry) -> entry, least recent first
        self.by_hash: dict[int, tuple[Entry, int]] = {}         # block hash -> (entry, positions it names)
        self.cached_positions = 0
        self.stats = {"prefix_hits": 0, "prefix_misses": 0, "prefix_reused_tokens": 0, "prefix_evictions": 0,
                      "prefix_store_failures": 0}

    def prefill_last(self, session, ids) -> np.ndarray:
        """session.prefill(ids) for a caller that needs only the last row: logits [m, V] of the
        prompt's last m tokens (m >= 1), the cached prefix before them adopted instead of computed."""
        tokens = [int(t) for t in np.asarray(self.engine.check_tokens(ids, f"session {session.id} prefill"))]
        session.check_room(len(tokens))
        reused = self.adopt(session, tokens)
        logits = session.prefill(tokens[reused:])
        self.store(session, tokens)
        return logits

    def adopt(self, session, tokens) -> int:
        """Start a fresh session (position 0) from the longest cached prefix of `tokens`, leaving at
        least the last token to compute; returns the positions adopted (0: none, or not fresh)."""
        tokens = [int(t) for t in tokens]
        if session.position != 0 or self.budget_positions == 0 or not tokens:
            return 0
        best = None
        for h in block_hashes(tokens[:-1], self.block_size):      # the last token is always computed
            hit = self.by_hash.get(h)
            if hit is None:
                break
            best = hit
        if best is None:
            self.stats["prefix_misses"] += 1
            return 0
        entry, length = best
        self.entries.move_to_end(id(entry))
        session.adopt(entry.kv, length, tokens[:length])
        self.stats["prefix_hits"] += 1
        self.stats["prefix_reused_tokens"] += length
        return length

    def prompt_hashes(self, tokens) -> list[int]:
        """The block hashes adopt() walks for the prompt `tokens` (its last token is always computed)."""
        return block_hashes([int(t) for t in tokens[:-1]], self.block_size)

    def cached_length(self, hashes: list[int]) -> int:
        """Positions adopt() would take for a prompt of these prompt_hashes(), changing nothing (no counters, no
        recency): a router's question, asked from another thread than the one that adopts and stores (each
        lookup is one dict read)."""
        length = 0
        for h in hashes:
            hit = self.by_hash.get(h)
            if hit is None:
                break
            length = hit[1]
        return length

    def store(self, session, tokens) -> None:
        """After `session` prefilled the prompt `tokens` from position 0: keep a fork of its full
        blocks as an entry (unless one names them already or it exceeds the budget)."""
        tokens = [int(t) for t in tokens]
        if self.budget_positions == 0 or session.tokens[:len(tokens)] != tokens:
            return
        hashes = block_hashes(tokens, self.block_size)
        if not hashes or hashes[-1] in self.by_hash:
            return
        length = len(hashes) * self.block_size
        if length > self.budget_positions:
            return
        while len(self.entries) >= MAX_ENTRIES:
            self._evict(next(iter(self.entries.values())))
        try:
            kv = self.engine.fork_kv_of(session, length)
        except CapacityError:           # no table row or memory left for an entry: serve without caching
            self.stats["prefix_store_failures"] += 1
            return
        entry = Entry(kv, length, hashes)
        self.entries[id(entry)] = entry
        self.cached_positions += length
        for i, h in enumerate(hashes):
            self.by_hash.setdefault(h, (entry, (i + 1) * self.block_size))
        while self.cached_positions > self.budget_positions:
            self._evict(next(iter(self.entries.values())))

    def evict_oldest(self) -> bool:
        """Give the least recently used entry's cache back (a new session needs its room); False when empty."""
        if not self.entries:
            return False
        self._evict(next(iter(self.entries.values())))
        return True

    def _evict(self, entry: Entry) -> None:
        del self.entries[id(entry)]
        self.cached_positions -= entry.length
        for i, h in enumerate(entry.hashes):     # a prefix other entries share moves to one of them
            if self.by_hash.get(h, (None,))[0] is entry:
                heir = next((e for e in self.entries.values() if h in e.hashes), None)
                if heir is None:
                    del self.by_hash[h]
                else:
                    self.by_hash[h] = (heir, (i + 1) * self.block_size)
        self.engine.free_kv_of(entry.kv)
        self.stats["prefix_evictions"] += 1

    def clear(self) -> None:
        while self.entries:
            self._evict(next(iter(self.entries.values())))
