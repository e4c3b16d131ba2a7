// Block-format GEMV layouts for 2..8 tokens with x shared by the rows (q4_gemv_tiled.cuh's
// unit_rows_shared), one kernel set per M in (2, 4, 8) and variant gTrRuU of
// kestrel_stream/cuda/q4_gemv_variants.MN_VARIANTS: T threads, R rows per block, U units per thread in
// flight.  Names: <fmt>[_<tail fmt>]_gemv_m<M>_<variant>[_silu].  (The row-outer oTrRuU: q4_gemv_mn.cu.)
#include "common.cuh"
#include "q4_formats.cuh"
#include "q4_gemv_epilogue.cuh"
#include "q4_gemv_tiled.cuh"

#define DEFINE_Q4_TILED_MG(M)                           \
    DEFINE_Q4_TILED_SET(M, 64, 4, 1, false, g64r4u1)    \
    DEFINE_Q4_TILED_SET(M, 32, 4, 2, false, g32r4u2)

DEFINE_Q4_TILED_MG(2)
DEFINE_Q4_TILED_MG(4)
DEFINE_Q4_TILED_MG(8)
