// Q8_0 products for steps of a few tokens (2..16) that read each weight byte once, on fp16 tensor
// cores: the GEMV's argument list and epilogues (q8_gemv.cu), at about a one-token GEMV's cost.
//
// Why: q8_gemv.cu's multi-token layouts multiply each weight by each token's fp32 x in an FMA of its
// own and re-read x from L1 per token: at 8 tokens they run 4x a one-token GEMV, bound by L1 and the
// FMA pipes, not by the weight bytes (bench/results/2026-11-30-h200-gpu-kernels.md).  Here one
// mma.sync.m16n8k16 takes 16 weight rows x 16 k against 8 tokens, so the tokens cost almost nothing.
//
//   s[m, n] = sum_b d[n, b] * sum_{k in block b} q[n, k] * (hi + lo)(x[m, k] * inv_rms_in[m])
//
// Weights enter the mma as their exact integer values (fp16 holds -128..127 exactly: 0x64uu - 1152)
// and each Q8_0 block's mma steps start from zero, so the block's sums are exact products of the
// integers and fp16 x, scaled by the row's d in fp32.  x (times inv_rms_in: normalised values, far
// from fp16's range) goes in as two fp16 parts, hi + lo (hmma_split), each its own mma: x to ~2^-22
// relative, where one fp16 rounding (2^-11) made a batch's logits differ from a lone token's by 4e-4.
//
// Fragments without shared memory: a mma's 16 k need not be 16 consecutive k, only the same k for
// A (weights) and B (x).  Thread (g = lane / 4, t = lane % 4) loads 8 bytes of rows g and g + 8 at
// k = 8t .. 8t + 7 of a block, and x[token g] at the same k (two float4s): mma step s (0, 1) takes the
// word s, whose bytes 0, 1 stand for the mma's k = 2t, 2t + 1 and bytes 2, 3 for 2t + 8, 2t + 9.
// Steps 0 and 1 of the four threads cover the block's 32 k.
//
// Work layout: a block owns 16 RT rows and WK warps (each warp's RT row tiles share its x fragments, whose
// fp16 split costs as much as converting a tile's weights); warp w takes a contiguous run of the rows' Q8_0 blocks
// in steps of U blocks, all U blocks' loads in flight (two 8-byte loads a block, rows g and g + 8: each
// warp load is 8 rows x 32 bytes, whole sectors; a step reads 32 U contiguous bytes of each row) and
// the step's U scales of a row in one load (when the row's block count is a multiple of U).  NT groups
// of 8 tokens (NT = 2: up to 16) share each weight fragment.  The warps' partial sums meet in shared
// memory (fixed order: the result does not depend on timing), then the epilogue of q8_gemv.cu: SiLU·mul
// of (gate, up) row pairs, residual, xn, and per-token sums of squares whose last block (atomic ticket)
// turns them into 1/rms: `counter` [0] the ticket, floats [8 .. 8 + ntok) the sums (GEMV_COUNTER_BYTES).
#include "common.cuh"
#include "hmma_common.cuh"

// the signed bytes 0, 1 (p01) and 2, 3 (p23) of a weight word as exact fp16 pairs
__device__ __forceinline__ void hmma_bytes(unsigned int word, unsigned int& p01, unsigned int& p23) {
    const unsigned int biased = word ^ 0x80808080u;
    const unsigned int h01 = __byte_perm(biased, 0x64646464u, 0x4140), h23 = __byte_perm(biased, 0x64646464u, 0x4342);
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(p01) : "r"(h01), "r"(0x64806480u));
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(p23) : "r"(h23), "r"(0x64806480u));
}

// U consecutive fp16 scales of a row (U a power of two, p 2U-byte aligned) in one load, as packed pairs
template <int U>
__device__ __forceinline__ void hmma_scales(const half_bits* p, unsigned int (&words)[U / 2]) {
    static_assert(U == 2 || U == 4 || U == 8, "scale vector");
    if constexpr (U == 2) {
        words[0] = __ldg((const unsigned int*)p);
    } else if constexpr (U == 4) {
        const uint2 v = __ldg((const uint2*)p);
        words[0] = v.x; words[1] = v.y;
    } else {
        const uint4 v = __ldg((const uint4*)p);
        words[0] = v.x; words[1] = v.y; words[2] = v.z; words[3] = v.w;
    }
}

