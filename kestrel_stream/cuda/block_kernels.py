"""Launches of the 4/6-bit block-format kernels (kernels_ptx/q4_gemv.cu, q4_mma.cu) and their weights.

A block-format QWeight points at its image's qs and meta parts (model/quant4.image_layout);
a weight whose last rows are in a second format (a fused QKV with Q6_K v rows) carries them as
its `tail`.  Kernel names: <fmt>[_<tail fmt>]_gemv_m<M>[_<layout>][_silu] for 1..8 tokens (M = 1,
2, 4, 8: the next one up; layouts: cuda/q4_gemv_variants.py), <fmt>[_<tail fmt>]_mma[16][_silu] beyond
(MMA_TILES: 16-token tiles up to SMALL_TILE_MAX_TOKENS tokens, 64-token ones past that, K split over
the grid's z where the row tiles are too few to fill the GPU: mma_splits); embed_<fmt> for the
embedding gather.

Every path dequantizes in its load stage: the weights stay in their blocks, never copied per step.
"""
from __future__ import annotations

from typing import NamedTuple

from kestrel_stream.cuda import q4_gemv_variants
from kestrel_stream.cuda.device_weight import QWeight
from kestrel_stream.cuda.hmma_launch import q4k_hmma_launch, q4k_hmma_serves
from scheduler.ops import BLOCK_FORMATS

# kernels.GEMV_SIGNATURE + qs_b, meta_b, rows_a (kernels.py dispatches here: this module must not import it)
BLOCK_GEMV_SIGNATURE = "pppippipppppfiii" + "ppi"
GEMV_MAX_TOKENS = 8                               # kernels.GEMV_MAX_TOKENS
# from 6 tokens the int8 tensor-core GEMM: on the H200 a 6 / 8-token step on qwen3-8b Q4_K_M 8.60 / 8.51 ms
# against the GEMVs' 9.70 / 11.90 (at 5: 8.71 against 8.60; qwen3-1.7b the same turn),
# bench/results/2026-12-04-h200-hmma-steploop.md.  Options.block_mma_min_tokens moves it (2..9).
MMA_MIN_TOKENS = 6
GEMV_TOKENS = q4_gemv_variants.GEMV_TOKENS       # the GEMV kernels' M
BLOCK_MMA_SIGNATURE = BLOCK_GEMV_SIGNATURE + "pp"  # + split K's partials and tickets
MMA_ROWS, MMA_THREADS, MMA_K_STEP = 64, 128, 128  # q4_mma.cu's QM_BN, QM_THREADS, QM_BK


class MmaTile(NamedTuple):
    """A token tile of q4_mma.cu: `tokens` per block (its BM), kernel name suffix after _mma."""
    tokens: int
    suffix: str


MMA_TILES = {"mma": MmaTile(64, ""), "mma16": MmaTile(16, "16")}
MMA_TOKENS = MMA_TILES["mma"].tokens             # the prefill-sized tile's tokens per block
SMALL_TILE_MAX_TOKENS = 64    # up to here the 16-token tile (where the 64-token one's grid is small)
# 17..64 tokens: the 64-token tile once its grid has this many row tiles per SM -- then every SM has
# blocks, and each weight stage is decoded once per 64 tokens rather than once per 16
WIDE_ROW_TILES_PER_SM = 2
# Split K: blocks a split launch aims at per SM, the most splits, and the fewest K stages a split walks
# (the next stage's weights are loaded while one computes).  Not yet measured on the GPU: a few blocks
# per SM resident, as q8_mma.cu's splits aim at (mma_variants.SPLIT_TARGET_BLOCKS); bench/steps.py shows
# the step times these give.
MMA_BLOCKS_PER_SM = 4
MMA_MAX_SPLITS = 16
MMA_MIN_SPLIT_STAGES = 2
# format → (qs bytes, meta bytes) per block (model/quant4.SPLITS)
PART_BYTES = {"Q8_0": (32, 2), "Q4_0": (16, 2), "Q4_K": (128, 16), "Q6_K": (192, 18)}
# the (format, tail format) pairs the kernels are built for
KERNEL_FORMATS = (("Q4_0", None), ("Q4_K", None), ("Q6_K", None), ("Q4_K", "Q6_K"))


gemv_rows = q4_gemv_variants.legacy_rows     # kept importable: rows per block of q4_gemv.cu's kernel
gemv_m = q4_gemv_variants.gemv_m


def _code(w: QWeight) -> str:
    return w.fmt.lower() + (f"_{w.tail.fmt.lower()}" if w.tail is not None else "")


