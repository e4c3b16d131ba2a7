"""Launches of the mixture-of-experts kernels (kernels_ptx/moe.cu, moe_mma.cu): a routed layer's route, grouped
expert GEMVs or, for steps of many tokens, the grouped tensor-core GEMM, and combine, with their arguments in .cu
order.

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
EXPERT_ROWS, EXPERT_THREADS, COMBINE_THREADS = 4, 128, 1024
GROUP_EXPERTS = 8                                # moe_experts_<fmt>_g4: 8 chosen experts a block, 16 threads each
# steps of 2 tokens up to the GEMM: g4, 8 experts a block in tiles of 4 tokens (a step of a few sessions gives
# most experts one or two tokens: one expert's 4 rows a block left the blocks too small); m8, one expert a block
GEMV_LAYOUTS = ("g4", "m8")
FORMATS = ("Q8_0", "Q4_0", "Q4_K", "Q6_K")      # the expert kernels' block formats
ROUTE_SIGNATURE = "pppppppp" + "iiiii"           # xn inv_rms router route counts slot_of groups tickets, H E k flags T
EXPERTS_SIGNATURE = "ppqqppp" + "ii" + "pp" + "iiiii"   # qs meta qs_slot meta_slot slot_of groups x, ldx gather,
                                                        # inv_rms y, ldy N K E k
COMBINE_SIGNATURE = "ppppppppp" + "f" + "iiii"   # route groups slot_of expert_out res y normw xn inv_rms, eps, H E k T
# one token (moe.cu's moe_token_*): every chosen expert's rows in one block, no grouping
TOKEN_SILU_SIGNATURE = "ppqqppppp" + "iiii"           # qs meta qs_slot meta_slot slot_of route x inv_rms act, lda N K k
TOKEN_COMBINE_SIGNATURE = "ppqqppppppppp" + "f" + "iiii"   # ... slot_of route act res y normw xn inv_rms counter, eps,
                                                           # lda N K k

# kernels_ptx/moe_mma.cu: the grouped int8 tensor-core GEMM (moe_experts' arguments), BM tokens x BN rows per block
MMA_FORMATS = FORMATS
MMA_TILES = {"16x64": (16, 64, 128), "32x64": (32, 64, 128), "64x64": (64, 64, 128)}   # BM, BN, threads (every format)
# The switch point: a step whose choices average this many tokens per expert (tokens x chosen / experts) takes
# the GEMM; fewer, the GEMVs, which read an expert's weights once per 8 tokens without quantising x.
MMA_MIN_EXPERT_TOKENS = 8


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
                 normalize: bool, tokens: int, grouped: bool = True):
    """moe_route over `tokens` rows of xn (1/rms per row): route rows [tokens, 2 chosen] (ids as floats, then
    weights), each choice counted in counts [experts] (0: not counted), groups filled (not with `grouped`
    False: only the logits, for token_launches); `tickets`: route_tickets(tokens) zeroed uint32, which the last
    blocks reset."""
    check_shape(experts, chosen, tokens, hidden)
    flags = (1 if softmax_first else 0) | (2 if normalize else 0) | (0 if grouped else 4)
    grid = (-(-experts // ROUTE_WARPS), -(-tokens // ROUTE_TOKENS))
    return kernels.launch("moe_route", grid, (32 * ROUTE_WARPS,), ROUTE_SIGNATURE,
                          [xn, inv_rms, router, route, counts, slot_of, groups, tickets, hidden, experts, chosen,
                           flags, tokens]).label(flops=float(2 * tokens * experts * hidden))


def mma_min_tokens(experts: int, chosen: int, given: int | None = None) -> int:
    """The fewest tokens of a step that take the grouped GEMM: `given` (Options.moe_mma_min_tokens), else the
    step whose choices average MMA_MIN_EXPERT_TOKENS tokens per expert."""
    return given if given is not None else max(2, -(-MMA_MIN_EXPERT_TOKENS * experts // chosen))


def uses_mma(kernels, fmt: str, *, experts: int, chosen: int, tokens: int) -> bool:
    """Whether a step of `tokens` tokens runs its `fmt` experts on the grouped GEMM (moe_mma.cu), from the
    kernel set's moe_mma_min_tokens (KESTREL_MOE_MMA_MIN_TOKENS) or mma_min_tokens' default."""
    return fmt in MMA_FORMATS and tokens >= mma_min_tokens(experts, chosen, kernels.moe_mma_min_tokens)


def mma_tile(experts: int, chosen: int, tokens: int, given: str | None = None) -> str:
    """The tile of a step (`given`: Options.moe_mma_tile): the token tile that the mean expert's tokens fill."""
    if given is not None:
        return given
    mean = tokens * chosen / min(experts, tokens * chosen)
    return "16x64" if mean <= 16 else "32x64" if mean <= 32 else "64x64"


