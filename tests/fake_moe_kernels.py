"""numpy twins of the mixture-of-experts kernels (kernels_ptx/moe.cu), for fake_cuda.

moe_route: the router's logits of xn times 1/rms (the norm prologue), the host's routing arithmetic
(run/host/arithmetic.route: the same top-k and weights, ties to the lowest id), the counts, and the
grouping the last block writes (flags & 4: none, the scratch made wrong);
moe_experts: each active expert's weight read back from its pool slot
(a wrong slot, stride or part offset gives wrong numbers) times the rows of the tokens that chose it;
moe_mma (moe_mma.cu, the grouped tensor-core GEMM): the same, with the dense GEMMs' arithmetic per expert
(Q8_0: q8_mma.cu's, fake_kernels.mma_product, x in two int8 levels per 32-block; the 4/6-bit formats
q4_mma.cu's, fake_block_kernels.mma_product, per group of 16); moe_combine: the weighted sum of each token's
choices that have a slot; moe_token_*: one token's choices read from its route row (act row j for choice j),
the weighted sum through the GEMV epilogue.  Each checks the launch shape
(a grid that misses a chosen expert is an error, as the kernel would silently skip it), the alignment of
vector loads and that the route kernel's tickets are zero at launch.
"""
from __future__ import annotations

import re

import numpy as np

from fake_cuda import dev
from kestrel_stream.cuda import moe_kernels
from kestrel_stream.model.quant4 import dequantize_blocks
from kestrel_stream.run.host.arithmetic import route as host_route
from scheduler.ops import BLOCK_FORMATS


def ints(ptr: int, count: int) -> np.ndarray:
    return dev(ptr, 4 * count, np.int32)


def group_layout(groups: int, experts: int, choices: int) -> tuple[np.ndarray, ...]:
    """(offsets [E+1], active [E+1], sorted [A], position [A]) views of a layer's groups."""
    E1 = experts + 1
    view = ints(groups, 2 * E1 + 2 * choices)
    return view[:E1], view[E1:2 * E1], view[2 * E1:2 * E1 + choices], view[2 * E1 + choices:]


