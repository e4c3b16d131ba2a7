"""KESTREL_VERIFY=1: recompute every GPU step on the numpy reference and count mismatches.

The GPU step runs as one captured graph, so verification works at the step's
output: each verified session has a shadow CPU KV cache that sees the same
tokens, and every logits row the GPU returns is compared with the host backend's (run/host/).

Tolerance: a row mismatches when max|gpu - cpu| / max|cpu| > 2e-3 (the same
bound the full-model tests hold the GPU to) or when its argmax differs while
the reference's top two logits are more than that bound apart (a genuine tie
may flip either way without being an error).  The count is in
`executor.counters.verify_mismatches` (rows checked in verify_rows) and is
printed at interpreter exit.
"""
from __future__ import annotations

import atexit
import sys

import numpy as np

from kestrel_stream.run.host import HostBackend
from kestrel_stream.model.weights import ModelWeights

RELATIVE_TOLERANCE = 2e-3


def compare_rows(gpu: np.ndarray, cpu: np.ndarray, tolerance: float = RELATIVE_TOLERANCE) -> int:
    """How many rows of gpu [n, V] are off the reference cpu [n, V] beyond the tolerance."""
    mismatches = 0
    for g, r in zip(np.atleast_2d(gpu), np.atleast_2d(cpu)):
        scale = max(float(np.abs(r).max()), 1e-30)
        relative = float(np.abs(g - r).max()) / scale
        top2 = np.partition(r, -2)[-2:]
        clear_winner = (top2[1] - top2[0]) / scale > tolerance
        if relative > tolerance or (clear_winner and int(g.argmax()) != int(r.argmax())):
            mismatches += 1
    return mismatches


class Verifier:
    def __init__(self, weights: ModelWeights, counters):
        self.reference = HostBackend(weights)      # its own counters: the GPU's stay the GPU's
        self.shadows: dict[int, object] = {}
        self.counters = counters
        counters.verify_mismatches = counters.verify_mismatches or 0
        counters.verify_rows = counters.verify_rows or 0
        atexit.register(self.report)

    def track(self, kv) -> None:
        self.shadows[id(kv)] = self.reference.alloc_kv(kv.capacity)

    def fork(self, kv, child, length: int) -> None:
        self.shadows[id(child)] = self.reference.fork_kv(self.shadows[id(kv)], length, child.capacity)

    def move(self, kv, moves) -> None:
        self.reference.move_kv(self.shadows[id(kv)], moves)

    def forget(self, kv) -> None:
        self.shadows.pop(id(kv), None)

    def check(self, batch, gpu_outputs: list[np.ndarray], logits: str = "all", trees: list | None = None) -> int:
        cpu_batch = [(self.shadows[id(kv)], tokens, start) for kv, tokens, start in batch]
        expected = self.reference.forward(cpu_batch, logits, trees)
        bad = sum(compare_rows(g, r) for g, r in zip(gpu_outputs, expected))
        self.counters.verify_mismatches += bad
        self.counters.verify_rows += sum(len(r) for r in expected)
        return bad

    def report(self) -> None:
        print(f"KESTREL_VERIFY: {self.counters.verify_mismatches} mismatching logits rows of "
              f"{self.counters.verify_rows} checked (tolerance {RELATIVE_TOLERANCE} relative)",
              file=sys.stderr)
