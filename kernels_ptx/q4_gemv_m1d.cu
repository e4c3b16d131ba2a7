// Single-token block-format GEMV layouts on integer dot products (q4_gemv_dp4a.cuh), one kernel set
// per d variant of kestrel_stream/cuda/q4_gemv_variants.M1_VARIANTS: dTrRuU = T threads, R rows per
// tile, U D-units (64 weights) per thread and row in flight; the host caps the grid at the variant's
// blocks_per_sm, each block running every gridDim.x-th tile.  Names: <fmt>[_<tail fmt>]_gemv_m1_<variant>[_silu].
#include "common.cuh"
#include "q4_formats.cuh"
#include "q4_gemv_epilogue.cuh"
#include "q4_gemv_tiled.cuh"
#include "q4_gemv_dp4a.cuh"

DEFINE_Q4_DP4A_SET(32, 4, 1, d32r4u1)
DEFINE_Q4_DP4A_SET(64, 4, 1, d64r4u1)
DEFINE_Q4_DP4A_SET(128, 4, 1, d128r4u1)
DEFINE_Q4_DP4A_SET(64, 8, 1, d64r8u1)
