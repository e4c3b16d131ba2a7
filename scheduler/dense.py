"""Which projections of a gpu-mode step run as a library GEMM (cuBLAS, fp16 x fp16 -> fp32 on tensor
cores) instead of the built-in Q8_0 kernels, the scratch that path needs, and its launches per op.

Steps of at least `min_tokens` tokens (DENSE_MIN_TOKENS unless the options say otherwise) compute a
Q8_0 projection as: expand the weight to fp16 into one scratch buffer (weights stay Q8_0 in memory),
round the input to fp16 (times the norm prologue's 1/rms), one GEMM, then -- where the op has one -- an
epilogue kernel: SiLU·mul of gate_up's row pairs, or the next norm's xn and 1/rms after o and down
(whose GEMM adds into the residual stream in place).  qkv and lm_head write their outputs straight
from the GEMM.  So an op costs 3 or 4 launches where the built-in kernel costs 1, and the plan counts
them (Op.launches_per_range).

The scratch holds the largest fused weight of a layer; a weight bigger than that (lm_head, whose
rows are only computed for the rows a caller wants) and the 4-bit block formats keep their kernels.
Pure arithmetic: the executor allocates from `scratch_shape`, the plan uses `dense_ops`, the same
rules on both sides.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .ops import weight_formats

# The fewest tokens per step for the library GEMM.  Not yet measured on the GPU: at 128 tokens the
# GEMM's fp16 weight traffic (the expansion writes and the GEMM reads 2 bytes per weight) is about
# the int8 kernel's, and the tensor-core rate is far above it.  bench/prefill.py --dense-min-tokens
# sweeps it.
DENSE_MIN_TOKENS = 128
WORKSPACE_BYTES = 32 << 20      # cuBLAS's workspace: what its documentation recommends for Hopper
ALIGN = 256
# the ops with an epilogue kernel after the GEMM: gate_up's SiLU·mul; o and down's next-norm inputs
EPILOGUE_GROUPS = ("gate_up", "o", "down")


@dataclass(frozen=True)
class ScratchShape:
    weight_elements: int       # fp16 weight scratch: the largest fused layer weight, rows x cols
    max_cols: int              # fp16 inputs: the widest K of a projection, per token
    output_floats: int         # fp32 GEMM outputs an epilogue reads, per token: gate_up's 2 x intermediate

    def nbytes(self, max_tokens: int, fused: bool = False) -> int:
        """Device bytes of the scratch for steps of up to `max_tokens` tokens (alignment included); fused:
        the built-in GEMM's, without cuBLAS's fp16 weight and workspace."""
        parts = (2 * max_tokens * self.max_cols, 4 * max_tokens * self.output_floats)
        if not fused:
            parts += (2 * self.weight_elements, WORKSPACE_BYTES)
        return sum(-(-p // ALIGN) * ALIGN + ALIGN for p in parts)


def scratch_shape(config) -> ScratchShape:
    H, I = config.hidden_size, config.intermediate_size
    qkv_rows = config.q_size + 2 * config.kv_size
    return ScratchShape(weight_elements=max(qkv_rows * H, H * config.q_size, 2 * I * H, H * I),
                        max_cols=max(H, config.q_size, I), output_floats=2 * I)


def launches_per_range(op, fused: bool = False) -> int:
    """Launches of one row range of projection `op` on the dense path: the input rounding, the GEMM, an
    epilogue where the op has one, and with cuBLAS (not fused) the weight's expansion first."""
    return 2 + (op.group in EPILOGUE_GROUPS) + (not fused)


def takes_dense(op, tokens: int, config, min_tokens: int, fused: bool = False) -> bool:
    """Whether projection `op` of a step of `tokens` tokens runs on the dense path: a Q8_0 projection whose
    weight fits cuBLAS's scratch (the built-in GEMM, fused, needs no weight scratch: any)."""
    if not op.is_projection or tokens < min_tokens:
        return False
    formats = weight_formats(config)
    if any(formats.get(w.name, "Q8_0") != "Q8_0" for w in op.weights):
        return False
    cols = op.weights[0].shape[1]
    shape = scratch_shape(config)
    return cols <= shape.max_cols and (fused or all((hi - lo) * cols <= shape.weight_elements
                                                    for lo, hi in op.row_ranges))


def dense_ops(ops, config, tokens: int, min_tokens: int | None, fused: bool = False) -> list:
    """`ops` with the launches of those that take the dense path (none when min_tokens is None); fused:
    the built-in GEMM, else cuBLAS."""
    if min_tokens is None:
        return list(ops)
    return [replace(op, launches_per_range=launches_per_range(op, fused))
            if takes_dense(op, tokens, config, min_tokens, fused) else op for op in ops]
