"""Sampled decode steps in `gpu` mode: kernels_ptx/sample.cu after lm_head, 4 bytes back per token.

Each row's sampling state (8 words: temperature, top_k, top_p, min_p, seed,
step; see sample.cu) sits in device memory and is uploaded from a pinned
buffer inside the step's graph, so the graph is captured once per batch
bucket and every replay draws with the state written just before it.
"""
from __future__ import annotations

import numpy as np

from kestrel_stream.cuda import driver
from kestrel_stream.cuda.kernels import Launch

STATE_WORDS = 8


def pack_state(params, seed: int, step: int) -> np.ndarray:
    """One row's state words, as sample.cu reads them."""
    words = np.zeros(STATE_WORDS, np.uint32)
    words[[0, 2, 3]] = np.array([params.temperature, min(params.top_p, 1.0), params.min_p], np.float32).view(np.uint32)
    words[1] = max(params.top_k, 0)
    words[4], words[5] = seed & 0xFFFFFFFF, seed >> 32
    words[6], words[7] = step & 0xFFFFFFFF, step >> 32
    return words


class DeviceSampler:
    def __init__(self, executor):
        self.x = executor
        T = executor.max_tokens
        self.state = executor.arena.array((STATE_WORDS * T,), np.uint32)
        self.host_state = driver.PinnedBuffer(STATE_WORDS * T * 4)
        self.host_state_view = self.host_state.view(np.uint32, (T, STATE_WORDS))

    def stage(self, states: list[np.ndarray]) -> None:
        self.host_state_view[:len(states)] = states

    def enqueue(self, tokens: int, stream) -> None:
        """State H2D, then the sampling kernel writing each row's token into argmax_out."""
        driver.h2d_async(self.state.ptr, self.host_state, tokens * STATE_WORDS * 4, stream)
        self._launch(tokens).enqueue(stream)

    def _launch(self, tokens: int) -> Launch:
        x = self.x
        key = ("sample", tokens)
        if key not in x._launches:
            launch = x.kernels.launch("sample_rows", (tokens,), (1024,), "pipp",
                                      [x.logits.ptr, x.config.vocab_size, self.state.ptr, x.argmax_out.ptr])
            launch.label(op="sample")
            launch.programmatic = x.step_launches(tokens)[-1].programmatic
            x._launches[key] = launch
        return x._launches[key]

    def close(self) -> None:
        self.host_state.free()
