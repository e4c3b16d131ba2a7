"""The block-format GEMV layouts (kernels_ptx/q4_gemv.cu, q4_gemv_m1.cu, q4_gemv_mn.cu) and which one a shape gets.

A variant is THREADS x ROWS x UNROLL: a block of THREADS threads owns ROWS weight rows and each
thread keeps ROWS * UNROLL units' loads in flight (a unit: 16 B of nibbles = 32 weights for
Q4_0/Q4_K, 3 x 16 B = 64 weights for Q6_K, which keeps half the UNROLL, rounded up).  "" is q4_gemv.cu's original kernel (64 threads, 4 rows
for 1..2 tokens, 2 for 4..8, one unit in flight per row), kept for A/B; tTrRuU are the one-token
layouts, pTrRuU the same with the next pass's units prefetched into L2 during this pass (its loads
then wait for L2, not HBM) and Q4_K's levels as subnormal floats (one FADD a weight less), gTrRuU (x
shared by the rows) and oTrRuU (row-outer) the layouts for 2..8 tokens; dTrRuU one-token layouts on
integer dot products (kernels_ptx/q4_gemv_dp4a.cuh: x quantised to two int8 levels in shared memory,
U D-units of 64 weights per row in flight, at most blocks_per_sm blocks per SM, each running several
row tiles; dTrRuUgG: G groups of T / G threads, R / G rows each).  Kernel names:
<fmt>[_<tail fmt>]_gemv_m<M>[_<variant>][_silu].  Pure Python: the emulated device, the tests and
the bench read it without a driver.
"""
from __future__ import annotations

from typing import NamedTuple


class Variant(NamedTuple):
    threads: int
    rows: int
    unroll: int
    blocks_per_sm: int = 0   # d layouts: the grid's cap per SM (0: a block per tile of rows)
    groups: int = 1          # d layouts: thread groups of a block, threads / groups of them on rows / groups rows each


LEGACY = ""
M1_VARIANTS = {"t32r4u2": Variant(32, 4, 2), "t64r8u1": Variant(64, 8, 1), "t64r4u3": Variant(64, 4, 3),
               "t128r4u3": Variant(128, 4, 3),
               # the next pass prefetched into L2, Q4_K's levels subnormal: for rows of several passes (o, down)
               "p64r8u1": Variant(64, 8, 1), "p64r4u1": Variant(64, 4, 1), "p32r4u2": Variant(32, 4, 2),
               "p64r4u3": Variant(64, 4, 3),
               # dp4a on x quantised per block (Q4_0, Q4_K, Q6_K); the cap: the
               # blocks its registers let reside (q4_gemv_m1d.cu's MIN_BLOCKS), so x is quantised once per
               # resident block; gG: G groups of threads share one quantisation over G times the rows
               "d32r4u1": Variant(32, 4, 1, 16), "d64r4u1": Variant(64, 4, 1, 8),
               "d128r8u1g2": Variant(128, 8, 1, 4, 2), "d256r16u1g4": Variant(256, 16, 1, 2, 4),
               "d128r16u1g4": Variant(128, 16, 1, 4, 4),
               "d512r32u1g8": Variant(512, 32, 1, 1, 8), "d512r16u1g8": Variant(512, 16, 1, 1, 8)}
MN_VARIANTS = {"g64r4u1": Variant(64, 4, 1), "g32r4u2": Variant(32, 4, 2), "o64r4u1": Variant(64, 4, 1),
               "o32r4u2": Variant(32, 4, 2)}
ALL_VARIANTS = (LEGACY, *M1_VARIANTS, *MN_VARIANTS)   # what Options.gemv_block (KESTREL_GEMV_BLOCK) may name
GEMV_TOKENS = (1, 2, 4, 8)             # the kernels' M; a launch of fewer tokens runs the next M up
# the (weight code, SiLU pairs) the tiled layouts are built for (q4_gemv_tiled.cuh's DEFINE_Q4_TILED_SET);
# the rest (Q6_K gate/up pairs) run the original kernel
TILED_CODES = {("q4_0", False), ("q4_0", True), ("q4_k", False), ("q4_k", True), ("q6_k", False),
               ("q4_k_q6_k", False)}
# weights per unit of each format (q4_formats.cuh's UNIT)
UNIT_WEIGHTS = {"Q4_0": 32, "Q4_K": 32, "Q6_K": 64}

