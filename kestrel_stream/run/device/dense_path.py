"""gpu mode's dense GEMM path for steps of many tokens: whether it is on, on what, and its scratch in the arena.

On where steps can reach the path's threshold (max_tokens); there, projections run as one fp16
tensor-core GEMM: cuBLAS where the options allow it (Options.cublas_min_tokens: None for
scheduler.dense.default_min_tokens -- DENSE_MIN_TOKENS, or BLOCK_DENSE_MIN_TOKENS for a model in 4/6-bit
blocks --, 0 for never) and it loads (cuda/cublas.py: otherwise one line on stderr), else the built-in
q8_gemm_f16.cu from DENSE_MIN_TOKENS, which needs no weight scratch and computes Q8_0 weights only.
The rules of which ops take it are scheduler/dense.py's; the launches are cuda/dense_gemm.py's.
"""
from __future__ import annotations

from scheduler.dense import DENSE_MIN_TOKENS, WORKSPACE_BYTES, default_min_tokens, scratch_shape
from kestrel_stream.cuda import cublas
from kestrel_stream.cuda.dense_gemm import DenseScratch


def open_blas(options, config, max_tokens: int):
    """(min_tokens, cuBLAS handle or None for the built-in GEMM), or (None, None) where the path is off;
    call with the context current."""
    if options.cublas_min_tokens == 0:
        return (DENSE_MIN_TOKENS, None) if max_tokens >= DENSE_MIN_TOKENS else (None, None)
    min_tokens = default_min_tokens(config) if options.cublas_min_tokens is None else options.cublas_min_tokens
    if max_tokens >= min_tokens:
        blas = cublas.load()
        if blas is not None:
            return min_tokens, blas
    return (DENSE_MIN_TOKENS, None) if max_tokens >= DENSE_MIN_TOKENS else (None, None)


def scratch_bytes(config, max_tokens: int, min_tokens: int | None, blas) -> int:
    """Arena bytes the path needs (0 when off)."""
    return scratch_shape(config).nbytes(max_tokens, fused=blas is None) if min_tokens is not None else 0


def allocate_scratch(arena, config, max_tokens: int, min_tokens: int | None, blas) -> DenseScratch | None:
    """The path's buffers (and cuBLAS's weight scratch and workspace) in `arena`, or None when it is off."""
    if min_tokens is None:
        return None
    shape = scratch_shape(config)
    return DenseScratch.allocate(arena, blas, min_tokens=min_tokens, max_tokens=max_tokens,
                                 weight_elements=shape.weight_elements, max_cols=shape.max_cols,
                                 output_floats=shape.output_floats, workspace_bytes=WORKSPACE_BYTES)