def mma_grid(tile: str, rows: int, experts: int, chosen: int, tokens: int) -> tuple[int, int, int]:
    """(row tiles, token tile slots, expert slots), sized on the host for what a step may route: up to
    min(tokens k, experts) experts, each up to `tokens` tokens; a block walks its expert's tiles gridDim.y apart,
    and there are twice the slots the mean expert's tiles need (a hotter expert loops)."""
    bm, bn, _ = MMA_TILES[tile]
    active = min(tokens * chosen, experts)
    mean_tiles = -(-tokens * chosen // (active * bm))
    return -(-rows // bn), min(-(-tokens // bm), 2 * mean_tiles), active


def experts_kernel(kernels, fmt: str, *, experts: int, chosen: int, tokens: int) -> str:
    """The kernel (less "_silu") a step of `tokens` tokens runs its `fmt` experts on: moe_mma_<fmt>_<tile>
    (uses_mma), moe_experts_<fmt>_m1 at one token, else moe_experts_<fmt>_<g4|m8> (KESTREL_MOE_GEMV, g4 unless
    given).  kernels: the KernelSet, or the Options it was made from (the same moe_mma_min_tokens, moe_mma_tile
    and moe_gemv)."""
    shape = dict(experts=experts, chosen=chosen, tokens=tokens)
    if uses_mma(kernels, fmt, **shape):
        return f"moe_mma_{fmt.lower()}_{mma_tile(**shape, given=kernels.moe_mma_tile)}"
    return f"moe_experts_{fmt.lower()}_{'m1' if tokens == 1 else kernels.moe_gemv or 'g4'}"


def experts_launch(kernels, fmt: str, part: PoolPart, *, slot_of: int, groups: int, x: int, ldx: int, gather: bool,
                   inv_rms: int, y: int, ldy: int, rows: int, cols: int, experts: int, chosen: int, tokens: int,
                   silu: bool):
    """The chosen experts of a step of `tokens` tokens: `rows` x `cols` per expert, x rows by token (gather:
    gate_up, times 1/rms) or in grouped order (down), y rows in grouped order; SiLU of (gate, up) row pairs
    (rows / 2 outputs) with `silu`.  moe_mma (uses_mma) or the moe_experts GEMVs."""
    assert fmt in FORMATS, f"no expert kernel for {fmt}"
    assert not silu or rows % 2 == 0
    shape = dict(experts=experts, chosen=chosen, tokens=tokens)
    name = experts_kernel(kernels, fmt, **shape)
    if name.startswith("moe_mma_"):
        tile = name.rsplit("_", 1)[1]
        grid, block = mma_grid(tile, rows, **shape), MMA_TILES[tile][2]
    else:
        used = min(tokens * chosen, experts)             # the most experts a step's choices can hold
        grid = (-(-rows // EXPERT_ROWS), -(-used // GROUP_EXPERTS) if name.endswith("_g4") else used)
        block = EXPERT_THREADS
    return kernels.launch(name + ("_silu" if silu else ""), grid, (block,), EXPERTS_SIGNATURE,
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


def token_launches(kernels, gate_up_fmt: str, gate_up: PoolPart, down_fmt: str, down: PoolPart, *, slot_of: int,
                   route: int, x: int, inv_rms: int, act: int, res: int, y: int, normw_out: int, xn_out: int,
                   inv_rms_out: int, counter: int, eps: float, hidden: int, intermediate: int, chosen: int) -> list:
    """A step of one token's experts in two launches (moe.cu's moe_token_*), reading the route row in place of
    moe_route's grouping: gate_up (times 1/rms, SiLU) into act row j for choice j, then down with the weighted
    sum, y = res + the sum and the next norm's xn_out and inv_rms_out (the dense GEMV epilogue; `counter`: its
    zeroed ticket and sums), or the sum alone without res (0), as combine_launch."""
    assert gate_up_fmt in FORMATS and down_fmt in FORMATS, f"no expert kernel for {gate_up_fmt}/{down_fmt}"
    assert 1 <= chosen <= MAX_CHOSEN, chosen
    H, I = hidden, intermediate
    silu = kernels.launch(f"moe_token_{gate_up_fmt.lower()}_silu", (-(-2 * I // EXPERT_ROWS),), (EXPERT_THREADS,),
                          TOKEN_SILU_SIGNATURE, [gate_up.qs, gate_up.meta, gate_up.qs_slot, gate_up.meta_slot, slot_of,
                                                 route, x, inv_rms, act, I, 2 * I, H, chosen])
    combine = kernels.launch(f"moe_token_{down_fmt.lower()}_combine", (-(-H // EXPERT_ROWS),), (EXPERT_THREADS,),
                             TOKEN_COMBINE_SIGNATURE, [down.qs, down.meta, down.qs_slot, down.meta_slot, slot_of, route,
                                                       act, res, y, normw_out, xn_out, inv_rms_out, counter, eps, I, H,
                                                       I, chosen])
    return [silu, combine]