# Measured winners, (weight code, M, rows, cols) → variant, as bench/block_gemv.py prints them (its
# "MEASURED = {...}" line; this table: bench/results/2026-12-01-h200-block-gemv-prefetch.md); shapes not listed take
# the rule of `choose`.
MEASURED: dict[tuple[str, int, int, int], str] = {
    ('q4_0', 1, 2048, 2048): 'd512r16u1g8', ('q4_0', 1, 2048, 6144): 'd512r16u1g8',
    ('q4_0', 1, 4096, 2048): 'p64r4u1', ('q4_0', 1, 4096, 4096): 'd256r16u1g4',
    ('q4_0', 1, 4096, 12288): 'd512r32u1g8', ('q4_0', 1, 6144, 4096): 'p64r8u1',
    ('q4_0', 1, 12288, 2048): 'd128r8u1g2', ('q4_0', 1, 24576, 4096): 'd128r16u1g4',
    ('q4_0', 1, 151936, 2048): 'd32r4u1', ('q4_0', 1, 151936, 4096): 'd128r16u1g4',
    ('q4_0', 2, 2048, 2048): 'g64r4u1', ('q4_0', 2, 2048, 6144): 'g64r4u1', ('q4_0', 2, 4096, 2048): 'g32r4u2',
    ('q4_0', 2, 4096, 4096): 'g32r4u2', ('q4_0', 2, 4096, 12288): 'g32r4u2', ('q4_0', 2, 6144, 4096): 'g32r4u2',
    ('q4_0', 2, 12288, 2048): 'g32r4u2', ('q4_0', 2, 24576, 4096): 'g32r4u2', ('q4_0', 2, 151936, 2048): 'g32r4u2',
    ('q4_0', 2, 151936, 4096): 'g32r4u2', ('q4_0', 4, 2048, 2048): 'g64r4u1', ('q4_0', 4, 2048, 6144): 'g64r4u1',
    ('q4_0', 4, 4096, 2048): 'g32r4u2', ('q4_0', 4, 4096, 4096): 'g32r4u2', ('q4_0', 4, 4096, 12288): 'g32r4u2',
    ('q4_0', 4, 6144, 4096): 'g32r4u2', ('q4_0', 4, 12288, 2048): 'g32r4u2', ('q4_0', 4, 24576, 4096): 'g32r4u2',
    ('q4_0', 4, 151936, 2048): 'g32r4u2', ('q4_0', 4, 151936, 4096): 'g32r4u2', ('q4_0', 8, 2048, 2048): 'g64r4u1',
    ('q4_0', 8, 2048, 6144): 'g64r4u1', ('q4_0', 8, 4096, 2048): 'g32r4u2', ('q4_0', 8, 4096, 4096): 'g32r4u2',
    ('q4_0', 8, 4096, 12288): 'g32r4u2', ('q4_0', 8, 6144, 4096): 'g32r4u2', ('q4_0', 8, 12288, 2048): 'g32r4u2',
    ('q4_0', 8, 24576, 4096): 'g32r4u2', ('q4_0', 8, 151936, 2048): 'g32r4u2', ('q4_0', 8, 151936, 4096): 'g32r4u2',
    ('q4_k', 1, 2048, 2048): 't64r4u3', ('q4_k', 1, 2048, 6144): 'p64r4u3', ('q4_k', 1, 4096, 2048): 'p64r8u1',
    ('q4_k', 1, 4096, 4096): 'p64r8u1', ('q4_k', 1, 4096, 12288): 'd512r32u1g8', ('q4_k', 1, 6144, 4096): 'p64r8u1',
    ('q4_k', 1, 12288, 2048): 'p64r8u1', ('q4_k', 1, 24576, 4096): 'd128r16u1g4',
    ('q4_k', 1, 151936, 2048): 'd32r4u1', ('q4_k', 1, 151936, 4096): 'd64r4u1', ('q4_k', 2, 2048, 2048): 'g64r4u1',
    ('q4_k', 2, 2048, 6144): 'g64r4u1', ('q4_k', 2, 4096, 2048): 'g32r4u2', ('q4_k', 2, 4096, 4096): 'g32r4u2',
    ('q4_k', 2, 4096, 12288): 'g32r4u2', ('q4_k', 2, 6144, 4096): 'g64r4u1', ('q4_k', 2, 12288, 2048): 'g64r4u1',
    ('q4_k', 2, 24576, 4096): 'g64r4u1', ('q4_k', 2, 151936, 2048): 'g32r4u2', ('q4_k', 2, 151936, 4096): 'g64r4u1',
    ('q4_k', 4, 2048, 2048): 'g64r4u1', ('q4_k', 4, 2048, 6144): 'g64r4u1', ('q4_k', 4, 4096, 2048): 'g32r4u2',
    ('q4_k', 4, 4096, 4096): 'g32r4u2', ('q4_k', 4, 4096, 12288): 'g32r4u2', ('q4_k', 4, 6144, 4096): 'g64r4u1',
    ('q4_k', 4, 12288, 2048): 'g64r4u1', ('q4_k', 4, 24576, 4096): 'g64r4u1', ('q4_k', 4, 151936, 2048): 'g32r4u2',
    ('q4_k', 4, 151936, 4096): 'g64r4u1', ('q4_k', 8, 2048, 2048): 'g64r4u1', ('q4_k', 8, 2048, 6144): 'g64r4u1',
    ('q4_k', 8, 4096, 2048): 'g32r4u2', ('q4_k', 8, 4096, 4096): 'g32r4u2', ('q4_k', 8, 4096, 12288): 'g32r4u2',
    ('q4_k', 8, 6144, 4096): 'g64r4u1', ('q4_k', 8, 12288, 2048): 'g64r4u1', ('q4_k', 8, 24576, 4096): 'g64r4u1',
    ('q4_k', 8, 151936, 2048): 'g32r4u2', ('q4_k', 8, 151936, 4096): 'g64r4u1',
    ('q4_k_q6_k', 1, 4096, 2048): 'p32r4u2', ('q4_k_q6_k', 1, 6144, 4096): 'p32r4u2',
    ('q4_k_q6_k', 2, 4096, 2048): 'g32r4u2', ('q4_k_q6_k', 2, 6144, 4096): 'g64r4u1',
    ('q4_k_q6_k', 4, 4096, 2048): 'g32r4u2', ('q4_k_q6_k', 4, 6144, 4096): 'g64r4u1',
    ('q4_k_q6_k', 8, 4096, 2048): 'g32r4u2', ('q4_k_q6_k', 8, 6144, 4096): 'g64r4u1',
    ('q6_k', 1, 2048, 2048): 't64r4u3', ('q6_k', 1, 2048, 6144): 't64r4u3', ('q6_k', 1, 4096, 2048): 'p32r4u2',
    ('q6_k', 1, 4096, 4096): 't64r8u1', ('q6_k', 1, 4096, 12288): 't64r8u1', ('q6_k', 1, 6144, 4096): 'p32r4u2',
    ('q6_k', 1, 12288, 2048): 't32r4u2', ('q6_k', 1, 24576, 4096): 'p64r4u1', ('q6_k', 1, 151936, 2048): 'p32r4u2',
    ('q6_k', 1, 151936, 4096): 'p64r4u1', ('q6_k', 2, 2048, 2048): 'g32r4u2', ('q6_k', 2, 2048, 6144): 'g64r4u1',
    ('q6_k', 2, 4096, 2048): 'g32r4u2', ('q6_k', 2, 4096, 4096): 'g32r4u2', ('q6_k', 2, 4096, 12288): 'g32r4u2',
    ('q6_k', 2, 6144, 4096): 'g32r4u2', ('q6_k', 2, 12288, 2048): 'g32r4u2', ('q6_k', 2, 24576, 4096): 'g64r4u1',
    ('q6_k', 2, 151936, 2048): 'g32r4u2', ('q6_k', 2, 151936, 4096): 'g32r4u2', ('q6_k', 4, 2048, 2048): 'g32r4u2',
    ('q6_k', 4, 2048, 6144): 'g64r4u1', ('q6_k', 4, 4096, 2048): 'g32r4u2', ('q6_k', 4, 4096, 4096): 'g32r4u2',
    ('q6_k', 4, 4096, 12288): 'g64r4u1', ('q6_k', 4, 6144, 4096): 'g64r4u1', ('q6_k', 4, 12288, 2048): 'g32r4u2',
    ('q6_k', 4, 24576, 4096): 'g32r4u2', ('q6_k', 4, 151936, 2048): 'g32r4u2', ('q6_k', 4, 151936, 4096): 'g32r4u2',
    ('q6_k', 8, 2048, 2048): 'g32r4u2', ('q6_k', 8, 2048, 6144): 'g64r4u1', ('q6_k', 8, 4096, 2048): 'g32r4u2',
    ('q6_k', 8, 4096, 4096): 'g64r4u1', ('q6_k', 8, 4096, 12288): 'g64r4u1', ('q6_k', 8, 6144, 4096): 'g64r4u1',
    ('q6_k', 8, 12288, 2048): 'g32r4u2', ('q6_k', 8, 24576, 4096): 'g32r4u2', ('q6_k', 8, 151936, 2048): 'g32r4u2',
    ('q6_k', 8, 151936, 4096): 'g64r4u1'
}


