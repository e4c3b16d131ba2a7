// Single-token block-format GEMV layouts on integer dot products (q4_gemv_dp4a.cuh), one kernel set
// per d variant of kestrel_stream/cuda/q4_gemv_variants.M1_VARIANTS: dTrRuU[gG] = T threads, R rows per
// tile, U D-units (64 weights) per thread and row in flight, G row groups (T / G threads on R / G rows
// each; 1 when absent); then the blocks per SM its registers must allow, the grid's cap per SM (the
// variant's blocks_per_sm), each block running every gridDim.x-th tile.
// Names: <fmt>[_<tail fmt>]_gemv_m1_<variant>[_silu].
#include "common.cuh"
#include "q4_formats.cuh"
#include "q4_gemv_epilogue.cuh"
#include "q4_gemv_tiled.cuh"
#include "q4_dp4a_x.cuh"
#include "q4_gemv_dp4a.cuh"

DEFINE_Q4_DP4A_SET(32, 4, 1, 1, 16, d32r4u1)
DEFINE_Q4_DP4A_SET(64, 4, 1, 1, 8, d64r4u1)
// row groups: one quantisation of x for 8 and 16 rows, four rows a thread
DEFINE_Q4_DP4A_SET(128, 8, 1, 2, 4, d128r8u1g2)
DEFINE_Q4_DP4A_SET(256, 16, 1, 4, 2, d256r16u1g4)
DEFINE_Q4_DP4A_SET(128, 16, 1, 4, 4, d128r16u1g4)
// one block an SM: x quantised once per SM (per SM it costs blocks x K, which these make K), 16 warps
DEFINE_Q4_DP4A_SET(512, 32, 1, 8, 1, d512r32u1g8)
DEFINE_Q4_DP4A_SET(512, 16, 1, 8, 1, d512r16u1g8)
