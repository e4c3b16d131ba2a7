"""What the executor asks of the backend that runs a mode's steps: the one contract HostBackend (cpu),
WholeStep (gpu) and MixedSteps (gated, layers=N) fill.

A step is a batch of (kv, token ids [n_i], start position) per session.  Every backend runs steps and
keeps its sessions' KV caches; one that can take tokens on the device (gpu mode) also answers
forward_sample and the chains, the others answer None and the engine steps and samples on the host.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class Steps(ABC):
    use_graphs = False      # gpu mode: decode steps replay one graph per batch bucket

    @abstractmethod
    def forward(self, batch: list, logits: str = "all", trees: list | None = None) -> list[np.ndarray]:
        """Logits [n_i, vocab] float32 per session; logits="last": [1, vocab], each session's last row.
        trees: per session a TokenTree (run/token_tree.py) its ids are the nodes of, or None."""

    @abstractmethod
    def alloc_kv(self, max_seq_len: int): ...

    @abstractmethod
    def free_kv(self, kv) -> None: ...

    @abstractmethod
    def truncate_kv(self, kv, length: int) -> None: ...

    @abstractmethod
    def move_kv(self, kv, moves: list[tuple[int, int]]) -> None:
        """Copy every layer's K and V of slot src to slot dst for each (src, dst), in order."""

    @abstractmethod
    def fork_kv(self, kv, length: int, capacity: int | None = None): ...

    @abstractmethod
    def kv_stats(self) -> dict: ...

    def forward_greedy(self, batch: list) -> np.ndarray:
        """Each session's greedy next token (argmax of its last logits row): int64 [len(batch)]."""
        return np.array([int(np.argmax(rows[-1])) for rows in self.forward(batch, logits="last")], np.int64)

    def forward_argmax(self, batch: list, trees: list | None = None) -> list[np.ndarray]:
        """Every row's argmax, int64 [n_i] per session (Executor.forward_argmax)."""
        return [np.argmax(rows, axis=1).astype(np.int64) for rows in self.forward(batch, "all", trees)]

    def forward_sample(self, batch: list, states: list) -> np.ndarray | None:
        """Each row's token drawn on the device; None: the caller samples from forward's logits."""
        return None

    def generate_greedy(self, batch: list, steps: int) -> np.ndarray | None:
        """`steps` greedy steps chained on the device; None: the caller steps."""
        return None

    def generate_sampled(self, batch: list, steps: int, states: list) -> np.ndarray | None:
        """generate_greedy with each step's token drawn on the device; None: the caller steps."""
        return None

    def routing_counts(self) -> np.ndarray | None:
        """A mixture-of-experts model's selections per expert of each routed layer so far, wherever its router
        ran: int64 [routed layers, experts] (None: a dense model)."""
        return None

    def clear_launches(self) -> None:
        """Forget prepared launches and programs (the plans changed: a forced group choice)."""

    def close(self) -> None:
        """Give device memory, graphs and pinned buffers back."""
