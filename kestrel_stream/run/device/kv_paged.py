"""The device's KV cache: scheduler.kv_pool's blocks backed by device memory, and the block tables.

Blocks are [block_size, L, 2 (k|v), n_kv, D] of f16 (default) or float32, L the layers whose
attention runs on the device (every layer in gpu mode, the first N in layers=N).
Device memory for them is allocated in chunks as the pool commits blocks, so a
load reserves none; the pool's size limit comes from the VRAM budget
(KVPoolPlan).  Every session owns one row of a device table of block
addresses, [table rows, blocks per max_seq_len] uint64, at a fixed address
(the kernels read it: kernels_ptx/kv_cache.cuh); the host keeps a pinned
mirror and uploads the entries that changed before the step that reads them,
so a captured graph serves every step whatever blocks sessions hold.

A token's step parameter `kvbase` is its session's table row offset (in
entries), which is what the paged kernels take as `table_row`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kestrel_stream.cuda import driver
from kestrel_stream.errors import CapacityError
from scheduler.kv_pool import KVPool, KVPoolPlan, PoolExhausted, kv_bytes_per_position

CHUNK_BYTES = 64 << 20        # device memory committed at a time as the pool grows


@dataclass
class PagedKV:
    """One session's handle: its table row and its key in the pool."""
    row: int
    capacity: int            # max_seq_len of the session
    base_elements: int       # row * table width: the kernels' table_row for this session's tokens


