"""The device backend's router and experts ops (scheduler/ops.py): a routed layer's launches over the
expert store (expert_store.py), for device/ops.py's DeviceOps.

router: moe_route (the chosen experts, their weights, the counts, the grouping by expert);
experts: the chosen experts' gate_up (x rows gathered by token, SiLU·mul) and down over the pool, then
moe_combine (a step of one token: moe_token_*'s two launches, the combine in the down's epilogue): the
weighted sum into x with the next norm's xn and 1/rms (a dense down's epilogue) (over the layer's own slot
table, or, where its experts stream this step, the experts' ring slot's), or, for the part of a layer's
experts that mode offload keeps resident (the op writes "moe_out"), the sum alone, which the host's part adds
to its own (scheduler/moe.split_experts).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kestrel_stream.cuda import driver
from kestrel_stream.cuda.moe_kernels import (combine_launch, experts_launch, group_ints, route_launch,
                                             route_tickets, token_launches)
from kestrel_stream.model.op_tensors import norm_weight


@dataclass
class MoeBuffers:
    """Device addresses of a routed layer's step buffers (rows: tokens of the step, choices: rows x k)."""
    route: int          # [T, 2k] ids as floats, then weights
    moe_out: int        # [T, H] the device experts' sum (mode offload's split layers)
    act: int            # [T k, I] silu(gate) * up per choice, grouped by expert
    expert_out: int     # [T k, H] down rows per choice, grouped by expert
    groups: int         # moe_route's grouping (moe_kernels.group_ints)
    tickets: int        # its last-block tickets (moe_kernels.route_tickets, zeroed)

    @classmethod
    def allocate(cls, arena, config, tokens: int) -> tuple["MoeBuffers", dict]:
        """The buffers for steps of up to `tokens` tokens, and the arrays a mixed step moves by name (route,
        moe_out)."""
        H, I, E, k = config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok
        arrays = {"route": arena.array((tokens, 2 * k), np.float32), "moe_out": arena.array((tokens, H), np.float32)}
        act, expert_out = arena.array((tokens * k, I), np.float32), arena.array((tokens * k, H), np.float32)
        groups = arena.array((group_ints(E, tokens, k),), np.int32)
        tickets = arena.array((route_tickets(tokens),), np.uint32)
        driver.h2d_sync(tickets.ptr, np.zeros(route_tickets(tokens), np.uint32))
        return cls(arrays["route"].ptr, arrays["moe_out"].ptr, act.ptr, expert_out.ptr, groups.ptr,
                   tickets.ptr), arrays


class MoeOps:
    """launches(op, tokens) of a router or experts op; state: the step's DeviceState (x, xn, inv_rms)."""

    def __init__(self, kernels, weights, store, buffers: MoeBuffers, state, vector):
        self.kernels, self.weights, self.config, self.store = kernels, weights, weights.config, store
        self.buffers, self.state, self.vector = buffers, state, vector

    def launches(self, op, tokens: int, ring_slot: int | None = None) -> list:
        """ring_slot: the experts' ring slot holding every expert of the layer this step (mode offload's layers
        homed experts: expert_ring.py), whose table the launches read in place of the layer's own."""
        c, s, b, store, layer = self.config, self.state, self.buffers, self.store, op.layer
        slot_of = store.slot_of(layer) if ring_slot is None else store.ring_table(ring_slot)
        E, k, H, I = c.num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
        shape = dict(experts=E, chosen=k, tokens=tokens)
        if op.kind == "router":
            launch = route_launch(self.kernels, xn=s.xn, inv_rms=s.inv_rms, router=store.router(layer), route=b.route,
                                  counts=store.counts_of(layer), slot_of=slot_of, groups=b.groups,
                                  tickets=b.tickets, hidden=H, softmax_first=c.router_softmax_first,
                                  normalize=c.norm_topk_prob, grouped=tokens > 1, **shape)
            return [launch.label(op="router", layer=layer, bytes=E * H * 4)]
        assert op.kind == "experts", op.name
        gate_up_fmt, down_fmt = store.formats[layer]
        active = int(op.active_weight_bytes)           # the bytes a step of `tokens` is expected to read
        part_bytes = (2 * active // 3, active - 2 * active // 3)      # gate_up's, down's
        if op.writes == ("moe_out",):                  # offload's resident part: the sum alone, for the host
            out = dict(res=0, y=b.moe_out, normw_out=0, xn_out=0, inv_rms_out=0)
        else:                                          # the whole layer: into x, with the next norm's xn
            out = dict(res=s.x, y=s.x, normw_out=self.vector(norm_weight(self.weights, op.prepares)), xn_out=s.xn,
                       inv_rms_out=s.inv_rms)
        if tokens == 1:                                # every chosen expert's rows a block, no grouping
            launches = token_launches(self.kernels, gate_up_fmt, store.gate_up, down_fmt, store.down, slot_of=slot_of,
                                      route=b.route, x=s.xn, inv_rms=s.inv_rms, act=b.act, counter=s.counter,
                                      eps=c.rms_norm_eps, hidden=H, intermediate=I, chosen=k, **out)
            return [launch.label(op="experts", layer=layer, bytes=n) for launch, n in zip(launches, part_bytes)]
        table = dict(slot_of=slot_of, groups=b.groups, **shape)
        gate_up = experts_launch(self.kernels, gate_up_fmt, store.gate_up, x=s.xn, ldx=H, gather=True,
                                 inv_rms=s.inv_rms, y=b.act, ldy=I, rows=2 * I, cols=H, silu=True, **table)
        down = experts_launch(self.kernels, down_fmt, store.down, x=b.act, ldx=I, gather=False, inv_rms=0,
                              y=b.expert_out, ldy=H, rows=H, cols=I, silu=False, **table)
        combine = combine_launch(self.kernels, route=b.route, groups=b.groups, slot_of=slot_of,
                                 expert_out=b.expert_out, eps=c.rms_norm_eps, hidden=H, **out, **shape)
        return [launch.label(op="experts", layer=layer, bytes=nbytes)
                for launch, nbytes in zip((gate_up, down, combine), (*part_bytes, 0))]
