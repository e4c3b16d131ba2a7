"""The routers and the resident experts of a mixture-of-experts model in device memory.

Per routed layer: its router (float32 [E, H]), its slot table (int32 [E]: expert -> pool slot, -1 where the
expert is not on the device) and its selection counts (uint32 [E], which moe_route adds to).  The expert
pool (expert_pool.py's layout) holds `slots` experts of any layers; `place` fills it with a resident set
(scheduler/expert_residency.py) and rewrites the tables, so a choice can change while the launches, which
read the tables, stay as they are (a captured graph too).  Each layer's experts go up as one copy per
region (a layer's slots are consecutive: ResidentExperts.slot_table).
"""
from __future__ import annotations

import numpy as np

from kestrel_stream.cuda import driver
from kestrel_stream.cuda.moe_kernels import PoolPart
from kestrel_stream.model.quant import QTensor
from kestrel_stream.model.quant4 import split_q8, tensor_format
from kestrel_stream.run.device.block_weights import interleave_order
from kestrel_stream.run.device.expert_pool import PoolLayout, pool_layout, routed_layers


def weight_formats(weights) -> dict:
    """layer -> (gate_up, down) format of a routed layer's experts as loaded."""
    return {i: (tensor_format(layer.moe.gate_up), tensor_format(layer.moe.down))
            for i, layer in enumerate(weights.layers) if layer.moe is not None}


def expert_parts(w, lo: int, hi: int, interleave: bool) -> tuple[np.ndarray, np.ndarray]:
    """(qs, meta) uint8 rows of rows [lo, hi) of a stacked expert weight as the kernels read them (gate_up:
    (gate j, up j) pairs)."""
    part = w.rows(lo, hi)
    qs, meta = split_q8(part) if isinstance(part, QTensor) else part.split()
    if interleave:
        order = interleave_order(hi - lo)
        qs, meta = qs[order], meta[order]
    return qs, meta


