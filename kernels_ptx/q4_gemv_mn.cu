// Block-format GEMV layouts for 2..8 tokens (q4_gemv_tiled.cuh, row-outer), one kernel set per M in
// (2, 4, 8) and variant of kestrel_stream/cuda/q4_gemv_variants.MN_VARIANTS: oTrRuU = T threads, R rows
// per block, U units per thread in flight.  Names: <fmt>[_<tail fmt>]_gemv_m<M>_<variant>[_silu].
// (The layouts with x shared by the rows, gTrRuU: q4_gemv_mg.cu.)
#include "common.cuh"
#include "q4_formats.cuh"
#include "q4_gemv_epilogue.cuh"
#include "q4_gemv_tiled.cuh"

#define DEFINE_Q4_TILED_MN(M)                           \
    DEFINE_Q4_TILED_SET(M, 64, 4, 1, true, o64r4u1)     \
    DEFINE_Q4_TILED_SET(M, 32, 4, 2, true, o32r4u2)

DEFINE_Q4_TILED_MN(2)
DEFINE_Q4_TILED_MN(4)
DEFINE_Q4_TILED_MN(8)
