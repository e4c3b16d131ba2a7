"""gpu mode's library GEMM path for steps of many tokens: whether it is on, and its scratch in the arena.

On when the options allow it (Options.cublas_min_tokens: None for scheduler.dense.DENSE_MIN_TOKENS,
0 for never), steps can be that long (max_tokens) and cuBLAS loads (cuda/cublas.py: otherwise one
line on stderr, and the built-in kernels run every step).  The rules of which ops take it are
scheduler/dense.py's; the launches are cuda/dense_gemm.py's.
"""
from __future__ import annotations

from scheduler.dense import DENSE_MIN_TOKENS, WORKSPACE_BYTES, scratch_shape
from kestrel_stream.cuda import cublas
from kestrel_stream.cuda.dense_gemm import DenseScratch


def open_blas(options, max_tokens: int):
    """(min_tokens, cuBLAS handle), or (None, None) where the path is off; call with the context current."""
    min_tokens = DENSE_MIN_TOKENS if options.cublas_min_tokens is None else options.cublas_min_tokens
    if min_tokens == 0 or max_tokens < min_tokens:
        return None, None
    blas = cublas.load()
    return (min_tokens, blas) if blas is not None else (None, None)


def scratch_bytes(config, max_tokens: int, blas) -> int:
    """Arena bytes the path needs (0 when off)."""
    return scratch_shape(config).nbytes(max_tokens) if blas is not None else 0


def allocate_scratch(arena, config, max_tokens: int, min_tokens: int | None, blas) -> DenseScratch | None:
    """The path's buffers and workspace in `arena`, or None when it is off."""
    if blas is None:
        return None
    shape = scratch_shape(config)
    return DenseScratch.allocate(arena, blas, min_tokens=min_tokens, max_tokens=max_tokens,
                                 weight_elements=shape.weight_elements, max_cols=shape.max_cols,
                                 output_floats=shape.output_floats, workspace_bytes=WORKSPACE_BYTES)
