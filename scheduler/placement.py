"""Which side runs each op, per mode: the rules, given the gate's projection decisions.

Each function returns [(op, side, reason)] in step order, where reason is a
string or, for gated projections, {weight name: GateDecision}.

- cpu: every op on the host.
- gpu: every op on the GPU, embed included (token ids go up, logits come
  down): one segment, one sync per step.
- layers=N: decoder layers 0..N-1 entirely on the GPU with
  their KV cache; the rest on the host. embed always stays on the host (the
  token ids are there and it only gathers M rows; llama.cpp keeps its input
  layer on the CPU too); final_norm and lm_head go to the GPU when all
  layers do (N >= L).
- layers=N+head: the same N layers, and final_norm and lm_head on the GPU
  too: a second device segment after the host's layers, whose logits come
  down. llama.cpp's -ngl N counts its output layer as one of the N (for
  N <= L it holds the last N-1 layers and the output): the same VRAM and the
  same split of the work as layers=N-1+head here.
- offload: each layer's projection groups where the offload placement homes the layer (resident or
  streamed: the GPU; host: the host), rope and attention on the GPU over the device KV pool (a layer may
  change home between step sizes without moving its cache), a routed layer's router and experts on the
  host, or, where some of its experts are resident (expert_residency.py), the router and those experts on
  the GPU and the others on the host (moe.split_experts), or, in a layer homed experts, the router and every
  expert on the GPU (the experts streamed through the experts' ring), embed on the host, lm_head resident or on the
  host; norms and SiLU·mul by the sandwich rule below.
- gated: each projection group follows the gate. rope and attention stay on
  the host: in gated mode the KV cache lives on the host, so attention never
  moves it. A stateless op (norm, silu_mul) runs on the GPU when both its
  neighbours in step order do, across layer boundaries too (layer L+1's
  attn_norm sits between L's down and L+1's qkv; final_norm between the last
  down and lm_head): on the host it would split one GPU segment in two,
  adding a sync, a D2H and an H2D for microseconds of work. Otherwise it runs
  on the host, where its input already is. embed stays on the host. With
  every group offloaded this leaves one GPU segment per layer, from o to the
  next layer's qkv, plus the first qkv: L+1 syncs per step.
"""
from __future__ import annotations


def fixed_sides(ops, kind: str, layer_count: int | None, total_layers: int) -> list:
    """Placement for the modes that need no gate: cpu, gpu, layers=N."""
    if kind == "cpu":
        return [(op, "cpu", "mode cpu") for op in ops]
    if kind == "gpu":
        return [(op, "gpu", "mode gpu: the whole step is one segment") for op in ops]
    assert kind in ("layers", "layers+head"), kind
    all_layers = layer_count >= total_layers
    head = all_layers or kind == "layers+head"
    placed = []
    for op in ops:
        if op.layer is not None:
            on = op.layer < layer_count
            placed.append((op, "gpu" if on else "cpu",
                           f"layers={layer_count}: layer {op.layer} {'<' if on else '>='} "
                           f"{layer_count}"))
        elif op.kind == "embed":
            placed.append((op, "cpu", "layers=N: embed stays on the host"))
        else:
            placed.append((op, "gpu" if head else "cpu",
                           "layers=N+head: the output on the GPU" if kind == "layers+head" else
                           f"layers=N: output on the GPU only when all {total_layers} layers are"))
    return placed


def gated_sides(ops, decide) -> list:
    """Placement for gated mode. decide(op) -> {weight name: GateDecision} for projections.

    A group the decisions divide (the per-projection KESTREL_MINFLOP threshold
    can) becomes two ops sharing the input: the GPU part first, so the host
    part runs while the GPU works.
    """
    placed = []
    for op in ops:
        if op.is_projection:
            decisions = decide(op)
            on = [w.name for w in op.weights if decisions[w.name].on_gpu]
            off = [w.name for w in op.weights if not decisions[w.name].on_gpu]
            if on and off:
                placed.append((op.subset(on, "gpu"), "gpu", decisions))
                placed.append((op.subset(off, "cpu"), "cpu", decisions))
            else:
                placed.append((op, "gpu" if on else "cpu", decisions))
        elif op.kind in ("rope", "attention"):
            placed.append((op, "cpu", "gated: the KV cache lives on the host"))
        elif op.kind == "embed":
            placed.append((op, "cpu", "token ids arrive on the host; gathers M rows"))
        else:
            placed.append((op, None, None))
    return _sandwich(placed)


def offload_sides(ops, homes, head: str, resident_experts: dict | None = None) -> list:
    """Placement for an offload placement (scheduler/offload.py): homes per layer, lm_head's home;
    resident_experts: layer -> the experts of a routed layer kept on the device (expert_residency.py)."""
    from .moe import split_experts
    from .offload import group_home
    placed, resident_experts = [], resident_experts or {}
    for op in ops:
        if op.kind in ("router", "experts") and homes[op.layer] == "experts":
            placed.append((op, "gpu", f"offload: layer {op.layer}'s {op.kind} on the GPU, every expert streamed "
                                      "into a slot of the experts' ring"))
            continue
        ids = resident_experts.get(op.layer, ()) if op.kind in ("router", "experts") else ()
        if ids and op.kind == "router":
            placed.append((op, "gpu", f"offload: layer {op.layer}'s router on the GPU ({len(ids)} of its experts "
                                      "resident there)"))
            continue
        if ids and op.kind == "experts":
            if 3 * len(ids) == len(op.weights):
                placed.append((op, "gpu", f"offload: every expert of layer {op.layer} resident"))
                continue
            device, host = split_experts(op, ids)
            placed.append((device, "gpu", f"offload: layer {op.layer}'s {len(ids)} resident experts, chosen by "
                                          "routing frequency"))
            placed.append((host, "cpu", f"offload: layer {op.layer}'s other experts on the host (native kernels, "
                                        "the chosen ones only)"))
            continue
        if op.is_projection:
            home = head if op.group == "lm_head" else group_home(homes[op.layer], op.group)
            side = "cpu" if home == "host" else "gpu"
            where = f"layer {op.layer}" if op.layer is not None else "lm_head"
            placed.append((op, side, f"offload: {where} {home}"))
        elif op.kind in ("rope", "attention"):
            placed.append((op, "gpu", "offload: attention on the GPU, over the device KV pool"))
        elif op.kind in ("router", "experts"):
            placed.append((op, "cpu", f"offload: layer {op.layer}'s router and experts on the host (native "
                                      "kernels, the chosen experts only)"))
        elif op.kind == "embed":
            placed.append((op, "cpu", "offload: the embedding table stays on the host (M rows gathered)"))
        else:
            placed.append((op, None, None))
    return _sandwich(placed)


def _sandwich(placed) -> list:
    """Stateless ops (side None) on the GPU between GPU ops, else on the host where their input is."""
    for i, (op, side, _) in enumerate(placed):  # stateless ops: the sandwich rule
        if side is None:
            before = placed[i - 1][1] if i > 0 else "cpu"
            after = placed[i + 1][1] if i + 1 < len(placed) else "cpu"
            if before == after == "gpu":
                placed[i] = (op, "gpu", "between GPU ops: avoids a sync + D2H + H2D")
            else:
                placed[i] = (op, "cpu", "a neighbour runs on the host: stays with its input")
    return placed
