"""What crosses between host and device at a gpu step's edges: the per-token scalars staged in, and the
step's outputs copied out with the host's one wait for them.

In: for a step of n tokens the params block is kvbase int64[n] | ids int32[n] | pos int32[n]
(scheduler.ops.PARAMS_BYTES_PER_TOKEN = 16 bytes a token), staged by the host in pinned memory, so a
step copies exactly its own 16 n bytes (a token tree's step, and the step after it, 16 bytes a row more:
its mask, stage_tree) and the kernels of a launch list built for n tokens read fixed
addresses (one captured graph per batch bucket serves every step).  The mixed modes stage theirs too.

Out: a step's outputs are the logits of its wanted rows, or each row's next token (argmax_split, or a
draw: sampler.py) as 4 bytes a row.  Either way they are copied into pinned host buffers on the compute
stream, and an event is recorded after that copy.  The host waits on the event, not on the stream, so
work queued behind the outputs (the window's primes of the next step) goes on through the host's turn.
Inside a capture the event is an external record node, so every replay records it.
"""
from __future__ import annotations

import numpy as np

from kestrel_stream.cuda import driver
from kestrel_stream.run.device.budget import ARGMAX_SPLITS
from scheduler.ops import PARAMS_BYTES_PER_TOKEN

TREE_BYTES_PER_TOKEN = 16


