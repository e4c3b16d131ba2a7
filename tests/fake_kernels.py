"""numpy twins of the kernels in kernels_ptx/*.cu, over the emulated device memory of fake_cuda.

Each twin takes the launch (grid, block) and its arguments in .cu order, checks what the hardware would fault or
silently get wrong on (alignment of vector loads, grid coverage, non-zero tickets), and writes exactly what the
kernel writes.  Float32 arithmetic, dequantise-then-multiply, like cpu.py; last-block reductions computed directly.
"""
from __future__ import annotations

import re

import numpy as np

from fake_cuda import dev, host
from kestrel_stream.cuda import gemv_variants, mma_variants


def f32(ptr: int, count: int) -> np.ndarray:
    return dev(ptr, 4 * count, np.float32)


def rows(ptr: int, count: int, stride: int, width: int) -> np.ndarray:
    """[count, width] float32 rows `stride` floats apart (a view of device memory)."""
    span = f32(ptr, (count - 1) * stride + width)
    return np.lib.stride_tricks.as_strided(span, (count, width), (4 * stride, 4))


def take_ticket(counter: int, sums: bool = False, tickets: int = 1, sum_floats: int = 8) -> None:
    """The last-block tickets must be zero at launch (each kernel's last block resets its own; q8_mma
    has one per row of token blocks, up to 8), and so must the GEMV's per-token sums of squares
    behind them (floats 8.. of the scratch: 8 for q8_gemv.cu, 16 for q8_gemv_hmma.cu)."""
    ticket = dev(counter, 4 * tickets, np.uint32)
    assert not ticket.any(), f"ticket counters at {counter:#x} are {ticket}, not 0, at launch"
    if sums:
        assert not dev(counter + 32, 4 * sum_floats, np.float32).any(), f"GEMV sums at {counter + 32:#x} not zero at launch"


