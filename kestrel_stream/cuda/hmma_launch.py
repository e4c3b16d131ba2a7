"""Launches of kernels_ptx/q8_gemv_hmma.cu, q4k_gemv_hmma.cu and q6k_gemv_hmma.cu, the fp16 tensor-core GEMVs of a
few tokens (kernels.gemv_launch's choice for Q8_0 steps of 3..16 tokens, block_kernels.block_gemv_launch's for
Q4_K and Q6_K steps of 3..16 by shape), and whether a step takes them."""
from __future__ import annotations

from kestrel_stream.cuda.device_weight import QWeight
from kestrel_stream.cuda.gemv_variants import (HMMA_BLOCK_VARIANTS, HMMA_MAX_TOKENS, HMMA_Q4K_MIN_TOKENS, HMMA_VARIANTS,
                                               hmma_block_kernel_name, hmma_kernel_name, hmma_q4k_takes,
                                               hmma_q4k_variant)

# kernels.GEMV_SIGNATURE (kernels.py dispatches here: this module must not import it)
HMMA_SIGNATURE = "pppippipppppfiii"


def hmma_serves(kernels, tokens: int, variant: str | None) -> bool:
    """Whether a step of 9..16 tokens takes the fp16 tensor-core GEMV: asked by name, or by default unless
    KESTREL_GEMV_MN forces one of the fp32 layouts (whose steps past 8 tokens keep q8_mma).
    kernels: the kernels.KernelSet."""
    if tokens > HMMA_MAX_TOKENS:
        return False
    return variant in HMMA_VARIANTS or (variant is None and (kernels.gemv_mn is None or kernels.gemv_mn in HMMA_VARIANTS))


def hmma_launch(kernels, w: QWeight, tokens: int, silu_pairs: bool, args: list, variant: str):
    """The kernels.Launch of `variant` (a key of gemv_variants.HMMA_VARIANTS): a block per 16 x R rows."""
    shape = HMMA_VARIANTS[variant]
    return kernels.launch(hmma_kernel_name(tokens, variant, silu_pairs), (-(-w.rows // shape.rows),),
                          (shape.threads,), HMMA_SIGNATURE, args)


def q4k_hmma_serves(w: QWeight, tokens: int, variant: str | None) -> bool:
    """Whether a block-format step takes q4k_ / q6k_gemv_hmma.cu: a Q4_K or Q6_K weight of one format (no tail
    rows in another), K a whole number of super-blocks; asked by name for 2..16 tokens, by default where
    gemv_variants.hmma_q4k_takes says."""
    if w.fmt not in HMMA_BLOCK_VARIANTS or w.tail is not None or w.cols % 256:
        return False
    if variant is None:
        return hmma_q4k_takes(w.rows, w.cols, tokens, w.fmt)
    return variant in HMMA_BLOCK_VARIANTS[w.fmt] and HMMA_Q4K_MIN_TOKENS <= tokens <= HMMA_MAX_TOKENS


def q4k_hmma_launch(kernels, w: QWeight, tokens: int, silu_pairs: bool, args: list, variant: str | None):
    """The kernels.Launch of a K-quant layout (a key of gemv_variants.HMMA_BLOCK_VARIANTS[w.fmt]; None:
    hmma_q4k_variant); args: the GEMV's 16 (qs, meta for scales)."""
    variant = variant or hmma_q4k_variant(w.rows, w.cols, tokens, w.fmt)
    shape = HMMA_BLOCK_VARIANTS[w.fmt][variant]
    return kernels.launch(hmma_block_kernel_name(w.fmt, tokens, variant, silu_pairs), (-(-w.rows // shape.rows),),
                          (shape.threads,), HMMA_SIGNATURE, args)