class PagedKVCache:
    def __init__(self, config, plan: KVPoolPlan, kv_dtype: str, max_sessions: int, max_seq_len: int,
                 arena, stream, layers: int | None = None):
        """layers: how many of the model's layers (the first ones) the blocks hold; None: all."""
        self.kv_dtype, self.plan, self.stream = kv_dtype, plan, stream
        self.block_size, self.block_bytes = plan.block_size, plan.block_bytes
        assert self.block_size & (self.block_size - 1) == 0, "block_size is a power of two (kernels shift)"
        assert plan.block_bytes == self.block_size * kv_bytes_per_position(
            layers or config.num_hidden_layers, config.num_key_value_heads, config.head_dim, kv_dtype)
        self.block_shift = self.block_size.bit_length() - 1
        self.width = -(-max_seq_len // self.block_size)          # table entries per session
        self.rows = max_sessions + 1                            # + the scratch session of padded slots
        self.table = arena.array((self.rows * self.width,), np.uint64)
        self.mirror_buffer = driver.PinnedBuffer(self.rows * self.width * 8)
        self.mirror = self.mirror_buffer.view(np.uint64, (self.rows, self.width))
        self.mirror[:] = 0
        driver.h2d_sync(self.table.ptr, self.mirror.reshape(-1))
        self.addresses = np.zeros(0, np.uint64)                 # block id -> device address
        self.chunks: list = []
        chunk_blocks = max(CHUNK_BYTES // self.block_bytes, 1)
        self.pool = KVPool(plan.max_blocks, self.block_size, chunk_blocks=chunk_blocks, on_grow=self._grow)
        self._free_rows = list(range(self.rows - 1, -1, -1))
        self._dirty: dict[int, tuple[int, int]] = {}            # row -> [lo, hi) entries to upload

    @property
    def table_ptr(self) -> int:
        return self.table.ptr

    # ---- sessions ------------------------------------------------------------------------------
    def open(self, max_seq_len: int) -> PagedKV:
        kv = self._new_row(max_seq_len)
        self.pool.open(kv.row)
        return kv

    def _new_row(self, max_seq_len: int) -> PagedKV:
        if max_seq_len > self.width * self.block_size:
            raise CapacityError(f"KV: max_seq_len={max_seq_len} exceeds the executor's {self.width * self.block_size}")
        if not self._free_rows:
            raise CapacityError(f"KV: all {self.rows - 1} session tables are in use (raise --max-sessions)")
        row = self._free_rows.pop()
        return PagedKV(row, max_seq_len, row * self.width)

    def close(self, kv: PagedKV) -> None:
        self.pool.close(kv.row)
        self._free_rows.append(kv.row)

    def length(self, kv: PagedKV) -> int:
        return self.pool.tables[kv.row].length

    def check_room(self, writes) -> None:
        """CapacityError, before anything changes, unless the pool holds every write's new blocks at once
        (writes: (kv, start, end) per session of a step): a step never runs out of blocks half-way."""
        need = 0
        for kv, start, end in writes:
            table = self.pool.tables[kv.row]
            if not (table.writable_from <= start and end <= len(table.blocks) << self.block_shift):
                need += self.pool.blocks_needed(kv.row, start, end)    # past the blocks it alone holds
        if not need:
            return
        available = self.pool.available_blocks()
        if need > available:
            raise CapacityError(f"KV pool: the step needs {need} more block(s) of {self.block_size} positions "
                                f"for {len(writes)} session(s), {available} of {self.pool.max_blocks} are "
                                f"available ({self.plan.describe()}); close sessions, or raise --vram-budget "
                                "or lower --max-seq-len")

    def prepare(self, kv: PagedKV, start: int, end: int) -> None:
        """Blocks for positions [start, end) of `kv`, copied first where shared; CapacityError (nothing
        changed) when the pool is out of blocks."""
        table = self.pool.tables[kv.row]
        if table.writable_from <= start and end <= len(table.blocks) << self.block_shift:
            table.length = max(table.length, end)    # inside blocks it alone holds: BlockTable.writable_from
            return
        blocks = table.blocks
        first = start // self.block_size
        written = blocks[first:]         # prepare_write replaces blocks from `first` on in place, or appends
        try:
            copies = self.pool.prepare_write(kv.row, start, end)
        except PoolExhausted as e:
            raise CapacityError(f"{e} ({self.plan.describe()})") from None
        for src, dst in copies:
            driver.d2d_async(int(self.addresses[dst]), int(self.addresses[src]), self.block_bytes, self.stream)
        if blocks[first:] != written:    # most decode steps write inside a block they own: the table holds
            self._write_row(kv.row)      # (skipping the row's numpy compare saves host time per session)

    def truncate(self, kv: PagedKV, length: int) -> None:
        self.pool.truncate(kv.row, min(length, self.length(kv)))
        self._write_row(kv.row)

    def move(self, kv: PagedKV, moves: list[tuple[int, int]]) -> None:
        """Copy position src's row (every layer's K and V) to position dst for each (src, dst), in order, on
        the stream: a token tree's accepted path (run/token_tree.py).  Both lie in blocks the session wrote
        this step, so it alone holds them."""
        blocks, row_bytes = self.pool.tables[kv.row].blocks, self.block_bytes // self.block_size
        mask = self.block_size - 1

        def address(p: int) -> int:
            return int(self.addresses[blocks[p >> self.block_shift]]) + (p & mask) * row_bytes
        for src, dst in moves:
            driver.d2d_async(address(dst), address(src), row_bytes, self.stream)

    def fork(self, kv: PagedKV, length: int, capacity: int) -> PagedKV:
        child = self._new_row(capacity)
        self.pool.fork(kv.row, child.row)
        self.pool.truncate(child.row, min(length, self.length(kv)))
        self._write_row(child.row)
        return child

    def flush(self) -> None:
        """Upload changed table entries (stream-ordered before the step that reads them)."""
        for row, (lo, hi) in self._dirty.items():
            driver.h2d_async(self.table.ptr + 8 * (row * self.width + lo), self.mirror[row, lo:hi],
                             8 * (hi - lo), self.stream)
        self._dirty.clear()

    def _write_row(self, row: int) -> None:
        blocks = self.pool.tables[row].blocks
        entries = self.addresses[blocks] if blocks else np.zeros(0, np.uint64)
        old = self.mirror[row, :len(entries)]
        changed = np.flatnonzero(old != entries)
        if len(changed):
            lo, hi = int(changed[0]), int(changed[-1]) + 1
            old[lo:hi] = entries[lo:hi]
            prev = self._dirty.get(row)
            self._dirty[row] = (lo, hi) if prev is None else (min(prev[0], lo), max(prev[1], hi))

    def _grow(self, first: int, count: int) -> None:
        chunk = driver.Arena(count * self.block_bytes)
        base = chunk.alloc(count * self.block_bytes)
        self.chunks.append(chunk)
        self.addresses = np.concatenate([self.addresses, base + self.block_bytes * np.arange(count, dtype=np.uint64)])

    # ---- reporting -----------------------------------------------------------------------------
    def stats(self) -> dict:
        out = self.pool.stats()
        out.update(kv_dtype=self.kv_dtype, kv_block_bytes=self.block_bytes,
                   kv_bytes_committed=self.pool.committed_blocks * self.block_bytes,
                   kv_bytes_used=out["kv_blocks_used"] * self.block_bytes, kv_bytes_max=self.plan.max_bytes,
                   kv_table_bytes=self.table.nbytes)
        return out

    def release(self) -> None:
        for chunk in self.chunks:
            chunk.release()
        self.chunks.clear()
        self.mirror_buffer.free()