// one step's weights: U blocks of rows g and g + 8 of each row tile (blocks at or past `last` not loaded) and
// their scales as packed fp16 pairs
template <int RT, int U>
__device__ __forceinline__ void hmma_load_step(const int8* const (&wp)[RT][2], const half_bits* const (&sp)[RT][2],
                                               int b0, int last, bool vector_scales, uint2 (&wr)[RT][2][U],
                                               unsigned int (&sw)[RT][2][(U + 1) / 2]) {
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
        for (int i = 0; i < RT; i++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                if (b0 + u < last) wr[i][h][u] = hmma_load8(wp[i][h] + 32 * (b0 + u));
#pragma unroll
    for (int i = 0; i < RT; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (vector_scales && b0 + U <= last) {
                hmma_scales<U>(sp[i][h] + b0, sw[i][h]);
            } else {
#pragma unroll
                for (int u = 0; u < U; u += 2) {
                    const unsigned int a = __ldg(sp[i][h] + min(b0 + u, last - 1));
                    const unsigned int b = u + 1 < U ? __ldg(sp[i][h] + min(b0 + u + 1, last - 1)) : 0u;
                    sw[i][h][u / 2] = a | (b << 16);
                }
            }
        }
}

__device__ __forceinline__ float hmma_scale(const unsigned int* sw, int u) {
    return half_to_float((half_bits)((sw[u / 2] >> (16 * (u & 1))) & 0xFFFFu));
}

// block u of a loaded step (block b of the row): x of each token group as hi + lo, four mma a token group,
// the block's sums scaled by the rows' d into acc
template <int NT, int RT, int U>
__device__ __forceinline__ void hmma_block(const uint2 (&wr)[RT][2][U], const unsigned int (&sw)[RT][2][(U + 1) / 2],
                                           int u, int b, const float* const (&xrow)[NT], const float (&xscale)[NT],
                                           float (&acc)[RT][NT][4]) {
    unsigned int hi[NT][4], lo[NT][4];   // x pairs (k 0, 1), (2, 3) of word x; (4, 5), (6, 7) of word y
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const float4* xp = (const float4*)(xrow[j] + 32 * b);
        const float4 x0 = xp[0], x1 = xp[1];
        const float s = xscale[j];
        hmma_split(x0.x * s, x0.y * s, hi[j][0], lo[j][0]);
        hmma_split(x0.z * s, x0.w * s, hi[j][1], lo[j][1]);
        hmma_split(x1.x * s, x1.y * s, hi[j][2], lo[j][2]);
        hmma_split(x1.z * s, x1.w * s, hi[j][3], lo[j][3]);
    }
#pragma unroll
    for (int i = 0; i < RT; i++) {
        unsigned int a0[4], a1[4];   // mma steps 0 and 1: words x and y of rows g (a[0], a[2]), g + 8
        hmma_bytes(wr[i][0][u].x, a0[0], a0[2]);
        hmma_bytes(wr[i][1][u].x, a0[1], a0[3]);
        hmma_bytes(wr[i][0][u].y, a1[0], a1[2]);
        hmma_bytes(wr[i][1][u].y, a1[1], a1[3]);
        const float d0 = hmma_scale(sw[i][0], u), d1 = hmma_scale(sw[i][1], u);
#pragma unroll
        for (int j = 0; j < NT; j++) {
            float c[4] = {0.f, 0.f, 0.f, 0.f};
            hmma_mma(c, a0, hi[j][0], hi[j][1]);
            hmma_mma(c, a0, lo[j][0], lo[j][1]);
            hmma_mma(c, a1, hi[j][2], hi[j][3]);
            hmma_mma(c, a1, lo[j][2], lo[j][3]);
            acc[i][j][0] = fmaf(c[0], d0, acc[i][j][0]);
            acc[i][j][1] = fmaf(c[1], d0, acc[i][j][1]);
            acc[i][j][2] = fmaf(c[2], d1, acc[i][j][2]);
            acc[i][j][3] = fmaf(c[3], d1, acc[i][j][3]);
        }
    }
}

// the loaded step of blocks b0 .. b0 + U - 1 (those before `last`) into acc
template <int NT, int RT, int U>
__device__ __forceinline__ void hmma_step(const uint2 (&wr)[RT][2][U], const unsigned int (&sw)[RT][2][(U + 1) / 2],
                                          int b0, int last, const float* const (&xrow)[NT], const float (&xscale)[NT],
                                          float (&acc)[RT][NT][4]) {
    if (b0 + U <= last) {   // a whole step: no test between its blocks' x loads and mma
#pragma unroll
        for (int u = 0; u < U; u++) hmma_block<NT, RT, U>(wr, sw, u, b0 + u, xrow, xscale, acc);
    } else {
#pragma unroll
        for (int u = 0; u < U; u++)
            if (b0 + u < last) hmma_block<NT, RT, U>(wr, sw, u, b0 + u, xrow, xscale, acc);
    }
}