def gemv_m(tokens: int) -> int:
    return next(m for m in GEMV_TOKENS if m >= tokens)


def legacy_rows(m: int) -> int:
    """Rows per block of q4_gemv.cu's M-token kernel (its GemvRows)."""
    return 4 if m <= 2 else 2


def variants(m: int) -> dict[str, Variant]:
    """Every layout of the M-token kernels, the original one first."""
    legacy = {LEGACY: Variant(64, legacy_rows(m), 1)}
    return {**legacy, **(M1_VARIANTS if m == 1 else MN_VARIANTS)}


def units_in_flight(fmt: str, variant: Variant) -> int:
    """Units each thread loads per row and pass: Q6_K's three-load units keep half the unroll (rounded up)."""
    return -(-variant.unroll // 2) if fmt == "Q6_K" else variant.unroll


def has_tiled(code: str, silu: bool) -> bool:
    return (code, silu) in TILED_CODES


def choose(code: str, fmt: str, rows: int, cols: int, tokens: int, silu: bool = False,
           forced: str | None = None, preferred: str | None = None) -> str:
    """The layout for a block-format GEMV of a rows x cols weight over `tokens` (1..8) tokens.

    `forced` (a name of variants(M): the `variant` of a launch) wins; then `preferred` (Options.gemv_block,
    KESTREL_GEMV_BLOCK) where it is a layout of M-token kernels; then MEASURED; then a rule from the row length: one token
    takes the layout that covers a row in whole passes with the least idle threads (loads in flight
    per thread over passes, as q8's measured table prefers), the vocabulary projection a long grid
    of one-warp blocks; 2..8 tokens the 64-thread layout with x shared by the rows.
    """
    m = gemv_m(tokens)
    if forced is not None:
        assert forced in variants(m), f"no block-format GEMV layout {forced!r} for {m} tokens: {sorted(variants(m))}"
        return forced if forced == LEGACY or has_tiled(code, silu) else LEGACY
    if preferred is not None and preferred in variants(m):
        return preferred if preferred == LEGACY or has_tiled(code, silu) else LEGACY
    if not has_tiled(code, silu):
        return LEGACY
    measured = MEASURED.get((code, m, rows, cols))
    if measured is not None:
        return measured
    if m > 1:
        return "g64r4u1"     # x read once per token for all rows: 1/ROWS of the row-outer L1 traffic
    if rows >= 65536:
        return "t32r4u2"
    units = cols // UNIT_WEIGHTS[fmt]

    def idle_then_passes(name: str) -> tuple[float, int]:
        v = M1_VARIANTS[name]   # the t layouts only: the p ones are chosen by measurement
        per_pass = v.threads * units_in_flight(fmt, v)
        passes = -(-units // per_pass)
        return 1 - units / (passes * per_pass), passes

    rule_layouts = [name for name in M1_VARIANTS if name.startswith("t")]
    return min(rule_layouts, key=idle_then_passes)   # ties: the first listed (fewer threads, more blocks)


def kernel_name(code: str, m: int, variant: str, silu: bool) -> str:
    return f"{code}_gemv_m{m}" + (f"_{variant}" if variant else "") + ("_silu" if silu else "")


def parse(name: str) -> tuple[str, int, str, bool]:
    """(weight code, M, variant, silu) of a block-format GEMV kernel name."""
    silu = name.endswith("_silu")
    core = name[:-len("_silu")] if silu else name
    code, _, tail = core.partition("_gemv_m")
    head, _, variant = tail.partition("_")
    m = int(head)
    assert variant in variants(m), f"{name}: unknown layout {variant!r}"
    assert variant == LEGACY or has_tiled(code, silu), f"{name}: no tiled kernel for {code}"
    return code, m, variant, silu


def grid_blocks(variant: Variant, head_rows: int, tail_rows: int, sm_count: int = 0) -> int:
    """Blocks of a launch: each format part's rows in tiles of variant.rows, a block per tile, or for a d
    layout at most blocks_per_sm per SM (sm_count: the device's)."""
    tiles = -(-head_rows // variant.rows) + -(-tail_rows // variant.rows)
    if variant.blocks_per_sm and sm_count:
        return min(tiles, variant.blocks_per_sm * sm_count)
    return tiles


def is_dp4a(variant: str) -> bool:
    return variant.startswith("d")


def dp4a_shared_bytes(code: str, cols: int) -> int:
    """Dynamic shared memory of a d layout's kernel (every weight code): x quantised as q4_gemv_dp4a.cuh
    keeps it, per 64 elements 64 B of hi and lo bytes, a float4 of scales and sums per 32, one of sums per 16."""
    return 160 * -(-cols // 64)

