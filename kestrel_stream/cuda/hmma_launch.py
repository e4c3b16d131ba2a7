"""Launches of kernels_ptx/q8_gemv_hmma.cu, the fp16 tensor-core GEMV of 3..16 tokens (kernels.gemv_launch's
choice for those steps), and whether a step of 9..16 tokens takes it."""
from __future__ import annotations

from kestrel_stream.cuda.device_weight import QWeight
from kestrel_stream.cuda.gemv_variants import HMMA_MAX_TOKENS, HMMA_VARIANTS, hmma_kernel_name

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
