"""The weights an op of the step program (scheduler/ops.py) reads, by the op: the same lookup for the host
and the device backend (and CUDA-free, so cpu mode needs no cuda.bindings)."""
from __future__ import annotations


def norm_weight(weights, name: str):
    """The weight vector of a norm op of the program ("L3.attn_norm", "L3.mlp_norm", "final_norm")."""
    if name == "final_norm":
        return weights.final_norm
    layer, which = name.split(".")
    return getattr(weights.layers[int(layer[1:])], which)


def fused_tensor(weights, op):
    """The fused QTensor a projection (or an untied embed) of the program reads."""
    if op.kind == "embed":
        return weights.embed
    if op.group == "lm_head":
        return weights.lm_head
    layer = weights.layers[op.layer]
    return {"qkv": layer.wqkv, "o": layer.wo, "gate_up": layer.w_gate_up, "down": layer.w_down}[op.group]


def moe_weights(weights, op):
    """The router and experts (model.weights.MoeWeights) a router or experts op of a routed layer reads."""
    moe = weights.layers[op.layer].moe
    assert moe is not None, f"{op.name}: layer {op.layer} has no experts"
    return moe