def write_expert(qs_out: np.ndarray, meta_out: np.ndarray, w, lo: int, hi: int, interleave: bool) -> None:
    """expert_parts of rows [lo, hi) written straight into the uint8 views qs_out and meta_out (a Q8_0
    weight from its GGUF blocks in one pass, as the window's images are: image_writer.write_image)."""
    if not isinstance(w, QTensor):
        qs, meta = expert_parts(w, lo, hi, interleave)
        qs_out[:qs.size], meta_out[:meta.size] = qs.reshape(-1), meta.reshape(-1)
        return
    rows, cols = hi - lo, w.shape[1]
    qs = qs_out[:rows * cols].view(np.int8).reshape(rows, cols)
    scales = meta_out[:rows * cols // 16].view(np.float16).reshape(rows, cols // 32)
    if interleave:                                  # rows gate 0, up 0, gate 1, up 1, ...
        half = rows // 2
        w.rows(lo, lo + half).copy_into(qs[0::2], scales[0::2])
        w.rows(lo + half, hi).copy_into(qs[1::2], scales[1::2])
    else:
        w.rows(lo, hi).copy_into(qs, scales)


class ExpertStore:
    def __init__(self, weights, arena, slots: int, stream, ring_slots: int = 0):
        """slots: the resident experts'; ring_slots: mode offload's experts' ring, each E more pool slots past
        them (one routed layer's every expert), with a slot table of its own (ring_table)."""
        c = weights.config
        self.weights, self.config, self.stream, self.slots = weights, c, stream, slots
        self.ring_slots = ring_slots
        self.layers = routed_layers(c)
        self.index = {layer: n for n, layer in enumerate(self.layers)}
        self.formats = weight_formats(weights)
        self.layout: PoolLayout = pool_layout(c, self.formats)
        L, E, H = len(self.layers), c.num_experts, c.hidden_size
        self.routers = arena.alloc(L * E * H * 4)
        self.tables = arena.alloc(L * E * 4)
        self.counts_ptr = arena.alloc(L * E * 4)
        for n, layer in enumerate(self.layers):
            driver.h2d_sync(self.routers + n * E * H * 4,
                            np.ascontiguousarray(weights.layers[layer].moe.router, np.float32))
        self.reset_counts()
        lay = self.layout
        pool_slots = slots + ring_slots * E
        base = arena.alloc(max(lay.pool_bytes(pool_slots), 1))
        regions = np.cumsum([0] + [pool_slots * s for s in (lay.gate_up_qs, lay.gate_up_meta, lay.down_qs)]).tolist()
        self.gate_up = PoolPart(base + regions[0], base + regions[1], lay.gate_up_qs, lay.gate_up_meta)
        self.down = PoolPart(base + regions[2], base + regions[3], lay.down_qs, lay.down_meta)
        self.resident = None
        self._write_tables({})
        self.ring_tables = 0
        if ring_slots:            # ring slot r: expert e at pool slot slots + r E + e
            self.ring_tables = arena.alloc(ring_slots * E * 4)
            driver.h2d_sync(self.ring_tables, (slots + np.arange(ring_slots * E)).astype(np.int32))

    # ---- a layer's addresses ----------------------------------------------------------------------------
    def router(self, layer: int) -> int:
        return self.routers + self.index[layer] * self.config.num_experts * self.config.hidden_size * 4

    def slot_of(self, layer: int) -> int:
        return self.tables + self.index[layer] * self.config.num_experts * 4

    def counts_of(self, layer: int) -> int:
        return self.counts_ptr + self.index[layer] * self.config.num_experts * 4

    def ring_table(self, ring_slot: int) -> int:
        """The slot table of a layer whose experts are in ring slot `ring_slot` (every expert on the device)."""
        assert 0 <= ring_slot < self.ring_slots, (ring_slot, self.ring_slots)
        return self.ring_tables + ring_slot * self.config.num_experts * 4

    def ring_regions(self, ring_slot: int) -> list[tuple[int, int]]:
        """(device address, bytes) of ring slot `ring_slot` in each region of the pool (gate_up qs, gate_up
        meta, down qs, down meta): where a layer's image goes, one copy each."""
        E, first = self.config.num_experts, self.slots + ring_slot * self.config.num_experts
        return [region for part in (self.gate_up, self.down)
                for region in ((part.qs + first * part.qs_slot, E * part.qs_slot),
                               (part.meta + first * part.meta_slot, E * part.meta_slot))]

    # ---- the resident set ---------------------------------------------------------------------------------
    def place(self, resident) -> None:
        """Fill the pool with `resident` (a scheduler.expert_residency.ResidentExperts, at most `slots`
        experts) and point the tables at them; no kernel of the store may be running (the caller syncs)."""
        assert resident.used_slots <= self.slots, (resident.used_slots, self.slots)
        table = resident.slot_table()
        for layer in self.layers:
            ids = resident.ids(layer)
            if not ids:
                continue
            first = table[layer, ids[0]]
            moe = self.weights.layers[layer].moe
            for part, w, rows, interleave in ((self.gate_up, moe.gate_up, moe.gate_up_rows, True),
                                              (self.down, moe.down, moe.down_rows, False)):
                qs, meta = np.zeros((len(ids), part.qs_slot), np.uint8), np.zeros((len(ids), part.meta_slot), np.uint8)
                for i, e in enumerate(ids):
                    write_expert(qs[i], meta[i], w, *rows(e), interleave)
                driver.h2d_sync(part.qs + first * part.qs_slot, qs)
                driver.h2d_sync(part.meta + first * part.meta_slot, meta)
        self._write_tables(table)
        self.resident = resident

    def _write_tables(self, table: dict) -> None:
        E = self.config.num_experts
        slots = np.full((len(self.layers), E), -1, np.int32)
        for (layer, e), slot in table.items():
            slots[self.index[layer], e] = slot
        driver.h2d_sync(self.tables, slots)

    # ---- routing frequency ----------------------------------------------------------------------------------
    def counts(self) -> np.ndarray:
        """Selections per expert counted on the device so far, int64 [routed layers, E] (waits for the stream)."""
        nbytes = len(self.layers) * self.config.num_experts * 4
        buffer = driver.PinnedBuffer(nbytes)
        try:
            driver.d2h_async(buffer, self.counts_ptr, nbytes, self.stream)
            self.stream.synchronize()
            return buffer.view(np.uint32, (len(self.layers), self.config.num_experts)).astype(np.int64)
        finally:
            buffer.free()

    def reset_counts(self) -> None:
        driver.h2d_sync(self.counts_ptr, np.zeros(len(self.layers) * self.config.num_experts, np.uint32))
