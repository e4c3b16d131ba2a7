"""The device memory a mixture-of-experts model's routed layers take, as arithmetic (no CUDA): the expert
pool's slot sizes, the routers, the per-layer tables, and the step buffers of the route/experts/combine
launches (kernels_ptx/moe.cu).  budget.py plans with it; expert_store.py lays the pool out by it.

A slot holds one expert: its gate_up rows (2I x H, gate j and up j interleaved for the SiLU epilogue) and
its down rows (H x I), each as the qs bytes and the meta bytes of its block format, in four regions of
`slots` strides each (gate_up qs, gate_up meta, down qs, down meta).  Mode offload's experts' ring is more
slots of the same pool past the resident ones, E of them a ring slot: one routed layer's every expert.
Routed layers may differ in format (llama.cpp's Q4_K_M keeps some layers' ffn_down in Q6_K), so a stride
is the largest over the layers.
"""
from __future__ import annotations

from dataclasses import dataclass

from kestrel_stream.cuda.block_kernels import PART_BYTES
from kestrel_stream.cuda.moe_kernels import group_ints, route_tickets
from scheduler.moe import expert_names
from scheduler.ops import BLOCK_FORMATS

ALIGN = 256          # the arena's alignment (driver.Arena.ALIGN; budget.ALIGN)


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def routed_layers(config) -> list[int]:
    return [i for i in range(config.num_hidden_layers) if config.moe_layer(i)]


def expert_formats(config, layer: int) -> tuple[str, str]:
    """(gate_up, down) block formats of a routed layer's experts as the config names them (gate and up in
    different formats are fused as Q8_0: model/quant4.fuse_rows)."""
    formats = dict(config.weight_formats)
    gate, up, down = (formats.get(name, "Q8_0") for name in expert_names(config, layer, 0))
    return (gate if gate == up else "Q8_0"), down


def part_bytes(fmt: str, rows: int, cols: int) -> tuple[int, int]:
    """(qs bytes, meta bytes) of a [rows, cols] weight in `fmt`."""
    blocks = rows * (cols // BLOCK_FORMATS[fmt][0])
    qs, meta = PART_BYTES[fmt]
    return blocks * qs, blocks * meta


@dataclass(frozen=True)
class PoolLayout:
    """Slot strides of the four regions of the expert pool."""
    gate_up_qs: int
    gate_up_meta: int
    down_qs: int
    down_meta: int

    @property
    def slot_bytes(self) -> int:
        return self.gate_up_qs + self.gate_up_meta + self.down_qs + self.down_meta

    def pool_bytes(self, slots: int) -> int:
        return slots * self.slot_bytes


def pool_layout(config, formats: dict | None = None) -> PoolLayout:
    """The strides for a model's routed layers; formats: layer -> (gate_up, down) format of the weights as
    loaded (default: as the config names them)."""
    H, I = config.hidden_size, config.moe_intermediate_size
    strides = [0, 0, 0, 0]
    for layer in routed_layers(config):
        gate_up_fmt, down_fmt = (formats or {}).get(layer) or expert_formats(config, layer)
        sizes = part_bytes(gate_up_fmt, 2 * I, H) + part_bytes(down_fmt, H, I)
        strides = [max(s, _align(b)) for s, b in zip(strides, sizes)]
    return PoolLayout(*strides)


def layer_slot_bytes(config) -> int:
    """Pool bytes of one routed layer's every expert: a slot of mode offload's experts' ring."""
    return config.num_experts * pool_layout(config).slot_bytes


def ring_bytes(config, slots: int) -> int:
    """The experts' ring of `slots` slots in the pool, and its slot tables (int32 [slots, E]: expert e of
    ring slot r at pool slot first + r E + e)."""
    if not slots:
        return 0
    return slots * layer_slot_bytes(config) + _align(slots * config.num_experts * 4) + ALIGN


def router_bytes(config) -> int:
    """float32 routers of every routed layer, and each layer's slot table and selection counts."""
    L, E = len(routed_layers(config)), config.num_experts
    return _align(L * E * config.hidden_size * 4) + 2 * _align(L * E * 4)


def all_experts(config) -> int:
    return len(routed_layers(config)) * config.num_experts


def buffer_floats(config, tokens: int) -> int:
    """The step buffers of a routed layer on the device for steps of up to `tokens` tokens (4-byte words):
    route [T, 2k], the device experts' sum [T, H], act [T k, I], the experts' rows [T k, H], the groups,
    the route kernel's tickets."""
    if not config.is_moe:
        return 0
    H, I, E, k = config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok
    return tokens * (2 * k + H) + tokens * k * (I + H) + group_ints(E, tokens, k) + route_tickets(tokens)
