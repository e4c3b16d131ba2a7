"""The device copies of a model's weights, made on first use and kept (the hybrid executor's weight cache).

A mixin: the class using it provides ``arena``, ``weights``, ``config`` and
``counters`` (a StepCounters) and the dicts ``_vectors`` and ``_qweights``.  Every upload is
counted (``weight_uploads``) and timed into the profile table's ``upload``
stage; a lookup is its ``cache_probe``.
"""
from __future__ import annotations

import time

import numpy as np

from kestrel_stream.cuda import driver
from kestrel_stream.cuda.kernels import QWeight
from kestrel_stream.model.quant import QTensor
from kestrel_stream.run.block_weights import block_image, device_qweight


class DeviceWeights:
    def _vector(self, v: np.ndarray | None) -> int:
        if v is None:
            return 0
        if id(v) not in self._vectors:
            ptr = self.arena.alloc(v.nbytes)
            driver.h2d_sync(ptr, np.asarray(v, np.float32))
            self._vectors[id(v)] = (v, ptr)     # keep v alive: its id must not be reused
        return self._vectors[id(v)][1]

    def _qweight(self, w, stages: dict, interleave_halves: bool = False) -> QWeight:
        """The device copy of a Q8_0 weight; gate_up's rows go up as (gate j, up j) pairs for the SiLU epilogue."""
        start = time.perf_counter()
        cached = self._qweights.get(id(w))
        stages["cache_probe"] = stages.get("cache_probe", 0.0) + (time.perf_counter() - start) * 1e6
        if cached is None and not isinstance(w, QTensor):     # 4/6-bit blocks: one image, qs | meta parts
            start = time.perf_counter()
            image = block_image(w, interleave_halves)
            address = self.arena.alloc(image.nbytes)
            driver.h2d_sync(address, image)
            cached = self._qweights[id(w)] = device_qweight(address, w)
            self.counters.weight_uploads += 1
            self.counters.weight_upload_bytes += w.nbytes
            stages["upload"] = stages.get("upload", 0.0) + (time.perf_counter() - start) * 1e6
            stages["uploads"] = stages.get("uploads", 0) + 1
        if cached is None:
            start = time.perf_counter()
            qs, sc = self.arena.alloc(w.qs.nbytes), self.arena.alloc(w.scales.nbytes)
            order = slice(None)
            if interleave_halves:
                half = w.shape[0] // 2
                order = np.stack([np.arange(half), half + np.arange(half)], axis=1).reshape(-1)
            driver.h2d_sync(qs, w.qs[order])
            driver.h2d_sync(sc, w.scales[order])
            cached = self._qweights[id(w)] = QWeight(qs, sc, w.shape[0], w.shape[1])
            self.counters.weight_uploads += 1
            self.counters.weight_upload_bytes += w.nbytes
            stages["upload"] = stages.get("upload", 0.0) + (time.perf_counter() - start) * 1e6
            stages["uploads"] = stages.get("uploads", 0) + 1
        return cached

    def _layer_vectors(self, li: int) -> dict:
        lw = self.weights.layers[li]
        return {name: self._vector(getattr(lw, name)) for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm",
                                                                        "qkv_bias")}

    def _tensor(self, op):
        """The fused QTensor behind a projection op."""
        if op.group == "lm_head":
            return self.weights.lm_head
        lw = self.weights.layers[op.layer]
        return {"qkv": lw.wqkv, "o": lw.wo, "gate_up": lw.w_gate_up, "down": lw.w_down}[op.group]

    def _row_runs(self, op) -> list[tuple[int, int]]:
        """Contiguous row ranges of the fused weight that this (possibly split) op owns."""
        c = self.config
        starts = {"q_proj": (0, c.q_size), "k_proj": (c.q_size, c.kv_size),
                  "v_proj": (c.q_size + c.kv_size, c.kv_size), "gate_proj": (0, c.intermediate_size),
                  "up_proj": (c.intermediate_size, c.intermediate_size)}
        runs = []
        for w in op.weights:
            part = w.name.rsplit(".", 2)[-2]
            lo, n = starts.get(part, (0, w.shape[0]))
            if runs and runs[-1][1] == lo:
                runs[-1] = (runs[-1][0], lo + n)
            else:
                runs.append((lo, lo + n))
        return runs

