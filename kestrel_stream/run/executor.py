"""What the engine asks of an executor, and the counters every executor keeps.

The engine talks to its executor only through ``Executor`` (no probing for
abilities): an executor that cannot take an argmax on the device answers
``forward_greedy`` from its logits (the base class does), and one that cannot
chain greedy steps on the device answers ``generate_greedy`` with None (the
engine then steps).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields

import numpy as np

from kestrel_stream.model.weights import ModelWeights


@dataclass
class StepCounters:
    """What the executor did, summed over its life.  A counter that is None does not apply to this executor
    (or has not happened yet, as the window's busy times before a timed step) and is left out of as_dict(),
    whose keys are the public names of `generate --json`'s and the daemon's counters."""
    steps: int = 0
    tokens: int = 0
    syncs: int = 0                  # host waits for the device
    launches: int = 0               # kernel launches plus graph launches, as the host issued them
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    kernels: int | None = None      # kernels run (a graph launch runs many)
    gpu_weight_read_bytes: int | None = None   # Q8 weight bytes the step's kernels read (embed: its rows)
    cpu_weight_read_bytes: int | None = None   # the same for the host's ops (of the Q8 weights they multiply by)
    graph_replays: int | None = None
    graphs_captured: int | None = None
    weight_uploads: int | None = None
    weight_upload_bytes: int | None = None
    streamed_bytes: int | None = None        # the residency window's counters (device/weight_window.py)
    window_hits: int | None = None
    window_misses: int | None = None
    copy_busy_ms: float | None = None
    compute_busy_ms: float | None = None
    step_span_ms: float | None = None
    expert_image_bytes: int | None = None    # mode offload's experts' ring or link share: its pinned images, built
                                             # at load (expert_ring.layer_images)
    expert_image_build_ms: float | None = None
    verify_mismatches: int | None = None     # KESTREL_VERIFY (verify.py)
    verify_rows: int | None = None

    @classmethod
    def counting(cls, *names: str) -> "StepCounters":
        """Counters with the optional ones in `names` started at zero."""
        counters = cls()
        for name in names:
            setattr(counters, name, 0)
        return counters

    def as_dict(self) -> dict:
        return {f.name: value for f in fields(self) if (value := getattr(self, f.name)) is not None}


class Executor(ABC):
    """One step over many sessions: batch = [(kv, token ids [n_i], start position), ...]."""
    name: str
    counters: StepCounters
    weights: ModelWeights   # what it runs: the CPU engine's, its projections repacked (run/host/repacked.py)
    window_plan = None      # the residency window's plan (gpu mode), else None
    preload_line: str | None = None     # what loading the device weights did (the daemon logs it)

    @abstractmethod
    def alloc_kv(self, max_seq_len: int): ...

    @abstractmethod
    def free_kv(self, kv) -> None: ...

    @abstractmethod
    def truncate_kv(self, kv, length: int) -> None:
        """Keep `kv`'s first `length` positions (Session.truncate)."""

    @abstractmethod
    def move_kv(self, kv, moves: list[tuple[int, int]]) -> None:
        """Copy every layer's K and V of slot src to slot dst for each (src, dst), in order: a token tree's
        accepted path moved to the slots of its positions (run/token_tree.py)."""

    @abstractmethod
    def fork_kv(self, kv, length: int, capacity: int | None = None):
        """A new cache of `capacity` positions (default kv's) holding `kv`'s first `length` (Session.fork)."""

    @abstractmethod
    def check_kv_room(self, batch: list) -> None:
        """CapacityError, before anything changes, when the step's new positions do not fit the KV caches
        (an executor with a shared pool checks it; per-session caches always fit their max_seq_len)."""

    def kv_stats(self) -> dict:
        """What the KV caches hold (the daemon's `stats`)."""

    @abstractmethod
    def forward(self, batch: list, logits: str = "all", trees: list | None = None) -> list[np.ndarray]:
        """Logits [n_i, vocab] float32 per session; logits="last": [1, vocab], each session's last row
        (the only rows lm_head computes).  trees: per session a TokenTree (run/token_tree.py) whose nodes
        its ids are, or None (a causal run of tokens)."""

    @abstractmethod
    def plan(self, tokens: int):
        """The scheduler.Plan of a step of `tokens` tokens as this executor runs it."""

    def forward_greedy(self, batch: list) -> np.ndarray:
        """Each session's greedy next token (argmax of its last logits row): int64 [len(batch)]."""
        return np.array([int(np.argmax(rows[-1])) for rows in self.forward(batch, logits="last")], np.int64)

    def forward_argmax(self, batch: list, trees: list | None = None) -> list[np.ndarray]:
        """Every row's argmax, int64 [n_i] per session (greedy verification of drafted tokens): from the
        logits here; gpu mode takes it on the device and copies back 4 bytes a row."""
        return [np.argmax(rows, axis=1).astype(np.int64) for rows in self.forward(batch, "all", trees)]

    def forward_sample(self, batch: list, states: list) -> np.ndarray | None:
        """Each session's next token drawn on the device (states: device/sample_state.pack_state per row),
        int64 [len(batch)]; None: the caller samples from forward's logits."""
        return None

    def generate_sampled(self, batch: list, steps: int, states: list) -> np.ndarray | None:
        """generate_greedy with each step's token drawn on the device; None: the caller steps."""
        return None

    def generate_greedy(self, batch: list, steps: int) -> np.ndarray | None:
        """`steps` greedy steps chained on the device, int64 [steps, len(batch)]; None: the caller steps."""
        return None

    def close(self) -> None:
        """Give device memory, graphs and pinned buffers back."""

    @property
    def stats(self) -> dict:
        """The counters by their public names (`generate --json`, the daemon's `stats`)."""
        return self.counters.as_dict()