def q8_dense(qs: int, scales: int, n: int, k: int) -> np.ndarray:
    w = dev(qs, n * k, np.int8).reshape(n, k).astype(np.float32)
    s = dev(scales, 2 * n * (k // 32), np.float16).reshape(n, k // 32).astype(np.float32)
    return (w.reshape(n, k // 32, 32) * s[:, :, None]).reshape(n, k)


def silu_mul(gate, up):
    return gate / (np.float32(1) + np.exp(-gate)) * up


def quantize_rows_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [T, K] float32 -> (hi, lo int8 [T, K/32, 32], d float32 [T, K/32]) as q8_mma.cu quantises its
    activations: d = amax / 127, hi = rn(v / d), lo = rn((v - hi d) 128 / d) (round half even, +-127)."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = np.abs(blocks).max(axis=2) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)[:, :, None]
    hi = np.clip(np.rint(blocks * inv), -127, 127)
    residual = (blocks.astype(np.float64) - hi * d[:, :, None].astype(np.float64)).astype(np.float32)   # one fma
    lo = np.clip(np.rint(residual * (inv * np.float32(128))), -127, 127)
    return hi.astype(np.int8), lo.astype(np.int8), d


def mma_product(x: np.ndarray, wq: np.ndarray, w_scales: np.ndarray, blocks_per_split: int | None = None
                ) -> np.ndarray:
    """q8_mma.cu's arithmetic: x [T, K] float32 against a Q8_0 weight (int8 [N, K], fp16 [N, K/32]):
    exact integer dot products of (128 hi + lo) per 32-block, scaled by d / 128 * w_scale into fp32
    sums, block by block; split K (blocks_per_split): one such sum per run of blocks, the runs' sums
    added in order."""
    hi, lo, d = quantize_rows_q8(x)
    n, k = wq.shape
    wb = wq.reshape(n, k // 32, 32).astype(np.float64)
    ws = w_scales.astype(np.float32)
    q = (128 * hi.astype(np.float64) + lo).transpose(1, 0, 2)                  # [K/32, T, 32]
    per_split = blocks_per_split or k // 32
    chunk = max(1, (1 << 22) // max(x.shape[0] * n, 1))       # blocks whose dot products are made at once
    total = np.zeros((x.shape[0], n), np.float32)
    for first in range(0, k // 32, per_split):
        acc = np.zeros((x.shape[0], n), np.float32)
        end = min(first + per_split, k // 32)
        for c0 in range(first, end, chunk):   # |dot| <= 32 * 127 * 127 * 129 < 2^31: exact in float64
            c1 = min(c0 + chunk, end)
            dots = (q[c0:c1] @ wb[:, c0:c1, :].transpose(1, 2, 0)).astype(np.float32)
            for b, block_dots in enumerate(dots, c0):            # the kernel's order: block by block
                acc += block_dots * ((d[:, b, None] * np.float32(1 / 128)) * ws[None, :, b])
        total = acc if first == 0 else total + acc
    return total


def q8_product(launch, qs, scales, x, ldx, inv_rms_in, y, ldy, res, normw_out, xn_out, inv_rms_out, counter,
               eps, N, K, ntok, tokens: int, silu: bool, int8_activations: bool = False,
               blocks_per_split: int | None = None) -> None:
    """The shared contract of q8_gemv.cu, q8_matmul.cu and q8_mma.cu for `tokens` rows of x."""
    assert K % 32 == 0 and qs % 16 == 0 and scales % 2 == 0, (launch.name, K, qs, scales)
    if int8_activations:
        s = mma_product(rows(x, tokens, ldx, K), dev(qs, N * K, np.int8).reshape(N, K),
                        dev(scales, 2 * N * (K // 32), np.float16).reshape(N, K // 32), blocks_per_split)
    else:
        s = rows(x, tokens, ldx, K) @ q8_dense(qs, scales, N, K).T                 # [tokens, N]
    gemv_epilogues(launch, s, inv_rms_in, y, ldy, res, normw_out, xn_out, inv_rms_out, counter, eps, N, ntok,
                   tokens, silu, sums=launch.name.startswith("q8_gemv"),
                   tickets=launch.grid[1] if int8_activations and launch.grid[1] <= 8 else 1)


def gemv_epilogues(launch, s, inv_rms_in, y, ldy, res, normw_out, xn_out, inv_rms_out, counter, eps, N, ntok,
                   tokens: int, silu: bool, sums: bool, tickets: int, sum_floats: int = 8) -> None:
    """What every GEMV/GEMM kernel does with its products s [tokens, N]: inv_rms_in, SiLU pairs, residual,
    y, xn and the last block's inv_rms (the tickets and sums it finds must be zero)."""
    assert not silu or N % 2 == 0, "SiLU pairs need an even row count"
    if inv_rms_out:
        take_ticket(counter, sums=sums, tickets=tickets, sum_floats=sum_floats)
    if inv_rms_in:
        s *= f32(inv_rms_in, tokens)[:, None]
    out = silu_mul(s[:, 0::2], s[:, 1::2]) if silu else s
    width = out.shape[1]
    if res:
        out = out + rows(res, tokens, ldy, width)
    rows(y, tokens, ldy, width)[:] = out                                        # y may alias res
    if xn_out:
        rows(xn_out, tokens, ldy, width)[:] = out * f32(normw_out, width)
    if inv_rms_out:                                      # the last block: over N columns of y, ntok tokens
        y_rows = rows(y, ntok, ldy, N)
        f32(inv_rms_out, ntok)[:] = 1.0 / np.sqrt(np.mean(np.square(y_rows), axis=1) + np.float32(eps))


def q8_gemv(launch, *args) -> None:
    name, N = launch.name, args[13]
    tokens, variant, silu = gemv_variants.parse(name)
    assert launch.block == (variant.threads, 1, 1) and launch.grid[1:] == (1, 1), launch.name
    assert launch.grid[0] * variant.rows >= N, f"{name}: grid {launch.grid} misses rows of {N}"
    x, ldx = args[2], args[3]
    assert all((x + 4 * m * ldx) % 16 == 0 for m in range(tokens)), f"{name}: x rows not 16-byte aligned"
    assert args[0] % 16 == 0 and args[14] % 16 == 0, f"{name}: 16-byte weight loads misaligned"
    q8_product(launch, *args, tokens=tokens, silu=silu)


def q8_matmul(launch, *args) -> None:
    N, ntok = args[13], args[15]
    assert launch.block == (256, 1, 1) and launch.grid[0] * 64 >= N and launch.grid[1] * 64 >= ntok, launch.grid
    q8_product(launch, *args, tokens=ntok, silu=launch.name.endswith("_silu"))


def q8_mma(launch, *args) -> None:
    x, ldx, N, K, ntok = args[2], args[3], args[13], args[14], args[15]
    partials, tickets = args[16:]
    tile, silu = mma_variants.parse(launch.name)
    gx, gy, splits = launch.grid
    assert launch.block == (tile.threads, 1, 1), f"{launch.name}: block {launch.block}"
    assert gx * tile.rows >= N and gy * tile.tokens >= ntok, \
        f"{launch.name}: grid {launch.grid} misses part of {ntok} tokens x {N} rows"
    assert ldx % 4 == 0 and x % 16 == 0, f"{launch.name}: float4 loads of x misaligned (x {x:#x}, ldx {ldx})"
    assert mma_variants.split_is_valid(K, tile, splits), f"{launch.name}: K={K} split {splits} ways"
    if splits > 1:      # a BM x BN float32 tile per block, 16-byte aligned; a zeroed ticket per output tile
        assert partials % 16 == 0, f"{launch.name}: partials at {partials:#x} not 16-byte aligned"
        dev(partials, 4 * gx * gy * splits * tile.tokens * tile.rows)
        take_ticket(tickets, tickets=gx * gy)
    q8_product(launch, *args[:16], tokens=ntok, silu=silu, int8_activations=True,
               blocks_per_split=mma_variants.blocks_per_split(K, tile, splits))


def embed_q8(launch, qs, scales, ids, out, xn, normw, inv_rms, eps, H) -> None:
    T = launch.grid[0]
    assert H % 32 == 0
    for t, row in enumerate(dev(ids, 4 * T, np.int32)):
        v = q8_dense(qs + int(row) * H, scales + 2 * int(row) * (H // 32), 1, H)[0]
        f32(out + 4 * t * H, H)[:] = v
        f32(xn + 4 * t * H, H)[:] = v * f32(normw, H)
        f32(inv_rms + 4 * t, 1)[0] = 1.0 / np.sqrt(np.mean(np.square(v)) + np.float32(eps))


def copy_words(launch, dst, src, n) -> None:
    """src: page-locked host memory read by the kernel (a fake_cuda pinned buffer), dst: device memory."""
    dev(dst, 4 * n, np.uint32)[:] = host(src, 4 * n, np.uint32)


def argmax_rows(launch, logits, V, out) -> None:
    T = launch.grid[0]
    dev(out, 4 * T, np.int32)[:] = np.argmax(rows(logits, T, V, V), axis=1)


def argmax_split(launch, logits, V, part_val, part_idx, counters, out) -> None:
    S, T = launch.grid[0], launch.grid[1]
    assert launch.block == (256, 1, 1) and 1 <= S <= 1024, launch.name
    for t in range(T):
        take_ticket(counters + 4 * t)
    dev(out, 4 * T, np.int32)[:] = np.argmax(rows(logits, T, V, V), axis=1)


def chain_advance(launch, ids, pos, kvbase, argmax_out, counter, history, scratch_base, ntok) -> None:
    assert launch.grid == (1, 1, 1) and launch.block == (32, 1, 1), launch.name
    step = int(dev(counter, 4, np.int32)[0])
    tokens = dev(argmax_out, 4 * ntok, np.int32).copy()
    dev(history + 4 * step * ntok, 4 * ntok, np.int32)[:] = tokens
    live = dev(kvbase, 8 * ntok, np.int64) != scratch_base
    dev(ids, 4 * ntok, np.int32)[live] = tokens[live]
    dev(pos, 4 * ntok, np.int32)[live] += 1
    dev(counter, 4, np.int32)[0] = step + 1


def rmsnorm(v, w, eps):
    return v / np.sqrt(np.mean(np.square(v)) + np.float32(eps)) * w


def qkv_norm_rope_append(launch, qkv, q_out, kvpool, kvbase, pos, q_norm, k_norm, inv_freq, bias, eps, layer,
                         n_layers, n_heads, n_kv, D) -> None:
    def kv_row(t, p, is_v, kv_head):
        base = int(dev(kvbase + 8 * t, 8, np.int64)[0])
        return f32(kvpool + 4 * (base + ((p * n_layers + layer) * 2 + int(is_v)) * n_kv * D + kv_head * D), D)
    rope_append(launch, qkv, q_out, kv_row, pos, q_norm, k_norm, inv_freq, bias, eps, n_heads, n_kv, D)


KV_DTYPES = {"f16": np.float16, "f32": np.float32}


def paged_rows(tables, table_row, t, block_shift, dtype, n_layers, n_kv, D):
    """(block of position p as [block_size, L, 2, n_kv, D] `dtype`) for token t's session."""
    bs = 1 << block_shift
    row = int(dev(table_row + 8 * t, 8, np.int64)[0])
    itemsize = np.dtype(dtype).itemsize

    def block(p):
        address = int(dev(tables + 8 * (row + (p >> block_shift)), 8, np.uint64)[0])
        return dev(address, bs * n_layers * 2 * n_kv * D * itemsize, dtype).reshape(bs, n_layers, 2, n_kv, D)
    return block


def tree_fields(tree: int, t: int) -> tuple[int, int, int]:
    """kv_cache.cuh's TreeRow inputs of row t: (skip, span, bits); a null `tree` is a plain row."""
    if not tree:
        return 0, 0, 0
    skip, span = (int(v) for v in dev(tree + 16 * t, 8, np.int32))
    return skip, span, int(dev(tree + 16 * t + 8, 8, np.uint64)[0])


def tree_sees(tree: int, t: int, p: int, keys: np.ndarray) -> np.ndarray:
    """TreeRow.sees over `keys` for row t at slot p: the keys before the mask's first slot, and its set bits."""
    _, span, bits = tree_fields(tree, t)
    lo = p - span + 1
    inside = np.clip(keys - lo, 0, 63).astype(np.uint64)
    return (keys < lo) | ((np.uint64(bits) >> inside) & np.uint64(1)).astype(bool)


def qkv_rope_append_paged(launch, qkv, q_out, tables, table_row, pos, q_norm, k_norm, inv_freq, bias, eps,
                          layer, n_layers, n_heads, n_kv, D, block_shift, tree=0) -> None:
    dtype = KV_DTYPES[launch.name.rsplit("_", 1)[1]]

    def kv_row(t, p, is_v, kv_head):
        block = paged_rows(tables, table_row, t, block_shift, dtype, n_layers, n_kv, D)(p)
        return block[p & ((1 << block_shift) - 1), layer, int(is_v), kv_head]      # rounds to dtype on store
    rope_append(launch, qkv, q_out, kv_row, pos, q_norm, k_norm, inv_freq, bias, eps, n_heads, n_kv, D, tree)


def rope_append(launch, qkv, q_out, kv_row, pos, q_norm, k_norm, inv_freq, bias, eps, n_heads, n_kv, D,
                tree=0) -> None:
    """qkv_rope.cu's launch: grid (n_heads + 2 n_kv, T), a warp per head."""
    heads, T = launch.grid[0], launch.grid[1]
    assert heads == n_heads + 2 * n_kv and launch.block[0] == 32
    q_row = lambda t, head: f32(q_out + 4 * (t * n_heads * D + head * D), D)
    rope_heads(T, qkv, q_row, kv_row, pos, q_norm, k_norm, inv_freq, bias, eps, n_heads, n_kv, D, tree)


def rope_heads(T, qkv, q_row, kv_row, pos, q_norm, k_norm, inv_freq, bias, eps, n_heads, n_kv, D,
               tree=0) -> None:
    """rope_head.cuh over every head of T tokens: q_row(t, head) and kv_row(t, p, is_v, kv_head) are the
    destination rows' views."""
    assert D % 2 == 0 and D <= 256
    heads = n_heads + 2 * n_kv
    width, half = heads * D, D // 2
    freqs = f32(inv_freq, half)
    for t in range(T):
        p = int(dev(pos + 4 * t, 4, np.int32)[0])
        angle = np.float32(p - tree_fields(tree, t)[0]) * np.concatenate([freqs, freqs])   # the rotary position
        cos, sin = np.cos(angle), np.sin(angle)
        for head in range(heads):
            v = f32(qkv + 4 * (t * width + head * D), D).copy()
            if bias:
                v = v + f32(bias + 4 * head * D, D)
            is_q, is_v = head < n_heads, head >= n_heads + n_kv
            if not is_v:
                norm_w = q_norm if is_q else k_norm
                if norm_w:
                    v = rmsnorm(v, f32(norm_w, D), eps)
                v = v * cos + np.concatenate([-v[half:], v[:half]]) * sin
            if is_q:
                q_row(t, head)[:] = v
            else:
                kv_row(t, p, is_v, head - n_heads - n_kv if is_v else head - n_heads)[:] = v


def attention_split(launch, q, kvpool, kvbase, pos, part_acc, part_max, part_sum, out, counters, layer,
                    n_layers, n_heads, n_kv, window, softmax_scale, min_keys) -> None:
    D = int(launch.name.rsplit("_d", 1)[1])
    stride_pos = n_layers * 2 * n_kv * D

    def keys_values(t, n_keys):
        base = int(dev(kvbase + 8 * t, 8, np.int64)[0])
        cache = rows(kvpool + 4 * (base + layer * 2 * n_kv * D), n_keys, stride_pos, 2 * n_kv * D)
        return cache[:, :n_kv * D].reshape(n_keys, n_kv, D), cache[:, n_kv * D:].reshape(n_keys, n_kv, D)
    attend(launch, D, lambda t: f32(q + 4 * t * n_heads * D, n_heads * D), keys_values, pos, part_acc, part_max,
           part_sum, out, counters, n_heads, n_kv, window, softmax_scale, min_keys)


def attention_paged(launch, q, tables, table_row, pos, part_acc, part_max, part_sum, out, counters, layer,
                    n_layers, n_heads, n_kv, window, softmax_scale, block_shift, min_keys, tree=0) -> None:
    head, dtype_name, small_group = re.fullmatch(r"attention_paged_d(\d+)_(f16|f32)(_g2)?", launch.name).groups()
    D, dtype = int(head), KV_DTYPES[dtype_name]
    assert not small_group or n_heads <= 2 * n_kv, "a _g2 kernel holds at most 2 q heads per kv head"

    keys_values = paged_keys_values(tables, table_row, block_shift, dtype, layer, n_layers, n_kv, D)
    attend(launch, D, lambda t: f32(q + 4 * t * n_heads * D, n_heads * D), keys_values, pos, part_acc, part_max,
           part_sum, out, counters, n_heads, n_kv, window, softmax_scale, min_keys, tree)


def paged_keys_values(tables, table_row, block_shift, dtype, layer, n_layers, n_kv, D):
    """keys_values(t, n_keys) of attend over the paged pool."""
    def keys_values(t, n_keys):
        block = paged_rows(tables, table_row, t, block_shift, dtype, n_layers, n_kv, D)
        bs = 1 << block_shift
        cache = np.concatenate([block(p)[:, layer] for p in range(0, n_keys, bs)])[:n_keys].astype(np.float32)
        return cache[:, 0], cache[:, 1]                                      # [n_keys, n_kv, D] each
    return keys_values


def attention_rope_paged(launch, qkv, tables, table_row, pos, q_norm, k_norm, inv_freq, bias, eps, part_acc,
                         part_max, part_sum, out, counters, layer, n_layers, n_heads, n_kv, window, softmax_scale,
                         block_shift, min_keys) -> None:
    """attention_rope.cu: the rope op (q rotated in shared memory, k and v appended), then attention."""
    head, dtype_name, small_group = re.fullmatch(r"attention_rope_paged_d(\d+)_(f16)(_g2)?(?:_w8)?", launch.name).groups()
    D, dtype = int(head), KV_DTYPES[dtype_name]
    assert bool(small_group) == (n_heads <= 2 * n_kv), "_g2 exactly where at most 2 q heads per kv head"
    T = launch.grid[1]
    sessions = [int(dev(table_row + 8 * t, 8, np.int64)[0]) for t in range(T)]
    assert len(set(sessions)) == T, f"rows of one session in one step: {sessions} (the kernel needs one each)"
    q = np.zeros((T, n_heads, D), np.float32)

    def kv_row(t, p, is_v, kv_head):
        block = paged_rows(tables, table_row, t, block_shift, dtype, n_layers, n_kv, D)(p)
        return block[p & ((1 << block_shift) - 1), layer, int(is_v), kv_head]
    rope_heads(T, qkv, lambda t, h: q[t, h], kv_row, pos, q_norm, k_norm, inv_freq, bias, eps, n_heads, n_kv, D)
    attend(launch, D, lambda t: q[t].reshape(-1), paged_keys_values(tables, table_row, block_shift, dtype, layer,
                                                                      n_layers, n_kv, D),
           pos, part_acc, part_max, part_sum, out, counters, n_heads, n_kv, window, softmax_scale, min_keys)


def attend(launch, D, queries, keys_values, pos, part_acc, part_max, part_sum, out, counters, n_heads, n_kv,
           window, softmax_scale, min_keys, tree=0) -> None:
    """attention_body.cuh; queries(t) gives token t's q [n_heads * D], keys_values(t, n_keys) its K and V
    [n_keys, n_kv, D]."""
    n_kv_grid, T, splits = launch.grid
    group = n_heads // n_kv
    assert n_kv_grid == n_kv and n_heads % n_kv == 0 and group <= 8 and group * D <= 2048 and splits <= 32
    assert launch.block == (256 if launch.name.endswith("_w8") else 128, 1, 1) and min_keys >= 1   # 8 or 4 warps
    partial_rows = T * n_heads * splits                  # the workspace must fit: [rows, D] + [rows] + [rows]
    dev(part_acc, 4 * partial_rows * D), dev(part_max, 4 * partial_rows), dev(part_sum, 4 * partial_rows)
    for t in range(T):
        for h in range(n_kv):
            take_ticket(counters + 4 * (t * n_kv + h))
        n_keys = int(dev(pos + 4 * t, 4, np.int32)[0]) + 1
        first = max(n_keys - window, 0) if window > 0 else 0
        keys, values = keys_values(t, n_keys)
        keys, values = keys[first:], values[first:]
        qt = queries(t).reshape(n_kv, group, D) * np.float32(softmax_scale)
        scores = np.einsum("hgd,phd->hgp", qt, keys)
        scores = np.where(tree_sees(tree, t, n_keys - 1, np.arange(first, n_keys)), scores, np.float32(-np.inf))
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        f32(out + 4 * t * n_heads * D, n_heads * D)[:] = np.einsum("hgp,phd->hgd", probs, values).reshape(-1)


def q8_f16mma(launch, *args) -> None:
    from fake_f16mma import q8_f16mma as twin   # its own file; it imports this one
    twin(launch, *args)


def flash_attention_paged(launch, *args) -> None:
    from fake_flash import flash_attention_paged as twin   # its own file; it imports this one
    twin(launch, *args)


from fake_block_kernels import BLOCK_KERNELS   # noqa: E402  (it uses the helpers above)
from fake_dense import DENSE_KERNELS   # noqa: E402
from fake_moe_kernels import MOE_KERNELS   # noqa: E402
from fake_hmma import HMMA_KERNELS   # noqa: E402
from fake_sample import sample_candidates, sample_finish, sample_rows   # noqa: E402

KERNELS = BLOCK_KERNELS + DENSE_KERNELS + MOE_KERNELS + HMMA_KERNELS + [
    (r"sample_rows", sample_rows),
    (r"sample_candidates", sample_candidates),
    (r"sample_finish", sample_finish),
    (r"q8_gemv_m[1-8]_[a-z0-9]+(_silu)?|q8_gemv_m[1-8](_silu)?", q8_gemv),
    (r"q8_matmul(_silu)?", q8_matmul),
    (r"q8_mma_\d+x\d+(k\d+)?(p\d+c\d+(x2)?(b\d+)?)?(_silu)?", q8_mma),
    (r"q8_f16mma_\w+", q8_f16mma),
    (r"embed_q8", embed_q8),
    (r"argmax_rows", argmax_rows),
    (r"copy_words", copy_words),
    (r"argmax_split", argmax_split),
    (r"chain_advance", chain_advance),
    (r"qkv_norm_rope_append", qkv_norm_rope_append),
    (r"attention_split_d(32|64|80|96|128|256)", attention_split),
    (r"qkv_rope_append_paged_(f16|f32)", qkv_rope_append_paged),
    (r"attention_paged_d(32|64|80|96|128|256)_(f16|f32)(_g2)?", attention_paged),
    (r"attention_rope_paged_d(64|128)_f16(_g2)?(_w8)?", attention_rope_paged),
    (r"flash_attention_paged_d(64|128)_f16", flash_attention_paged),
]
