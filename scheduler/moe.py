"""Mixture-of-experts layers as the scheduler sees them: a layer's router and expert weights by their
checkpoint names, and how many distinct experts a step of M tokens reads.

An expert is a weight like any other for placement: each expert's gate, up and down projection is named
by its Hugging Face tensor, so a plan places (and `audit_plan` counts) every one of them.  Which experts a
step reads is only known once the router has run; the costs use the expectation under uniform routing:
each of M tokens picks k distinct experts of E, so an expert goes unused with probability (1 - k/E)^M.
"""
from __future__ import annotations

# arch -> names relative to "model.layers.{i}.": the router, then one expert's gate, up and down ({e}: expert)
MOE_NAMES = {
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                  "mlp.experts.{e}.down_proj.weight"),
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
}
# "route" state per token: the chosen experts' ids, then their weights
ROUTE_FLOATS_PER_CHOICE = 2


def router_name(config, layer: int) -> str:
    return f"model.layers.{layer}.{MOE_NAMES[config.arch][0]}"


def expert_names(config, layer: int, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) tensor names of one expert."""
    return tuple(f"model.layers.{layer}.{n.format(e=expert)}" for n in MOE_NAMES[config.arch][1:])


def expert_shapes(config) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(gate, up, down) shapes of one expert: [I, H], [I, H], [H, I]."""
    H, I = config.hidden_size, config.moe_intermediate_size
    return (I, H), (I, H), (H, I)


def expected_experts(experts: int, chosen: int, tokens: float) -> float:
    """Expected distinct experts a step of `tokens` tokens reads when each token picks `chosen` of `experts`
    uniformly: k at one token, all E as the step grows."""
    return experts * (1.0 - (1.0 - chosen / experts) ** tokens)


def moe_weight_names(config, layer: int) -> set:
    """The router's and every expert's tensor names of one routed layer."""
    names = {router_name(config, layer)}
    for e in range(config.num_experts):
        names.update(expert_names(config, layer, e))
    return names


def expert_of(name: str) -> int:
    """The expert id in one expert's tensor name ("model.layers.3.mlp.experts.17.up_proj.weight" -> 17)."""
    return int(name.split(".experts.", 1)[1].split(".", 1)[0])


def split_experts(op, resident) -> tuple:
    """An experts op of a layer some of whose experts are resident on the device, as two: the device part
    (the resident experts' weights) writes the sum of its experts' weighted outputs into "moe_out", and the
    host part (the rest) reads it beside x and "route" and adds both its own sum and it into x.  The host
    part runs second, from the x both read (the residual before the layer's MLP), so every expert sees the
    same input and the sum is the layer's whole MLP."""
    from dataclasses import replace
    resident = set(resident)
    device = tuple(w for w in op.weights if expert_of(w.name) in resident)
    host = tuple(w for w in op.weights if expert_of(w.name) not in resident)
    assert device and host, f"{op.name}: a split needs experts on both sides"
    share = len(device) / len(op.weights)
    out_bytes = op.output_bytes
    return (replace(op, name=f"{op.name}[gpu]", weights=device, writes=("moe_out",), prepares=None,
                    input_bytes=op.input_bytes - out_bytes, extra_flops=op.extra_flops * share),
            replace(op, name=f"{op.name}[cpu]", weights=host, reads=op.reads + ("moe_out",),
                    input_bytes=op.input_bytes + out_bytes, extra_flops=op.extra_flops * (1 - share)))
