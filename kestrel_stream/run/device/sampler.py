"""Sampled decode steps on the device (gpu mode's, and a mixed step's whose lm_head ran there):
kernels_ptx/sample.cu after lm_head, 4 bytes back per token.

Each row's sampling state (8 words: temperature, top_k, top_p, min_p, seed,
step; see sample.cu) sits in device memory and is uploaded from a pinned
buffer inside the step's graph, so the graph is captured once per batch
bucket and every replay draws with the state written just before it.

With 0 < top_k <= SAMPLE_CAP the draw is two launches, as argmax_split
spreads the vocabulary over blocks: sample_candidates keeps each slice's
top_k logits, sample_finish filters and draws over those few; any other
top_k (and ties the slices left out) samples the whole row in sample_finish.
"""
from __future__ import annotations

import numpy as np

from kestrel_stream.cuda import driver
from kestrel_stream.cuda.kernels import Launch
from kestrel_stream.run.device.sample_state import GREEDY_STATE, STATE_WORDS, pack_state  # noqa: F401  (importable here too)

SAMPLE_CAP = 64              # sample.cu: the largest top_k drawn from per-slice candidates
SAMPLE_MAX_SPLITS = 64       # sample.cu: the most vocabulary slices (sample_finish's shared memory)


def candidate_splits(vocab_size: int) -> int:
    """Vocabulary slices for sample_candidates: about 256 logits per thread block at the least."""
    return max(1, min(SAMPLE_MAX_SPLITS, -(-vocab_size // 256)))


class LaunchSequence:
    """Launches enqueued one after another, used where one Launch is (a graph captures them all)."""

    def __init__(self, *launches: Launch):
        self.launches = launches

    def enqueue(self, stream) -> None:
        for launch in self.launches:
            launch.enqueue(stream)


class DeviceSampler:
    def __init__(self, executor, programmatic=None):
        """executor: what owns the step's arena, logits and token outputs (gpu mode's WholeStep, a mixed step's
        DeviceBackend); programmatic(tokens): whether the draw's launches go programmatic after the step's last
        kernel (None: never)."""
        self.x = executor
        self.programmatic = programmatic or (lambda tokens: False)
        T = executor.max_tokens
        self.state = executor.arena.array((STATE_WORDS * T,), np.uint32)
        self.host_state = driver.PinnedBuffer(STATE_WORDS * T * 4)
        self.host_state_view = self.host_state.view(np.uint32, (T, STATE_WORDS))
        self.splits = candidate_splits(executor.config.vocab_size)
        # a sampled step has a logits row per token, so at most logits_rows tokens draw at once
        self.candidates = executor.arena.array((executor.logits_rows * self.splits * (2 * SAMPLE_CAP + 4),), np.uint32)
        self._launches: dict[int, LaunchSequence] = {}     # token count -> the two sampling launches

    def stage(self, states: list[np.ndarray]) -> None:
        """The rows' states; the rows after them up to the next power of two (a graph bucket's padding) greedy:
        their argmax, unused."""
        n = len(states)
        self.host_state_view[:n] = states
        self.host_state_view[n:1 << max(n - 1, 0).bit_length()] = GREEDY_STATE

    def enqueue(self, tokens: int, stream) -> None:
        """State H2D, then the sampling kernel writing each row's token into argmax_out."""
        driver.h2d_async(self.state.ptr, self.host_state, tokens * STATE_WORDS * 4, stream)
        self._launch(tokens).enqueue(stream)

    def _launch(self, tokens: int) -> LaunchSequence:
        x = self.x
        if tokens not in self._launches:
            V, programmatic = x.config.vocab_size, self.programmatic(tokens)
            first = x.kernels.launch("sample_candidates", (self.splits, tokens), (256,), "pipp",
                                     [x.logits.ptr, V, self.state.ptr, self.candidates.ptr])
            finish = x.kernels.launch("sample_finish", (tokens,), (1024,), "pippip",
                                      [x.logits.ptr, V, self.state.ptr, self.candidates.ptr, self.splits,
                                       x.token_outputs.argmax_out.ptr])
            for launch in (first, finish):
                launch.label(op="sample")
                launch.programmatic = programmatic
            self._launches[tokens] = LaunchSequence(first, finish)
        return self._launches[tokens]

    def close(self) -> None:
        self.host_state.free()
