"""Which projections of a gpu-mode step run as a library GEMM (cuBLAS, fp16 x fp16 -> fp32 on tensor
cores) instead of the built-in quantized kernels, the scratch that path needs, and its launches per op.

Steps of at least `min_tokens` tokens (default_min_tokens unless the options say otherwise) compute a
projection as: expand the weight to fp16 into one scratch buffer (weights stay in their Q8_0 or 4/6-bit
blocks in memory), round the input to fp16 (times the norm prologue's 1/rms), one GEMM, then -- where
the op has one -- an epilogue kernel: SiLU·mul of gate_up's row pairs, or the next norm's xn and 1/rms
after o and down (whose GEMM adds into the residual stream in place).  qkv and lm_head write their
outputs straight from the GEMM.  So an op costs 3 or 4 launches where the built-in kernel costs 1, and
the plan counts them (Op.launches_per_range).

The scratch holds the largest fused weight of a layer; a weight bigger than that (lm_head, whose
rows are only computed for the rows a caller wants) keeps its kernels, and so do the 4/6-bit block
formats without cuBLAS (the built-in GEMM, q8_gemm_f16.cu, reads Q8_0 only).  Pure arithmetic: the
executor allocates from `scratch_shape`, the plan uses `dense_ops`, the same rules on both sides.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .ops import weight_formats

# The fewest tokens per step for the library GEMM.  Not yet measured on the GPU: at 128 tokens the
# GEMM's fp16 weight traffic (the expansion writes and the GEMM reads 2 bytes per weight) is about
# the int8 kernel's, and the tensor-core rate is far above it.  bench/prefill.py --cublas-min-tokens
# sweeps it.
DENSE_MIN_TOKENS = 128
# The same for a model whose layers hold 4/6-bit block formats (a Q4_K_M file), on cuBLAS.  Measured on
# the H200 (qwen3-1.7b Q4_K_M, bench/results/2026-12-03-h200-*-steps-cublas*.md), a step of k tokens over a
# one-token step: the int8 kernels (q4_mma.cu) 3.21x at 32, 5.18x at 64, 10.39x at 128; cuBLAS 3.64x, 3.78x,
# 4.77x; pp512 12,113 -> 59,178 tok/s.  49 is the first step size whose step graph is the 64-token one: a
# graph pads a step up to its bucket (run/device/step_graphs.py: 16, 32, 48, 64) and runs the kernels chosen
# for the bucket, so a switch point inside a bucket would give a step different kernels with graphs on and
# off (test_step_graphs: graph = eager within 1e-4); 33..48 stay on the int8 kernels, which won at 32.
BLOCK_DENSE_MIN_TOKENS = 49
WORKSPACE_BYTES = 32 << 20      # cuBLAS's workspace: what its documentation recommends for Hopper
ALIGN = 256
# the ops with an epilogue kernel after the GEMM: gate_up's SiLU·mul; o and down's next-norm inputs
EPILOGUE_GROUPS = ("gate_up", "o", "down")
# (format, format of the last rows or None) of the weights cuBLAS's path expands (dense_gemm.cu's
# q8_dequant_f16 and <fmt>[_<tail fmt>]_dequant_f16; a Q4_K_M file's fused QKV has Q6_K v rows in half
# its layers); the built-in GEMM (q8_gemm_f16.cu, the weight expanded in registers) reads Q8_0 only
BLAS_FORMATS = (("Q8_0", None), ("Q4_0", None), ("Q4_K", None), ("Q6_K", None), ("Q4_K", "Q6_K"))
BUILT_IN_FORMATS = (("Q8_0", None),)


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


def path_formats(fused: bool) -> tuple:
    """The (format, tail format) pairs the path computes: the built-in GEMM's (fused) or cuBLAS's."""
    return BUILT_IN_FORMATS if fused else BLAS_FORMATS


def default_min_tokens(config) -> int:
    """cuBLAS's threshold unless the options set one: BLOCK_DENSE_MIN_TOKENS where a layer's projection
    weight is in a block format (its Q8_0 weights, if any, switch there too), else DENSE_MIN_TOKENS."""
    blocks = any(name.startswith("model.layers.") and fmt != "Q8_0" for name, fmt in weight_formats(config).items())
    return BLOCK_DENSE_MIN_TOKENS if blocks else DENSE_MIN_TOKENS


def op_formats(op, config) -> tuple:
    """(format, format of the last rows or None) of projection `op`'s fused weight: its weights' formats in
    row order, one run or two (quant4.fuse_rows keeps no more in blocks)."""
    formats = weight_formats(config)
    runs: list = []
    for w in op.weights:
        fmt = formats.get(w.name, "Q8_0")
        if not runs or runs[-1] != fmt:
            runs.append(fmt)
    return (runs[0], runs[1] if len(runs) == 2 else None) if len(runs) <= 2 else tuple(runs)


def launches_per_range(op, fused: bool = False) -> int:
    """Launches of one row range of projection `op` on the dense path: the input rounding, the GEMM, an
    epilogue where the op has one, and with cuBLAS (not fused) the weight's expansion first."""
    return 2 + (op.group in EPILOGUE_GROUPS) + (not fused)


def takes_dense(op, tokens: int, config, min_tokens: int, fused: bool = False) -> bool:
    """Whether projection `op` of a step of `tokens` tokens runs on the dense path: a projection in a format
    the path computes (path_formats) whose weight fits cuBLAS's scratch (the built-in GEMM, fused, needs no
    weight scratch: any)."""
    if not op.is_projection or tokens < min_tokens or op_formats(op, config) not in path_formats(fused):
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
