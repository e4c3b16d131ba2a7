"""Device copies of a model's weights made on first use and kept: every mode's vectors (norm weights, q/k
norms, biases, the rope table) in the arena, and a projection weight the residency window does not hold
(backend.py: a mixed mode's plan that puts one more on the GPU).

Every Q8 upload is counted (``weight_uploads``, ``weight_upload_bytes`` of the StepCounters given) and
timed into the profile table's ``upload`` stage; a lookup is its ``cache_probe``.  gpu mode's Q8 weights
live in the residency window (weight_window.py), and every vector is warmed at load, since nothing may be
uploaded while a graph is captured.
"""
from __future__ import annotations

import time

import numpy as np

from kestrel_stream.cuda import driver
from kestrel_stream.cuda.kernels import QWeight
from kestrel_stream.model.quant4 import image_bytes_of
from kestrel_stream.run.device.block_weights import device_qweight
from kestrel_stream.run.device.image_writer import write_image


class WeightCache:
    def __init__(self, arena, counters):
        self.arena, self.counters = arena, counters
        self.vectors: dict[int, tuple[np.ndarray, int]] = {}      # id -> (the array, kept alive; its address)
        self.qweights: dict[int, QWeight] = {}

    def vector(self, v: np.ndarray | None) -> int:
        """The device address of a float32 copy of `v` (0 for None)."""
        if v is None:
            return 0
        if id(v) not in self.vectors:
            ptr = self.arena.alloc(v.size * 4)
            driver.h2d_sync(ptr, np.asarray(v, np.float32))
            self.vectors[id(v)] = (v, ptr)
        return self.vectors[id(v)][1]

    def qweight(self, w, stages: dict, interleave_halves: bool = False) -> QWeight:
        """The device copy of a projection weight in the residency window's image layout (any format; gate_up's
        rows as (gate j, up j) pairs for the SiLU epilogue)."""
        start = time.perf_counter()
        cached = self.qweights.get(id(w))
        stages["cache_probe"] = stages.get("cache_probe", 0.0) + (time.perf_counter() - start) * 1e6
        if cached is None:
            start = time.perf_counter()
            image = np.zeros(image_bytes_of(w), np.uint8)
            write_image(image, w, interleave_halves)
            address = self.arena.alloc(image.nbytes)
            driver.h2d_sync(address, image)
            cached = self.qweights[id(w)] = device_qweight(address, w)
            self.counters.weight_uploads += 1
            self.counters.weight_upload_bytes += w.nbytes
            stages["upload"] = stages.get("upload", 0.0) + (time.perf_counter() - start) * 1e6
            stages["uploads"] = stages.get("uploads", 0) + 1
        return cached


def layer_vectors(weights) -> list:
    """Every vector of the model the device kernels read, in load order (None left out)."""
    return [weights.final_norm] + [v for layer in weights.layers for v in (
        layer.attn_norm, layer.mlp_norm, layer.q_norm, layer.k_norm, layer.qkv_bias) if v is not None]