def weight_bytes(w: QWeight) -> int:
    parts = [w] if w.tail is None else [w, w.tail]
    rows = [w.rows - (w.tail.rows if w.tail else 0)] + ([w.tail.rows] if w.tail else [])
    return sum(n * (w.cols // BLOCK_FORMATS[p.fmt][0]) * BLOCK_FORMATS[p.fmt][1] for p, n in zip(parts, rows))


def mma_tile(tokens: int, row_tiles: int = 0, sm_count: int = 132) -> str:
    """The token tile of a block-format GEMM over `tokens` tokens of a weight of `row_tiles` row tiles:
    16 tokens up to 16; up to SMALL_TILE_MAX_TOKENS unless the row tiles alone fill the SMs
    (WIDE_ROW_TILES_PER_SM); 64 beyond."""
    if tokens <= MMA_TILES["mma16"].tokens:
        return "mma16"
    if tokens <= SMALL_TILE_MAX_TOKENS and row_tiles < WIDE_ROW_TILES_PER_SM * sm_count:
        return "mma16"
    return "mma"


def mma_stages(cols: int) -> int:
    return -(-cols // MMA_K_STEP)


def split_is_valid(cols: int, splits: int) -> bool:
    """Every one of `splits` runs of ceil(stages / splits) K stages is non-empty (q4_mma.cu's split rule)."""
    total = mma_stages(cols)
    return splits == 1 or (1 <= splits <= total and (splits - 1) * -(-total // splits) < total)


def mma_grid(w: QWeight, tokens: int, tile: str, splits: int = 1) -> tuple[int, int, int]:
    """Row tiles of each format part, token tiles, K splits."""
    head_rows = w.rows - (w.tail.rows if w.tail else 0)
    return (-(-head_rows // MMA_ROWS) + -(-(w.rows - head_rows) // MMA_ROWS),
            -(-tokens // MMA_TILES[tile].tokens), splits)


def split_floats(w: QWeight, tokens: int, tile: str, splits: int) -> tuple[int, int]:
    """(partial floats, tickets) a split launch needs: a tile of fp32 per block, a ticket per output tile."""
    if splits == 1:
        return 0, 0
    gx, gy, _ = mma_grid(w, tokens, tile, splits)
    return gx * gy * splits * MMA_TILES[tile].tokens * MMA_ROWS, gx * gy


def mma_splits(w: QWeight, tokens: int, tile: str, sm_count: int, scratch) -> int:
    """K splits for a GEMM of `tokens` tokens: about MMA_BLOCKS_PER_SM blocks per SM, each split at least
    MMA_MIN_SPLIT_STAGES stages, none empty, within `scratch` (mma_variants.SplitScratch; None: 1)."""
    if scratch is None:
        return 1
    gx, gy, _ = mma_grid(w, tokens, tile)
    tiles, stages = gx * gy, mma_stages(w.cols)
    splits = max(1, min(-(-MMA_BLOCKS_PER_SM * sm_count // tiles), stages // MMA_MIN_SPLIT_STAGES, MMA_MAX_SPLITS))
    while splits > 1:
        splits = -(-stages // -(-stages // splits))        # the same runs, none left empty
        partial_floats, tickets = split_floats(w, tokens, tile, splits)
        if partial_floats <= scratch.partial_floats and tickets <= scratch.ticket_count:
            return splits
        splits -= 1
    return 1


def parse_mma_variant(variant: str) -> tuple[str, int | None]:
    """(tile, splits or None for the chosen count) of a GEMM variant: "mma16", "mma16s4", "mma", "mmas2"."""
    for tile in sorted(MMA_TILES, key=len, reverse=True):
        if variant == tile:
            return tile, None
        if variant.startswith(tile + "s") and variant[len(tile) + 1:].isdigit():
            return tile, int(variant[len(tile) + 1:])
    raise ValueError(f"not a block-format GEMM variant: {variant!r} ({', '.join(MMA_TILES)}, optionally + s<splits>)")


def is_mma_variant(variant: str | None) -> bool:
    return variant is not None and variant.startswith("mma")


def block_gemv_launch(kernels, w: QWeight, x: int, ldx: int, y: int, ldy: int, tokens: int, *,
                      silu_pairs: bool = False, inv_rms_in: int = 0, res: int = 0, normw_out: int = 0,
                      xn_out: int = 0, inv_rms_out: int = 0, counter: int = 0, eps: float = 1e-6,
                      variant: str | None = None, split_scratch=None):
    """kernels.gemv_launch for a block-format weight (same contract); `kernels`: a KernelSet.  variant: a
    GEMV layout of q4_gemv_variants.variants(M) for 1..8 tokens (default: q4_gemv_variants.choose, which
    takes the kernel set's gemv_block, KESTREL_GEMV_BLOCK, where it fits), a GEMM tile of MMA_TILES
    (+ "s<splits>"), for any token count, or a K-quant layout of gemv_variants.HMMA_BLOCK_VARIANTS for 2..16.
    By default a Q4_K or Q6_K weight of one format takes the fp16 tensor-core GEMV (q4k_ / q6k_gemv_hmma.cu)
    for 3..16 tokens where gemv_variants.hmma_q4k_takes says, unless KESTREL_BLOCK_MMA_MIN_TOKENS or
    KESTREL_GEMV_BLOCK is set; other steps the GEMM from the kernel set's block_mma_min_tokens or
    MMA_MIN_TOKENS tokens on, the GEMVs below.  split_scratch: the partials and tickets split launches share
    (mma_variants.SplitScratch; None: K is not split)."""
    tail = w.tail
    assert (w.fmt, tail.fmt if tail else None) in KERNEL_FORMATS, f"no kernel for {w.fmt} then {tail and tail.fmt}"
    assert not (silu_pairs and tail), "gate/up rows share one format"
    head_rows = w.rows - (tail.rows if tail else 0)
    args = [w.qs, w.scales, x, ldx, inv_rms_in, y, ldy, res, normw_out, xn_out, inv_rms_out, counter, eps,
            w.rows, w.cols, tokens, (tail or w).qs, (tail or w).scales, head_rows]
    silu = "_silu" if silu_pairs else ""
    min_tokens = kernels.block_mma_min_tokens or MMA_MIN_TOKENS
    forced = kernels.block_mma_min_tokens is not None or kernels.gemv_block is not None   # the older choices
    if q4k_hmma_serves(w, tokens, variant) and not (variant is None and forced):
        launch = q4k_hmma_launch(kernels, w, tokens, silu_pairs, args[:16], variant)
    elif tokens > GEMV_MAX_TOKENS or is_mma_variant(variant) or (tokens >= min_tokens and variant is None):
        sm_count = kernels.device.sm_count
        tile, splits = (parse_mma_variant(variant) if variant is not None
                        else (mma_tile(tokens, mma_grid(w, tokens, "mma")[0], sm_count), None))
        if splits is None:
            splits = mma_splits(w, tokens, tile, sm_count, split_scratch)
        assert split_is_valid(w.cols, splits), f"K={w.cols} cannot be split {splits} ways (none left empty)"
        partial_floats, tickets = split_floats(w, tokens, tile, splits)
        if splits > 1:
            assert split_scratch is not None and partial_floats <= split_scratch.partial_floats \
                and tickets <= split_scratch.ticket_count, f"{tile}s{splits}: needs {partial_floats} partial floats"
        split_args = [split_scratch.partials, split_scratch.tickets] if splits > 1 else [0, 0]
        launch = kernels.launch(f"{_code(w)}_mma{MMA_TILES[tile].suffix}{silu}", mma_grid(w, tokens, tile, splits),
                                (MMA_THREADS,), BLOCK_MMA_SIGNATURE, args + split_args)
    else:
        m, code = gemv_m(tokens), _code(w)
        name = q4_gemv_variants.choose(code, w.fmt, w.rows, w.cols, tokens, silu_pairs, variant,
                                       kernels.gemv_block)
        layout = q4_gemv_variants.variants(m)[name]
        shared = q4_gemv_variants.dp4a_shared_bytes(code, w.cols) if q4_gemv_variants.is_dp4a(name) else 0
        sm_count = kernels.device.sm_count if layout.blocks_per_sm else 0   # the d layouts' grid cap
        launch = kernels.launch(q4_gemv_variants.kernel_name(code, m, name, silu_pairs),
                                (q4_gemv_variants.grid_blocks(layout, head_rows, w.rows - head_rows, sm_count),),
                                (layout.threads,), BLOCK_GEMV_SIGNATURE, args, shared)
    return launch.label(flops=2 * w.rows * w.cols * tokens, bytes=weight_bytes(w))


def embed_kernel(w: QWeight) -> str:
    """The embedding gather kernel for a table in w's format (elementwise.cu's embed_q8 for Q8_0)."""
    assert w.tail is None
    return "embed_q8" if w.fmt == "Q8_0" else f"embed_{w.fmt.lower()}"


def qweight_rows(w: QWeight, lo: int, hi: int) -> QWeight:
    """Rows [lo, hi) of a device weight as a weight of its own (views: rows are independent)."""
    assert 0 <= lo < hi <= w.rows
    head_rows = w.rows - (w.tail.rows if w.tail else 0)
    if lo >= head_rows:
        return qweight_rows(QWeight(w.tail.qs, w.tail.scales, w.tail.rows, w.cols, w.tail.fmt), lo - head_rows,
                            hi - head_rows)
    elements = BLOCK_FORMATS[w.fmt][0]
    qs_row, meta_row = (b * (w.cols // elements) for b in PART_BYTES[w.fmt])
    top = min(hi, head_rows)
    head = QWeight(w.qs + lo * qs_row, w.scales + lo * meta_row, top - lo, w.cols, w.fmt)
    if hi <= head_rows:
        return head
    tail = qweight_rows(QWeight(w.tail.qs, w.tail.scales, w.tail.rows, w.cols, w.tail.fmt), 0, hi - head_rows)
    return QWeight(head.qs, head.scales, hi - lo, w.cols, w.fmt, tail=tail)
