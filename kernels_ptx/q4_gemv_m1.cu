// Single-token block-format GEMV layouts (q4_gemv_tiled.cuh), one kernel set per variant of
// kestrel_stream/cuda/q4_gemv_variants.M1_VARIANTS: tTrRuU = T threads, R rows per block, U units
// per thread in flight; pTrRuU the same with prefetches and subnormal levels (below).
// Names: <fmt>[_<tail fmt>]_gemv_m1_<variant>[_silu].
#include "common.cuh"
#include "q4_formats.cuh"
#include "q4_gemv_epilogue.cuh"
#include "q4_gemv_tiled.cuh"

DEFINE_Q4_TILED_SET(1, 32, 4, 2, false, t32r4u2)
DEFINE_Q4_TILED_SET(1, 64, 8, 1, false, t64r8u1)
DEFINE_Q4_TILED_SET(1, 64, 4, 3, false, t64r4u3)
DEFINE_Q4_TILED_SET(1, 128, 4, 3, false, t128r4u3)
// pTrRuU: the same loop with the next pass's units prefetched into L2 while this pass computes (the
// multi-pass rows: o, down, the 8B's K = 4096 shapes) and Q4_K's levels as subnormal floats (one FADD
// a weight less; q4_gemv_tiled.cuh's Subnormal)
DEFINE_Q4_PREFETCH_SET(1, 64, 8, 1, p64r8u1)
DEFINE_Q4_PREFETCH_SET(1, 64, 4, 1, p64r4u1)
DEFINE_Q4_PREFETCH_SET(1, 32, 4, 2, p32r4u2)
DEFINE_Q4_PREFETCH_SET(1, 64, 4, 3, p64r4u3)
