"""numpy twins of the 4/6-bit block-format kernels (kernels_ptx/q4_gemv.cu, q4_mma.cu), for fake_cuda.

The weight comes back from the device image's qs and meta parts as GGUF blocks (quant4_reference.join_blocks),
so a wrong pointer, stride or part offset gives wrong numbers.  The GEMV twin multiplies by the
dequantized weight (fp32, like the kernel); the GEMM twin repeats q4_mma.cu's int8 arithmetic:
x in two int8 levels per token and group of 16, exact integer dots with the weight's levels,
scaled by d/128 * s, less xsum * o.  Each checks the launch shape (the GEMV's layout from its name:
cuda/q4_gemv_variants.py; the GEMM's token tile from its name and K split from the grid's z), the
alignment of every vector load and that a single-format kernel covers all N rows.  A split GEMM's sum
of fp32 partials is the unsplit sum in another order: within the GEMM's tolerance.
"""
from __future__ import annotations

import re

import numpy as np

from fake_cuda import dev
from kestrel_stream.cuda import q4_gemv_variants
from kestrel_stream.cuda.block_kernels import MMA_ROWS, MMA_THREADS, MMA_TILES, PART_BYTES, split_is_valid
from kestrel_stream.model.quant4 import dequantize_blocks
from quant4_reference import group_form, join_blocks
from scheduler.ops import BLOCK_FORMATS

META_ALIGN = {"Q4_0": 2, "Q4_K": 16, "Q6_K": 2}     # the widest load of each format's meta