template <int NT, int RT, int WK, int U, bool SILU_PAIRS, bool PIPE>
__device__ __forceinline__ void q8_hmma_body(
        const int8* __restrict__ qs, const half_bits* __restrict__ scales, const float* x, int ldx,
        const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out, float* xn_out,
        float* inv_rms_out, unsigned int* counter, float eps, int N, int K, int ntok) {
    constexpr int ROWS = 16 * RT;
    pdl_launch_dependents();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * ROWS;
    const int blocks = K >> 5;
    // tile i's rows row0 + 16 i + g (h 0) and + 8 (h 1); a clamped row computes garbage that is never stored
    const int8* wp[RT][2];
    const half_bits* sp[RT][2];
#pragma unroll
    for (int i = 0; i < RT; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = min(row0 + 16 * i + 8 * h + g, N - 1);
            wp[i][h] = qs + (long long)row * K + 8 * t;
            sp[i][h] = scales + (long long)row * blocks;
        }

    float acc[RT][NT][4];
    hmma_zero(acc);

    // warp w's blocks: a contiguous run [first, last) of whole U-block steps (128 B of a row per step at U 4)
    const int per = (blocks + WK * U - 1) / (WK * U) * U, first = warp * per, last = min(blocks, first + per);
    const bool vector_scales = blocks % U == 0;   // each step's U scales of a row in one aligned load
    uint2 wr[RT][2][U];
    unsigned int sw[RT][2][(U + 1) / 2];
    if (first < last) hmma_load_step<RT, U>(wp, sp, first, last, vector_scales, wr, sw);   // weights: before pdl_wait
    if constexpr (PIPE) {
        uint2 wr2[RT][2][U];   // the second buffer: step b0 + U's loads in flight while step b0 computes
        unsigned int sw2[RT][2][(U + 1) / 2];
        if (first + U < last) hmma_load_step<RT, U>(wp, sp, first + U, last, vector_scales, wr2, sw2);
        pdl_wait();   // x and inv_rms_in belong to earlier kernels
        float xscale[NT];
        const float* xrow[NT];
        hmma_x_rows(x, ldx, inv_rms_in, ntok, g, 8 * t, xrow, xscale);
        for (int b0 = first; b0 < last; b0 += 2 * U) {   // the same blocks in the same order as below
            hmma_step<NT, RT, U>(wr, sw, b0, last, xrow, xscale, acc);
            if (b0 + 2 * U < last) hmma_load_step<RT, U>(wp, sp, b0 + 2 * U, last, vector_scales, wr, sw);
            if (b0 + U >= last) break;
            hmma_step<NT, RT, U>(wr2, sw2, b0 + U, last, xrow, xscale, acc);
            if (b0 + 3 * U < last) hmma_load_step<RT, U>(wp, sp, b0 + 3 * U, last, vector_scales, wr2, sw2);
        }
    } else {
        pdl_wait();   // x and inv_rms_in belong to earlier kernels
        float xscale[NT];
        const float* xrow[NT];
        hmma_x_rows(x, ldx, inv_rms_in, ntok, g, 8 * t, xrow, xscale);
        for (int b0 = first; b0 < last; b0 += U) {
            hmma_step<NT, RT, U>(wr, sw, b0, last, xrow, xscale, acc);
            if (b0 + U < last) hmma_load_step<RT, U>(wp, sp, b0 + U, last, vector_scales, wr, sw);
        }
    }

    hmma_epilogue<NT, RT, WK, SILU_PAIRS>(acc, row0, y, ldy, res, normw_out, xn_out, inv_rms_out, counter, eps, N,
                                          ntok);
}

// q8_hmma_t<8 NT>_k<WK>u<U>[r<RT>][p] (+ _silu): the layouts of kestrel_stream/cuda/gemv_variants.HMMA_VARIANTS;
// p: two steps' loads in flight (the next step's while this one computes), the same sums in the same order
#define DEFINE_HMMA(NT, RT, WK, U, SILU, PIPE, NAME)                                               \
    extern "C" __global__ void __launch_bounds__(32 * WK) NAME(                                   \
            const int8* qs, const half_bits* scales, const float* x, int ldx,                    \
            const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out,\
            float* xn_out, float* inv_rms_out, unsigned int* counter, float eps, int N, int K,   \
            int ntok) {                                                                          \
        q8_hmma_body<NT, RT, WK, U, SILU, PIPE>(qs, scales, x, ldx, inv_rms_in, y, ldy, res,     \
                                                normw_out, xn_out, inv_rms_out, counter, eps, N, K, ntok); \
    }
#define DEFINE_HMMA_LAYOUT(RT, WK, U, PIPE, SUFFIX)                                                \
    DEFINE_HMMA(1, RT, WK, U, false, PIPE, q8_hmma_t8_##SUFFIX)                                   \
    DEFINE_HMMA(1, RT, WK, U, true, PIPE, q8_hmma_t8_##SUFFIX##_silu)                             \
    DEFINE_HMMA(2, RT, WK, U, false, PIPE, q8_hmma_t16_##SUFFIX)                                  \
    DEFINE_HMMA(2, RT, WK, U, true, PIPE, q8_hmma_t16_##SUFFIX##_silu)
DEFINE_HMMA_LAYOUT(1, 8, 4, false, k8u4)
DEFINE_HMMA_LAYOUT(1, 16, 4, false, k16u4)
DEFINE_HMMA_LAYOUT(2, 8, 4, false, k8u4r2)
DEFINE_HMMA_LAYOUT(2, 4, 4, false, k4u4r2)
DEFINE_HMMA_LAYOUT(1, 8, 4, true, k8u4p)
DEFINE_HMMA_LAYOUT(1, 4, 4, true, k4u4p)
DEFINE_HMMA_LAYOUT(2, 4, 4, true, k4u4r2p)
DEFINE_HMMA_LAYOUT(2, 2, 4, true, k2u4r2p)
