"""A routed (mixture-of-experts) layer's two ops on the host, router and experts, bound once per op.

On the native kernels each op is one call of host_moe.c (native/routed.py's Router and Experts): the
router's norm, float32 logits, top k and counts; the chosen experts' gate|up, SiLU·mul and down over the
tokens that chose each, weighted and summed in ascending expert order, then into x.  native_program.py
lists the same bound structs, so a step as one call has these numbers bit for bit.  With numpy each is
its numpy ops (arithmetic.py's `route`; an expert's rows through HostBackend.linear): the reference
arithmetic the native ops are held to.  An expert held in two formats has no native entry: numpy's ops
over the native matmuls run it.
"""
from __future__ import annotations

import numpy as np

from kestrel_stream.model.op_tensors import moe_weights
from kestrel_stream.native.routed import MAX_CHOICES, Experts, Router
from kestrel_stream.run.host.arithmetic import rmsnorm, route, silu_mul
from scheduler.moe import expert_of


def native_router(backend, op) -> Router | None:
    """The router op bound on the native kernels (None: numpy's, or more choices than they take)."""
    c, kernels = backend.config, backend.kernels
    if kernels is None or c.num_experts_per_tok > MAX_CHOICES:
        return None
    return Router(kernels, moe_weights(backend.weights, op).router, backend.norm(op.prologue), c.rms_norm_eps,
                  c.num_experts_per_tok, c.router_softmax_first, c.norm_topk_prob,
                  backend.expert_counts[backend.routed_index[op.layer]])


def native_experts(backend, op) -> Experts | None:
    """The experts op bound on the native kernels: the experts it owns (a split's host part: its own;
    the others are the device's) as bound Linears; None with numpy or an expert in two formats.  Where the
    device keeps pinned images of the layer's experts (backend.expert_images), the Linears read those."""
    c, kernels = backend.config, backend.kernels
    if kernels is None or c.num_experts_per_tok > MAX_CHOICES:
        return None
    moe, mine = moe_weights(backend.weights, op), {expert_of(w.name) for w in op.weights}
    in_image = backend.expert_images.get(op.layer)        # the device's pinned images, read where they lie
    gate_ups, downs = [], []
    for e in range(moe.experts):
        if e not in mine:
            gate_ups.append(None)
            downs.append(None)
            continue
        if in_image is not None:
            halves, down = in_image(e)
            gate_ups.append(kernels.linear(kernels.prepare_q8_0_halves(*halves), None, 0.0, glu=True))
            downs.append(kernels.linear(kernels.prepare_q8_0(*down)))
            continue
        gate_up, down = backend.prepared_parts(moe.gate_up, *moe.gate_up_rows(e)), backend.prepared_parts(moe.down, *moe.down_rows(e))
        if len(gate_up) != 1 or len(down) != 1:
            return None
        gate_ups.append(kernels.linear(gate_up[0][1], None, 0.0, glu=True))
        downs.append(kernels.linear(down[0][1]))
    return Experts(kernels, gate_ups, downs, backend.norm(op.prologue), c.rms_norm_eps, c.num_experts_per_tok)


def expert_bytes(backend, op) -> int:
    """The weight bytes one expert of the op's layer reads (gate, up and down)."""
    moe = moe_weights(backend.weights, op)
    return moe.nbytes // moe.experts


def router(backend, op):
    """A routed layer's choice: the normed x onto the experts (float32 weights), the k experts of each
    token and their weights, as "route" rows: ids, then weights."""
    bound = native_router(backend, op)
    if bound is not None:
        def native(state) -> None:
            state.write("route", bound(state.read("x")))
        return native
    c, moe = backend.config, moe_weights(backend.weights, op)
    norm, eps, k = backend.norm(op.prologue), c.rms_norm_eps, c.num_experts_per_tok
    router_t = np.ascontiguousarray(moe.router, np.float32).T      # [H, E]
    softmax_first, normalize = c.router_softmax_first, c.norm_topk_prob

    counts = backend.expert_counts[backend.routed_index[op.layer]]      # each choice counted (frequency)

    def run(state) -> None:
        ids, weights = route(rmsnorm(state.read("x"), norm, eps) @ router_t, k, softmax_first, normalize)
        state.write("route", np.concatenate([ids.astype(np.float32), weights], axis=1))
        np.add.at(counts, ids.reshape(-1), 1)
    return run


def experts(backend, op):
    """The chosen experts of a routed layer: per expert the rows of the tokens that chose it, gathered,
    through its gate_up, SiLU·mul and down (each a row range of the stacked weights), weighted by the
    router and added into x.  The host part of a layer whose other experts are on the device
    (scheduler/moe.split_experts: it reads "moe_out") computes its own experts and adds the device part's
    sum with its own."""
    counters, device_part, nbytes = backend.counters, "moe_out" in op.reads, expert_bytes(backend, op)
    bound = native_experts(backend, op)
    if bound is not None:
        def native(state) -> None:
            x = np.array(state.read("x"), np.float32, order="C")
            used = bound(x, state.read("route"), state.read("moe_out") if device_part else None)
            state.write("x", x)
            counters.cpu_weight_read_bytes += used * nbytes
        return native
    c, moe = backend.config, moe_weights(backend.weights, op)
    norm, eps, k, inter = backend.norm(op.prologue), c.rms_norm_eps, c.num_experts_per_tok, c.moe_intermediate_size
    gate_up = [backend.linear(moe.gate_up, *moe.gate_up_rows(e)) for e in range(moe.experts)]
    down = [backend.linear(moe.down, *moe.down_rows(e)) for e in range(moe.experts)]
    mine = np.zeros(moe.experts, bool)
    mine[sorted({expert_of(w.name) for w in op.weights})] = True

    def run(state) -> None:
        xn = rmsnorm(state.read("x"), norm, eps)
        chosen = state.read("route")
        ids, weights = chosen[:, :k].astype(np.int64), chosen[:, k:]
        out = np.zeros_like(xn)
        used = np.unique(ids)
        used = used[mine[used]]
        for e in used:                           # ascending expert id: the sum's order is fixed
            rows, slot = np.nonzero(ids == e)    # each token chooses an expert at most once
            h = gate_up[e](xn[rows])
            out[rows] += weights[rows, slot, None] * down[e](silu_mul(h[:, :inter], h[:, inter:]))
        if device_part:
            out += state.read("moe_out")
        state.add("x", out)
        counters.cpu_weight_read_bytes += len(used) * nbytes
    return run