def part_blocks(qs: int, meta: int, fmt: str, rows: int, cols: int) -> np.ndarray:
    """GGUF blocks uint8 [rows, ...] of one format part of an image in device memory."""
    assert qs % 16 == 0 and meta % META_ALIGN[fmt] == 0, f"{fmt} part at qs {qs:#x}, meta {meta:#x} misaligned"
    elements = BLOCK_FORMATS[fmt][0]
    assert cols % elements == 0, f"{fmt}: K={cols} is not a multiple of {elements}"
    qs_row, meta_row = (b * (cols // elements) for b in PART_BYTES[fmt])
    return join_blocks(dev(qs, rows * qs_row).reshape(rows, -1), dev(meta, rows * meta_row).reshape(rows, -1),
                       fmt, cols)


def parts(name: str, args) -> list[tuple[str, np.ndarray]]:
    """(format, blocks) of the weight's head and tail rows."""
    qs, meta, N, K, qs_b, meta_b, rows_a = args[0], args[1], args[13], args[14], args[16], args[17], args[18]
    head, tail = re.match(r"(q4_0|q4_k|q6_k)(?:_(q6_k))?_", name).groups()
    head = head.upper()
    if tail is None:
        assert rows_a == N, f"{name}: a one-format kernel computes rows [0, rows_a) only, rows_a {rows_a} != N {N}"
        return [(head, part_blocks(qs, meta, head, N, K))]
    assert 0 < rows_a < N
    return [(head, part_blocks(qs, meta, head, rows_a, K)), (tail.upper(), part_blocks(qs_b, meta_b, tail.upper(),
                                                                                    N - rows_a, K))]


def dense(name: str, args) -> np.ndarray:
    K = args[14]
    return np.concatenate([dequantize_blocks(b.reshape(-1, BLOCK_FORMATS[fmt][1]), fmt).reshape(b.shape[0], K)
                           for fmt, b in parts(name, args)])


def _blocks_per_part(args, rows_per_block: int) -> int:
    N, rows_a = args[13], args[18]
    return -(-rows_a // rows_per_block) + -(-(N - rows_a) // rows_per_block)


def q4_gemv(launch, *args) -> None:
    import fake_kernels as fk
    x, ldx, N, K, ntok = args[2], args[3], args[13], args[14], args[15]
    _code, m, variant, silu = q4_gemv_variants.parse(launch.name)
    if q4_gemv_variants.is_dp4a(variant):
        from fake_dp4a import q4_gemv_dp4a     # (it imports this module)
        return q4_gemv_dp4a(launch, *args)
    layout = q4_gemv_variants.variants(m)[variant]
    assert 1 <= ntok <= m and (m == 1 or ntok > m // 2), f"{launch.name} for {ntok} tokens"
    assert launch.block == (layout.threads, 1, 1) and launch.grid[1:] == (1, 1), launch.name
    assert launch.grid[0] == _blocks_per_part(args, layout.rows), f"{launch.name}: grid {launch.grid}"
    assert not silu or layout.rows % 2 == 0, f"{launch.name}: (gate, up) pairs split across blocks"
    assert all((x + 4 * t * ldx) % 16 == 0 for t in range(ntok)), f"{launch.name}: x rows not 16-byte aligned"
    s = fk.rows(x, ntok, ldx, K) @ dense(launch.name, args).T
    fk.gemv_epilogues(launch, s, *args[4:13], N, ntok, ntok, bool(silu), sums=True, tickets=1)


def quantize_groups(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x [T, K] → (hi, lo int8 [T, K/16, 16], d float32 [T, K/16], xsum [T, K/16]) as q4_mma.cu's store_x."""
    groups = x.reshape(x.shape[0], -1, 16).astype(np.float32)
    d = np.abs(groups).max(axis=2) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)[:, :, None]
    hi = np.clip(np.rint(groups * inv), -127, 127)
    residual = (groups.astype(np.float64) - hi * d[:, :, None].astype(np.float64)).astype(np.float32)   # one fma
    lo = np.clip(np.rint(residual * (inv * np.float32(128))), -127, 127)
    return hi, lo, d, groups.sum(axis=2, dtype=np.float32)


def mma_product(xs: np.ndarray, fmt: str, blocks: np.ndarray, K: int) -> np.ndarray:
    """q4_mma.cu's arithmetic: x [T, K] float32 against `blocks` of `fmt` ([n, K] weights), x in two int8
    levels per group of 16 (stages of 128, zeros past K), exact integer dots, a group's scale and min each."""
    padded = np.zeros((xs.shape[0], -(-K // 128) * 128), np.float32)
    padded[:, :K] = xs
    hi, lo, d, xsum = quantize_groups(padded)
    q = (128 * hi + lo).astype(np.float64)                          # exact integers
    levels, s_w, o_w = group_form(blocks, fmt, K)
    n = levels.shape[0]
    acc = np.zeros((xs.shape[0], n), np.float32)
    w = levels.reshape(n, -1, 16).astype(np.float64)
    for g in range(K // 16):
        dots = (q[:, g, :] @ w[:, g, :].T).astype(np.float32)
        acc += dots * ((d[:, g, None] * np.float32(1 / 128)) * s_w[None, :, g])
        acc -= xsum[:, g, None] * o_w[None, :, g]
    return acc


def q4_mma(launch, *args) -> None:
    import fake_kernels as fk
    x, ldx, N, K, ntok = args[2], args[3], args[13], args[14], args[15]
    partials, tickets = args[19:21]
    silu = launch.name.endswith("_silu")
    tile = "mma16" if re.search(r"_mma16(_silu)?$", launch.name) else "mma"
    splits = launch.grid[2]
    assert launch.block == (MMA_THREADS, 1, 1), launch.name
    assert launch.grid[0] == _blocks_per_part(args, MMA_ROWS) and \
        launch.grid[1] == -(-ntok // MMA_TILES[tile].tokens), \
        f"{launch.name}: grid {launch.grid} for {ntok} tokens x {N} rows"
    assert split_is_valid(K, splits), f"{launch.name}: K={K} split {splits} ways leaves a split empty"
    if splits > 1:      # a tile of fp32 per block, 16-byte aligned; a zeroed ticket per output tile
        count = launch.grid[0] * launch.grid[1]
        floats = count * splits * MMA_TILES[tile].tokens * MMA_ROWS
        assert partials % 16 == 0, f"{launch.name}: partials at {partials:#x} not 16-byte aligned"
        dev(partials, 4 * floats)
        fk.take_ticket(tickets, tickets=count)
    else:
        assert partials == 0 and tickets == 0, f"{launch.name}: an unsplit launch is given split scratch"
    xs = fk.rows(x, ntok, ldx, K)
    s = np.concatenate([mma_product(xs, fmt, blocks, K) for fmt, blocks in parts(launch.name, args)], axis=1)
    fk.gemv_epilogues(launch, s, *args[4:13], N, ntok, ntok, silu, sums=False,
                      tickets=launch.grid[1] if launch.grid[1] <= 8 else 1)


def embed_blocks(launch, qs, meta, ids, out, xn, normw, inv_rms, eps, H) -> None:
    import fake_kernels as fk
    fmt = launch.name.removeprefix("embed_").upper()
    elements, nbytes = BLOCK_FORMATS[fmt]
    qs_row, meta_row = (b * (H // elements) for b in PART_BYTES[fmt])
    for t, row in enumerate(dev(ids, 4 * launch.grid[0], np.int32)):
        blocks = part_blocks(qs + int(row) * qs_row, meta + int(row) * meta_row, fmt, 1, H)
        v = dequantize_blocks(blocks.reshape(-1, nbytes), fmt).reshape(H)
        fk.f32(out + 4 * t * H, H)[:] = v
        fk.f32(xn + 4 * t * H, H)[:] = v * fk.f32(normw, H)
        fk.f32(inv_rms + 4 * t, 1)[0] = 1.0 / np.sqrt(np.mean(np.square(v)) + np.float32(eps))


BLOCK_KERNELS = [
    (r"(q4_0|q4_k|q6_k)(_q6_k)?_gemv_m[1248](_[a-z0-9]+)?(_silu)?", q4_gemv),
    (r"(q4_0|q4_k|q6_k)(_q6_k)?_mma(16)?(_silu)?", q4_mma),
    (r"embed_(q4_0|q4_k|q6_k)", embed_blocks),
]
