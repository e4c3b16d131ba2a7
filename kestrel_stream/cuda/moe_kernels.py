"""Launches of the mixture-of-experts kernels (kernels_ptx/moe.cu): a routed layer's route, grouped expert
GEMVs and combine, with their arguments in .cu order.

An expert pool part (PoolPart) is one of the pool's two stacked weights, gate_up or down: slot s of it
holds one expert's rows in their block format, its qs bytes at qs + s * qs_slot and its meta bytes at
meta + s * meta_slot.  `groups` is the int scratch moe_route fills for the layer's other launches
(group_ints of them); slot_of [E] int32 the layer's expert -> slot table (-1: not on the device).
"""
from __future__ import annotations

from dataclasses import dataclass

# kernels_ptx/moe.cu's limits and shapes
MAX_EXPERTS, MAX_CHOSEN, MAX_CHOICES = 256, 16, 8192
ROUTE_WARPS, ROUTE_TOKENS = 8, 8                 # a route block: 8 experts (a warp each) over 8 tokens
EXPERT_ROWS, EXPERT_THREADS, COMBINE_THREADS = 4, 128, 256
FORMATS = ("Q8_0", "Q4_0", "Q4_K", "Q6_K")      # the expert kernels' block formats
ROUTE_SIGNATURE = "pppppppp" + "iiiii"           # xn inv_rms router route counts slot_of groups tickets, H E k flags T
EXPERTS_SIGNATURE = "ppqqppp" + "ii" + "pp" + "iiiii"   # qs meta qs_slot meta_slot slot_of groups x, ldx gather,
                                                        # inv_rms y, ldy N K E k
COMBINE_SIGNATURE = "ppppppppp" + "f" + "iiii"   # route groups slot_of expert_out res y normw xn inv_rms, eps, H E k T


@dataclass(frozen=True)
class PoolPart:
    """gate_up or down of the expert pool: where slot s's qs and meta bytes start (device addresses)."""
    qs: int
    meta: int
    qs_slot: int
    meta_slot: int


def group_ints(experts: int, tokens: int, chosen: int) -> int:
    """The 4-byte words of moe_route's scratch for a step of `tokens` tokens (moe.cu: offsets, active, sorted,
    position, then the logits)."""
    return 2 * (experts + 1) + 2 * tokens * chosen + tokens * experts


def route_tickets(tokens: int) -> int:
    """The zeroed uint32 tickets moe_route takes (one per tile of ROUTE_TOKENS tokens, one for the launch)."""
    return -(-tokens // ROUTE_TOKENS) + 1


def check_shape(experts: int, chosen: int, tokens: int, hidden: int) -> None:
    """The kernels' limits (a model or step past them has no device path)."""
    assert 1 <= chosen <= min(experts, MAX_CHOSEN) and experts <= MAX_EXPERTS, (experts, chosen)
    assert tokens * chosen <= MAX_CHOICES, f"{tokens} tokens x {chosen} experts > {MAX_CHOICES} choices a step"
    assert hidden % 4 == 0, hidden


def route_launch(kernels, *, xn: int, inv_rms: int, router: int, route: int, counts: int, slot_of: int,
                 groups: int, tickets: int, hidden: int, experts: int, chosen: int, softmax_first: bool,
                 normalize: bool, tokens: int):
    """moe_route over `tokens` rows of xn (1/rms per row): route rows [tokens, 2 chosen] (ids as floats, then
    weights), each choice counted in counts [experts] (0: not counted), groups filled; `tickets`:
    route_tickets(tokens) zeroed uint32, which the last blocks reset."""
    check_shape(experts, chosen, tokens, hidden)
    flags = (1 if softmax_first else 0) | (2 if normalize else 0)
    grid = (-(-experts // ROUTE_WARPS), -(-tokens // ROUTE_TOKENS))
    return kernels.launch("moe_route", grid, (32 * ROUTE_WARPS,), ROUTE_SIGNATURE,
                          [xn, inv_rms, router, route, counts, slot_of, groups, tickets, hidden, experts, chosen,
                           flags, tokens]).label(flops=float(2 * tokens * experts * hidden))


def experts_launch(kernels, fmt: str, part: PoolPart, *, slot_of: int, groups: int, x: int, ldx: int, gather: bool,
                   inv_rms: int, y: int, ldy: int, rows: int, cols: int, experts: int, chosen: int, tokens: int,
                   silu: bool):
    """moe_experts over the chosen experts of a step of `tokens` tokens: `rows` x `cols` per expert, x rows by
    token (gather: gate_up, times 1/rms) or in grouped order (down), y rows in grouped order; SiLU of (gate,
    up) row pairs (rows / 2 outputs) with `silu`."""
    assert fmt in FORMATS, f"no expert kernel for {fmt}"
    assert not silu or rows % 2 == 0
    m = 1 if tokens == 1 else 8
    name = f"moe_experts_{fmt.lower()}_m{m}" + ("_silu" if silu else "")
    grid = (-(-rows // EXPERT_ROWS), min(tokens * chosen, experts))
    return kernels.launch(name, grid, (EXPERT_THREADS,), EXPERTS_SIGNATURE,
                          [part.qs, part.meta, part.qs_slot, part.meta_slot, slot_of, groups, x, ldx, int(gather),
                           inv_rms, y, ldy, rows, cols, experts, chosen])


def combine_launch(kernels, *, route: int, groups: int, slot_of: int, expert_out: int, res: int, y: int,
                   normw_out: int, xn_out: int, inv_rms_out: int, eps: float, hidden: int, experts: int, chosen: int,
                   tokens: int):
    """moe_combine: y = res + each token's weighted choices' rows of expert_out (those with a slot); xn_out
    = y * normw_out and inv_rms_out = 1/rms(y) where given (0: not written)."""
    return kernels.launch("moe_combine", (tokens,), (COMBINE_THREADS,), COMBINE_SIGNATURE,
                          [route, groups, slot_of, expert_out, res, y, normw_out, xn_out, inv_rms_out, eps, hidden,
                           experts, chosen, tokens])
