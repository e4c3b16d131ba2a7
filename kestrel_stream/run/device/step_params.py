"""A device step's per-token scalars: staged by the host in pinned memory, one copy up per step.

For a step of n tokens the block is kvbase int64[n] | ids int32[n] | pos int32[n]
(scheduler.ops.PARAMS_BYTES_PER_TOKEN = 16 bytes a token), so a step copies
exactly its own 16 n bytes and the kernels of a launch list built for n tokens
read fixed addresses (one captured graph per batch bucket serves every step).
"""
from __future__ import annotations

import numpy as np

from scheduler.ops import PARAMS_BYTES_PER_TOKEN
from kestrel_stream.cuda import driver


class StepParams:
    def __init__(self, arena, max_tokens: int):
        self.max_tokens = max_tokens
        self.device = arena.array((PARAMS_BYTES_PER_TOKEN * max_tokens,), np.uint8)
        self.host = driver.PinnedBuffer(PARAMS_BYTES_PER_TOKEN * max_tokens)
        self._views: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

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

    def upload(self, tokens: int, stream) -> int:
        """The step's block up, on `stream`; returns the bytes copied."""
        nbytes = PARAMS_BYTES_PER_TOKEN * tokens
        driver.h2d_async(self.device.ptr, self.host, nbytes, stream)
        return nbytes

    def free(self) -> None:
        self.host.free()