def moe_route(launch, xn, inv_rms, router, route, counts, slot_of, groups, tickets, H, E, k, flags, T) -> None:
    import fake_kernels as fk
    tiles = -(-T // moe_kernels.ROUTE_TOKENS)
    assert launch.grid == (-(-E // moe_kernels.ROUTE_WARPS), tiles, 1), f"{launch.name}: grid {launch.grid}"
    assert launch.block == (32 * moe_kernels.ROUTE_WARPS, 1, 1), launch.name
    moe_kernels.check_shape(E, k, T, H)
    assert xn % 16 == 0 and router % 16 == 0, "float4 loads of xn and the router misaligned"
    fk.take_ticket(tickets, tickets=moe_kernels.route_tickets(T))
    logits = fk.rows(xn, T, H, H) @ fk.f32(router, E * H).reshape(E, H).T
    if inv_rms:
        logits = logits * fk.f32(inv_rms, T)[:, None]
    dev(groups + 4 * (2 * (E + 1) + 2 * T * k), 4 * T * E, np.float32)[:] = logits.reshape(-1)   # its scratch
    ids, weights = host_route(logits.astype(np.float32), k, bool(flags & 1), bool(flags & 2))
    fk.rows(route, T, 2 * k, 2 * k)[:] = np.concatenate([ids.astype(np.float32), weights], axis=1)
    if counts:
        np.add.at(dev(counts, 4 * E, np.uint32), ids.reshape(-1), 1)
    offsets, active, order, position = group_layout(groups, E, T * k)
    if flags & 4:                                           # no grouping: whatever was there (made wrong here)
        for view in (offsets, active, order, position):
            view[:] = -7
        return
    chosen = ids.reshape(-1)
    order[:] = np.argsort(chosen, kind="stable")            # grouped by expert, ascending choice within
    position[order] = np.arange(T * k)
    offsets[:] = np.searchsorted(chosen[order], np.arange(E + 1))
    slots = ints(slot_of, E) if slot_of else np.zeros(E, np.int32)
    used = [e for e in range(E) if offsets[e + 1] > offsets[e] and slots[e] >= 0]
    active[:len(used)] = used
    active[E] = len(used)


def pool_weight(fmt: str, qs: int, meta: int, rows: int, cols: int) -> np.ndarray:
    """float32 [rows, cols] of one slot of a pool part, from its qs and meta bytes."""
    import fake_kernels as fk
    if fmt == "Q8_0":
        return fk.q8_dense(qs, meta, rows, cols)
    from fake_block_kernels import part_blocks
    blocks = part_blocks(qs, meta, fmt, rows, cols)
    return dequantize_blocks(blocks.reshape(-1, BLOCK_FORMATS[fmt][1]), fmt).reshape(rows, cols)


def moe_experts(launch, qs, meta, qs_slot, meta_slot, slot_of, groups, x, ldx, gather, inv_rms, y, ldy, N, K, E,
                k) -> None:
    import fake_kernels as fk
    code, layout, silu = re.fullmatch(r"moe_experts_(q8_0|q4_0|q4_k|q6_k)_(m1|m8|g4)(_silu)?", launch.name).groups()
    fmt = code.upper()
    assert launch.block == (moe_kernels.EXPERT_THREADS, 1, 1) and launch.grid[2] == 1, launch.name
    experts_a_block = moe_kernels.GROUP_EXPERTS if layout == "g4" else 1
    assert launch.grid[0] * moe_kernels.EXPERT_ROWS >= N, f"{launch.name}: grid {launch.grid} misses rows of {N}"
    assert not silu or N % 2 == 0
    assert qs_slot % 16 == 0 and meta_slot % 16 == 0 and ldx % 4 == 0 and x % 16 == 0, launch.name
    offsets, active, order, _ = group_layout(groups, E, 0)
    choices = int(offsets[E])
    offsets, active, order, _ = group_layout(groups, E, choices)
    assert active[E] <= launch.grid[1] * experts_a_block, f"{launch.name}: {active[E]} experts, grid {launch.grid}"
    slots = ints(slot_of, E)
    for e in active[:active[E]]:
        first, end = int(offsets[e]), int(offsets[e + 1])
        assert layout != "m1" or end - first <= 1, f"{launch.name}: {end - first} tokens of expert {e} at M=1"
        slot = int(slots[e])
        assert slot >= 0
        w = pool_weight(fmt, qs + slot * qs_slot, meta + slot * meta_slot, N, K)
        source = order[first:end] // k if gather else np.arange(first, end)
        xs = np.stack([fk.f32(x + 4 * int(r) * ldx, K) for r in source])
        s = xs @ w.T
        if inv_rms:
            s *= fk.f32(inv_rms, int(source.max()) + 1)[source][:, None]
        out = fk.silu_mul(s[:, 0::2], s[:, 1::2]) if silu else s
        fk.rows(y + 4 * first * ldy, end - first, ldy, out.shape[1])[:] = out


def slot_product(fmt: str, qs: int, meta: int, xs: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """xs [T, cols] times one slot's [rows, cols] weight as the dense tensor-core GEMM of `fmt` multiplies."""
    import fake_kernels as fk
    if fmt == "Q8_0":
        assert cols % 32 == 0
        return fk.mma_product(xs, dev(qs, rows * cols, np.int8).reshape(rows, cols),
                              dev(meta, 2 * rows * (cols // 32), np.float16).reshape(rows, cols // 32))
    from fake_block_kernels import mma_product, part_blocks
    return mma_product(xs, fmt, part_blocks(qs, meta, fmt, rows, cols), cols)


def moe_mma(launch, qs, meta, qs_slot, meta_slot, slot_of, groups, x, ldx, gather, inv_rms, y, ldy, N, K, E,
            k) -> None:
    import fake_kernels as fk
    code, tile, silu = re.fullmatch(r"moe_mma_(q8_0|q4_0|q4_k|q6_k)_(\d+x\d+)(_silu)?", launch.name).groups()
    fmt = code.upper()
    bm, bn, threads = moe_kernels.MMA_TILES[tile]
    assert launch.block == (threads, 1, 1), launch.name
    assert launch.grid[0] * bn >= N, f"{launch.name}: grid {launch.grid} misses rows of {N}"
    assert not silu or N % 2 == 0
    assert qs_slot % 16 == 0 and meta_slot % 16 == 0 and qs % 16 == 0, launch.name
    assert ldx % 4 == 0 and x % 16 == 0, f"{launch.name}: float4 loads of x misaligned (x {x:#x}, ldx {ldx})"
    offsets, active, order, _ = group_layout(groups, E, 0)
    choices = int(offsets[E])
    offsets, active, order, _ = group_layout(groups, E, choices)
    assert active[E] <= launch.grid[2], f"{launch.name}: {active[E]} chosen experts, grid {launch.grid}"
    slots = ints(slot_of, E)
    for e in active[:active[E]]:
        first, end = int(offsets[e]), int(offsets[e + 1])
        slot = int(slots[e])
        assert slot >= 0
        source = order[first:end] // k if gather else np.arange(first, end)
        xs = np.stack([fk.f32(x + 4 * int(r) * ldx, K) for r in source])
        s = slot_product(fmt, qs + slot * qs_slot, meta + slot * meta_slot, xs, N, K)
        if inv_rms:
            s *= fk.f32(inv_rms, int(source.max()) + 1)[source][:, None]
        out = fk.silu_mul(s[:, 0::2], s[:, 1::2]) if silu else s
        fk.rows(y + 4 * first * ldy, end - first, ldy, out.shape[1])[:] = out


def moe_combine(launch, route, groups, slot_of, expert_out, res, y, normw_out, xn_out, inv_rms_out, eps, H, E, k,
                T) -> None:
    import fake_kernels as fk
    assert launch.grid == (T, 1, 1) and launch.block == (moe_kernels.COMBINE_THREADS, 1, 1), launch.name
    chosen = fk.rows(route, T, 2 * k, 2 * k)
    ids, weights = chosen[:, :k].astype(np.int64), chosen[:, k:]
    position = group_layout(groups, E, T * k)[3]
    slots = ints(slot_of, E)
    total = np.zeros((T, H), np.float32)
    for t in range(T):
        for j in range(k):
            if slots[ids[t, j]] >= 0:
                total[t] += weights[t, j] * fk.f32(expert_out + 4 * int(position[t * k + j]) * H, H)
    out = total + fk.rows(res, T, H, H) if res else total
    fk.rows(y, T, H, H)[:] = out
    if xn_out:
        fk.rows(xn_out, T, H, H)[:] = out * fk.f32(normw_out, H)
    if inv_rms_out:
        fk.f32(inv_rms_out, T)[:] = 1.0 / np.sqrt(np.mean(np.square(out), axis=1) + np.float32(eps))


def token_choices(route: int, slot_of: int, k: int) -> list[tuple[int, int, float]]:
    """(j, slot, weight) of the token's choices that have a slot, from its route row (each id's slot read
    alone: the kernels are not told the expert count)."""
    import fake_kernels as fk
    row = fk.f32(route, 2 * k)
    ids = row[:k].astype(np.int64)
    assert (ids >= 0).all() and (ids < moe_kernels.MAX_EXPERTS).all() and (row[:k] == ids).all(), f"ids {row[:k]}"
    slots = [int(ints(slot_of + 4 * int(e), 1)[0]) for e in ids]
    return [(j, slots[j], float(row[k + j])) for j in range(k) if slots[j] >= 0]


def moe_token_silu(launch, qs, meta, qs_slot, meta_slot, slot_of, route, x, inv_rms, act, lda, N, K, k) -> None:
    import fake_kernels as fk
    fmt = re.fullmatch(r"moe_token_(q8_0|q4_0|q4_k|q6_k)_silu", launch.name).group(1).upper()
    assert launch.block == (moe_kernels.EXPERT_THREADS, 1, 1) and launch.grid[1:] == (1, 1), launch.name
    assert launch.grid[0] * moe_kernels.EXPERT_ROWS >= N and N % 2 == 0 and lda >= N // 2, (launch.grid, N, lda)
    assert qs_slot % 16 == 0 and meta_slot % 16 == 0 and x % 16 == 0, launch.name
    scale = fk.f32(inv_rms, 1)[0] if inv_rms else np.float32(1)
    for j, slot, _ in token_choices(route, slot_of, k):
        s = pool_weight(fmt, qs + slot * qs_slot, meta + slot * meta_slot, N, K) @ fk.f32(x, K) * scale
        fk.f32(act + 4 * j * lda, N // 2)[:] = fk.silu_mul(s[0::2], s[1::2])


def moe_token_combine(launch, qs, meta, qs_slot, meta_slot, slot_of, route, act, res, y, normw_out, xn_out,
                      inv_rms_out, counter, eps, lda, N, K, k) -> None:
    import fake_kernels as fk
    fmt = re.fullmatch(r"moe_token_(q8_0|q4_0|q4_k|q6_k)_combine", launch.name).group(1).upper()
    assert launch.block == (moe_kernels.EXPERT_THREADS, 1, 1) and launch.grid[1:] == (1, 1), launch.name
    assert launch.grid[0] * moe_kernels.EXPERT_ROWS >= N and lda >= K and act % 16 == 0 and lda % 4 == 0, launch.name
    total = np.zeros((1, N), np.float32)
    for j, slot, weight in token_choices(route, slot_of, k):
        w = pool_weight(fmt, qs + slot * qs_slot, meta + slot * meta_slot, N, K)
        total[0] += np.float32(weight) * (w @ fk.f32(act + 4 * j * lda, K))
    fk.gemv_epilogues(launch, total, 0, y, N, res, normw_out, xn_out, inv_rms_out, counter, eps, N, 1, 1, False,
                      sums=True, tickets=1)


MOE_KERNELS = [
    (r"moe_route", moe_route),
    (r"moe_experts_(q8_0|q4_0|q4_k|q6_k)_(m1|m8|g4)(_silu)?", moe_experts),
    (r"moe_mma_(q8_0|q4_0|q4_k|q6_k)_\d+x\d+(_silu)?", moe_mma),
    (r"moe_combine", moe_combine),
    (r"moe_token_(q8_0|q4_0|q4_k|q6_k)_silu", moe_token_silu),
    (r"moe_token_(q8_0|q4_0|q4_k|q6_k)_combine", moe_token_combine),
]
