"""Which fp16 tensor-core layouts (kernels_ptx/q8_gemv_hmma.cu, q4k_ / q6k_gemv_hmma.cu) a bench's steps take:
the defaults, or each default's pipelined form (two steps' loads in flight a warp: the same warps, or half as
many warps with twice the steps each), for an A/B of whole steps in one process kind.

    from bench import hmma_layouts; hmma_layouts.apply("pipelined")   # before any engine is built

Modes: "default" (gemv_variants' choice), "pipelined" (the default layout + "p" where that layout exists),
"half" (HALF / HALF_BLOCK: half the warps along K, pipelined).  A layout the mode names that is not defined
leaves the default.
"""
from __future__ import annotations

from kestrel_stream.cuda import gemv_variants, hmma_launch, kernels

MODES = ("default", "pipelined", "half")
HALF = {"hk16u4": "hk8u4p", "hk8u4": "hk4u4p", "hk4u4r2": "hk2u4r2p"}
HALF_BLOCK = {"hk8": "hk4p", "hk4": "hk2p", "hk4r2": "hk2r2p", "hk2r2": "hk2r2p"}
_DEFAULTS = (gemv_variants.hmma_variant, gemv_variants.hmma_q4k_variant)


def mapped(layout: str, mode: str, half: dict, defined) -> str:
    """`layout` under `mode`, if that layout is defined (else `layout`)."""
    other = {"default": layout, "pipelined": layout + "p", "half": half.get(layout, layout)}[mode]
    return other if other in defined else layout


def apply(mode: str) -> None:
    """Make every later launch choice take `mode`'s layouts (ValueError for an unknown mode)."""
    if mode not in MODES:
        raise ValueError(f"hmma layouts {mode!r}: expected one of {', '.join(MODES)}")
    q8_default, block_default = _DEFAULTS

    def q8(rows: int) -> str:
        return mapped(q8_default(rows), mode, HALF, gemv_variants.HMMA_VARIANTS)

    def block(rows: int, cols: int, tokens: int = 8, fmt: str = "Q4_K") -> str:
        return mapped(block_default(rows, cols, tokens, fmt), mode, HALF_BLOCK, gemv_variants.HMMA_BLOCK_VARIANTS[fmt])

    gemv_variants.hmma_variant = kernels.hmma_variant = q8
    gemv_variants.hmma_q4k_variant = hmma_launch.hmma_q4k_variant = block