class StepParams:
    def __init__(self, arena, max_tokens: int):
        self.max_tokens = max_tokens
        self.device = arena.array((PARAMS_BYTES_PER_TOKEN * max_tokens,), np.uint8)
        self.host = driver.PinnedBuffer(PARAMS_BYTES_PER_TOKEN * max_tokens)
        self._views: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        # token trees' masks, TREE_BYTES_PER_TOKEN a row (kernels_ptx/kv_cache.cuh TreeRow): zero for plain
        # rows, uploaded only by a step with a tree and by the step after it (back to zeros)
        self.tree = arena.array((TREE_BYTES_PER_TOKEN * max_tokens // 4,), np.int32)
        self.tree_host = driver.PinnedBuffer(TREE_BYTES_PER_TOKEN * max_tokens)
        self.tree_view = self.tree_host.view(np.int32, (max_tokens, 4))
        driver.h2d_sync(self.tree.ptr, np.zeros(4 * max_tokens, np.int32))
        self.tree_rows = 0          # rows of the device block that may not be zero

    def pointers(self, tokens: int) -> tuple[int, int, int]:
        """Device addresses of kvbase, ids and pos for a step of `tokens` tokens."""
        base = self.device.ptr
        return base, base + 8 * tokens, base + 12 * tokens

    def views(self, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The pinned kvbase, ids and pos arrays of a step of `tokens` tokens."""
        if tokens not in self._views:
            self._views[tokens] = (self.host.view(np.int64, (tokens,), 0), self.host.view(np.int32, (tokens,), 8 * tokens),
                                   self.host.view(np.int32, (tokens,), 12 * tokens))
        return self._views[tokens]

    def stage(self, rows, tokens: int, padding: tuple[int, int, int] = (0, 0, 0)) -> None:
        """rows: (kvbase, token id, position) each, then `padding` up to `tokens` rows."""
        kvbase, ids, pos = self.views(tokens)
        for i, (base, token, position) in enumerate(rows):
            kvbase[i], ids[i], pos[i] = base, token, position
        for i in range(len(rows), tokens):
            kvbase[i], ids[i], pos[i] = padding

    def stage_session(self, kvbase: int, ids: np.ndarray, start: int, tokens: int,
                      padding: tuple[int, int, int] = (0, 0, 0)) -> None:
        """One session's ids at positions start.. as the last len(ids) of `tokens` rows, `padding` before them."""
        kvbases, token_ids, positions = self.views(tokens)
        first = tokens - len(ids)
        kvbases[:first], token_ids[:first], positions[:first] = padding
        kvbases[first:], token_ids[first:], positions[first:] = kvbase, ids, np.arange(start, start + len(ids))

    def stage_tree(self, fields, stream) -> int:
        """fields: (skip, span, bits) of the step's first rows (token_tree.step_tree_fields), or None: every
        row plain.  Uploads the rows that change, on `stream`; returns the bytes copied."""
        n = 0 if fields is None else len(fields[0])
        rows = max(n, self.tree_rows)
        if rows == 0:
            return 0
        view = self.tree_view
        view[:rows] = 0
        if n:
            skip, span, bits = fields
            view[:n, 0], view[:n, 1] = skip, span
            view[:n, 2:] = np.ascontiguousarray(bits, np.uint64).view(np.int32).reshape(n, 2)
        driver.h2d_async(self.tree.ptr, self.tree_host, TREE_BYTES_PER_TOKEN * rows, stream)
        self.tree_rows = n
        return TREE_BYTES_PER_TOKEN * rows

    def upload(self, tokens: int, stream) -> int:
        """The step's block up, on `stream`; returns the bytes copied."""
        nbytes = PARAMS_BYTES_PER_TOKEN * tokens
        driver.h2d_async(self.device.ptr, self.host, nbytes, stream)
        return nbytes

    def free(self) -> None:
        self.host.free()
        self.tree_host.free()


class TokenOutputs:
    """Each logits row's token taken on the device (argmax_split, or a draw) and its 4 bytes out: the buffers
    (a mixed step's greedy steps use these alone; gpu mode's StepOutputs adds the logits' way back)."""

    def __init__(self, arena, max_tokens: int):
        # argmax_split's partials (a value and an index per split and row) and its last-split tickets
        self.argmax_splits = ARGMAX_SPLITS
        self.argmax_partials = arena.array((2 * max_tokens * ARGMAX_SPLITS,), np.float32)
        self.argmax_counters = arena.array((max_tokens,), np.uint32)
        self.argmax_out = arena.array((max_tokens,), np.int32)     # each row's next token, argmax or drawn
        driver.h2d_sync(self.argmax_counters.ptr, np.zeros(max_tokens, np.uint32))
        self.host_tokens = driver.PinnedBuffer(max_tokens * 4)
        self.tokens_view = self.host_tokens.view(np.int32, (max_tokens,))

    def free(self) -> None:
        self.host_tokens.free()


class StepOutputs(TokenOutputs):
    def __init__(self, arena, vocab_size: int, max_tokens: int, logits_rows: int, logits_ptr: int):
        super().__init__(arena, max_tokens)
        self.vocab_size, self.logits_ptr = vocab_size, logits_ptr
        self.host_logits = driver.PinnedBuffer(logits_rows * vocab_size * 4)
        self.logits_view = self.host_logits.view(np.float32, (logits_rows, vocab_size))
        self.ready = driver.Event(name="step outputs", external=True)

    def enqueue_logits(self, rows: int, stream: driver.Stream, first_row: int = 0) -> None:
        """`rows` logits rows from `first_row` on out (into the pinned buffer's first rows), then the ready
        event."""
        if rows:
            driver.d2h_async(self.host_logits, self.logits_ptr + first_row * self.vocab_size * 4,
                             rows * self.vocab_size * 4, stream)
        self.ready.record(stream)

    def enqueue_tokens(self, pick, tokens: int, stream: driver.Stream) -> None:
        """pick(stream) enqueues the kernels writing each row's token into argmax_out; then those 4 bytes a
        row out, then the ready event."""
        pick(stream)
        driver.d2h_async(self.host_tokens, self.argmax_out.ptr, tokens * 4, stream)
        self.ready.record(stream)

    def wait(self, stream: driver.Stream, whole_stream: bool = False) -> None:
        """The step's one host wait: for its outputs, or (whole_stream: KESTREL_PROF's timing events come
        after them) for everything on the stream."""
        (stream if whole_stream else self.ready).synchronize()

    def free(self) -> None:
        self.host_logits.free()
        super().free()
