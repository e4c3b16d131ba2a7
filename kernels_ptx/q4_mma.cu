// Matrix-matrix product on int8 tensor cores (steps of more than 8 tokens) over the 4/6-bit
// block formats of q4_formats.cuh, with q4_gemv.cu's arguments (a second format for the
// last rows) and q8_mma.cu's epilogues (inv_rms_in, SiLU·mul pairs, residual, xn, inv_rms).
//
// Every format is groups of 16 weights w = s * (level - BIAS) - o.  Per BK-wide stage a block
// decodes its weight tile to int8 (level - BIAS) in shared memory with each group's s and o,
// and quantises the x tile per token and group of 16 in two int8 levels as q8_mma.cu does
// (d = amax / 127, hi = rn(v / d), lo = rn((v - hi d) 128 / d)).  A group is one m16n8k16
// K step (the first or second half of q8_mma.cu's m16n8k32 fragments), so each product
// carries one weight scale:
//   c = mma(lo, w, mma(hi, w, 0) << 7),  acc += c * (d / 128) * s  - xsum * o
// (xsum = the group's fp32 sum of x; o is non-zero for Q4_K's mins only).
// Roles as in q8_mma.cu: A = 16 tokens x 16 k (row), B = 16 k x 8 weight rows (col), a
// thread's C pair is two adjacent weight rows of one token (a gate/up pair for SiLU).
// The next stage's raw weight units are loaded into registers while the current one computes.
//
// Two token tiles: <fmt>_mma, 64 tokens x 64 rows (2 x 2 warps), for prefill-sized steps, and
// <fmt>_mma16, 16 tokens x 64 rows (1 x 4 warps), for steps of up to 64 tokens: there a 64-token tile
// quantises and multiplies mostly padding, and a projection of a few thousand rows gives a few dozen
// blocks, each walking the whole K alone.  Both split K over the grid's z as q8_mma.cu does: each
// split walks a contiguous run of ceil(stages / gridDim.z) stages, parks its fp32 fragments in
// `partials`, and the last split of a tile to take its ticket sums splits 0..z-1 in order (the
// result does not depend on which came last), resets the ticket and runs the epilogue alone.
// gridDim.z == 1 never touches partials or tickets.
#include "common.cuh"
#include "mma_epilogue.cuh"
#include "q4_formats.cuh"
#include "q4_mma.cuh"

template <class F, int BM, int WARPS_M, bool SILU_PAIRS>
__device__ __forceinline__ void mma_part(
        MmaShared<BM>& sh, const unsigned char* __restrict__ qs, const unsigned char* __restrict__ meta, int row0,
        int row_first, int row_end, const float* x, int ldx, const float* inv_rms_in, float* y, int ldy,
        const float* res, const float* normw_out, float* xn_out, float* inv_rms_out, unsigned int* counter, float eps,
        int N, int K, int ntok, float* partials, unsigned int* tickets) {
    constexpr int WARPS_N = QM_THREADS / 32 / WARPS_M;
    constexpr int FM = BM / 16 / WARPS_M, FN = QM_BN / 8 / WARPS_N;   // mma tiles per warp
    static_assert(FM >= 1 && FN >= 1 && BM % (16 * WARPS_M) == 0, "tile");
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
    const int tok0 = blockIdx.y * BM;
    // this split's K stages [stage_begin, stage_end): the host picks gridDim.z so that none is empty
    const int splits = gridDim.z, stages_all = (K + QM_BK - 1) / QM_BK;
    const int stages_per_split = (stages_all + splits - 1) / splits;
    const int stage_begin = blockIdx.z * stages_per_split, stage_end = min(stages_all, stage_begin + stages_per_split);

    float acc[FM][FN][4];
#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int j = 0; j < FN; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[i][j][c] = 0.f;

    StageWeights<F> weights;
    // constant weights: safe before pdl_wait
    weights.load(qs, meta, row0, row_first, row_end, K, stage_begin * QM_BK);
    StageX<BM> xs;
    pdl_wait();   // x is written by the previous kernel
    if (StageX<BM>::AHEAD) xs.load(x, ldx, tok0, ntok, K, stage_begin * QM_BK);
    for (int s = stage_begin; s < stage_end; s++) {
        const int k0 = s * QM_BK;
        weights.store(sh, k0);
        if (!StageX<BM>::AHEAD) xs.load(x, ldx, tok0, ntok, K, k0);
        xs.store(sh);
        __syncthreads();
        if (s + 1 < stage_end) {
            weights.load(qs, meta, row0, row_first, row_end, K, k0 + QM_BK);
            if (StageX<BM>::AHEAD) xs.load(x, ldx, tok0, ntok, K, k0 + QM_BK);
        }
#pragma unroll
        for (int b = 0; b < QM_BK / 32; b++) {
            unsigned int a[FM][4], a_lo[FM][4], bw[FN][2];
#pragma unroll
            for (int i = 0; i < FM; i++) {
                const int at = (warp_m * FM * 16 + i * 16 + g) * QM_STRIDE + b * 32 + t * 4;
#pragma unroll
                for (int level = 0; level < 2; level++) {
                    const unsigned char* p = sh.x_tile[level] + at;
                    unsigned int (&frag)[4] = level ? a_lo[i] : a[i];
                    frag[0] = *(const unsigned int*)p;
                    frag[1] = *(const unsigned int*)(p + 8 * QM_STRIDE);
                    frag[2] = *(const unsigned int*)(p + 16);
                    frag[3] = *(const unsigned int*)(p + 8 * QM_STRIDE + 16);
                }
            }
#pragma unroll
            for (int j = 0; j < FN; j++) {
                const unsigned char* p = sh.w_tile + (warp_n * FN * 8 + j * 8 + g) * QM_STRIDE + b * 32 + t * 4;
                bw[j][0] = *(const unsigned int*)p;          // k 0..15 of the step
                bw[j][1] = *(const unsigned int*)(p + 16);   // k 16..31
            }
#pragma unroll
            for (int half = 0; half < 2; half++) {
                const int grp = 2 * b + half;
#pragma unroll
                for (int i = 0; i < FM; i++) {
                    const int m = warp_m * FM * 16 + i * 16 + g;
                    const float xs0 = sh.x_s[grp][m], xs1 = sh.x_s[grp][m + 8];
                    const float xsum0 = sh.x_sum[grp][m], xsum1 = sh.x_sum[grp][m + 8];
#pragma unroll
                    for (int j = 0; j < FN; j++) {
                        const int n = warp_n * FN * 8 + j * 8 + t * 2;
                        const float2 ws = *(const float2*)&sh.w_s[grp][n];
                        // the m16n8k32 fragments' first half is k 0..15 (a0, a1; b0), the second 16..31
                        const int zero[4] = {0, 0, 0, 0};
                        int hi[4], d[4];
                        qm_mma_s8_k16(hi, a[i][2 * half], a[i][2 * half + 1], bw[j][half], zero);
#pragma unroll
                        for (int c = 0; c < 4; c++) hi[c] <<= 7;   // |hi| <= 16 * 127 * 32: no overflow
                        qm_mma_s8_k16(d, a_lo[i][2 * half], a_lo[i][2 * half + 1], bw[j][half], hi);
                        acc[i][j][0] = fmaf((float)d[0], xs0 * ws.x, acc[i][j][0]);
                        acc[i][j][1] = fmaf((float)d[1], xs0 * ws.y, acc[i][j][1]);
                        acc[i][j][2] = fmaf((float)d[2], xs1 * ws.x, acc[i][j][2]);
                        acc[i][j][3] = fmaf((float)d[3], xs1 * ws.y, acc[i][j][3]);
                        if (F::MINS) {
                            const float2 wo = *(const float2*)&sh.w_o[grp][n];
                            acc[i][j][0] = fmaf(-xsum0, wo.x, acc[i][j][0]);
                            acc[i][j][1] = fmaf(-xsum0, wo.y, acc[i][j][1]);
                            acc[i][j][2] = fmaf(-xsum1, wo.x, acc[i][j][2]);
                            acc[i][j][3] = fmaf(-xsum1, wo.y, acc[i][j][3]);
                        }
                    }
                }
            }
        }
        __syncthreads();   // every warp is done with the tiles before the next stage overwrites them
    }

    if (splits > 1) {
        // the tiles of both format parts are numbered along x: blockIdx.x is the launch's row tile
        const int tile = blockIdx.y * gridDim.x + blockIdx.x;
        float4* tile_partials = reinterpret_cast<float4*>(partials) + (long long)tile * splits * (FM * FN * QM_THREADS);
        float4* mine = tile_partials + blockIdx.z * (FM * FN * QM_THREADS);
#pragma unroll
        for (int i = 0; i < FM; i++)
#pragma unroll
            for (int j = 0; j < FN; j++)
                __stcg(mine + (i * FN + j) * QM_THREADS + tid,
                       make_float4(acc[i][j][0], acc[i][j][1], acc[i][j][2], acc[i][j][3]));
        __threadfence();   // this split's partial is visible device-wide before its ticket is
        __syncthreads();
        if (tid == 0) sh.is_last_split = atomicAdd(tickets + tile, 1u) == (unsigned int)splits - 1;
        __syncthreads();
        if (!sh.is_last_split) return;
        __threadfence();
        // acc = split 0 + split 1 + ... in that order, this split's own part read back too (the same bits)
        const float4* part = tile_partials + tid;
        for (int z = 0; z < splits; z++, part += FM * FN * QM_THREADS)
#pragma unroll
            for (int i = 0; i < FM; i++)
#pragma unroll
                for (int j = 0; j < FN; j++) {
                    const float4 v = __ldcg(part + (i * FN + j) * QM_THREADS);
                    if (z == 0) {
                        acc[i][j][0] = v.x; acc[i][j][1] = v.y; acc[i][j][2] = v.z; acc[i][j][3] = v.w;
                    } else {
                        acc[i][j][0] += v.x; acc[i][j][1] += v.y; acc[i][j][2] += v.z; acc[i][j][3] += v.w;
                    }
                }
        if (tid == 0) tickets[tile] = 0u;   // every split of the tile has taken its ticket
    }

#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int tok = tok0 + warp_m * FM * 16 + i * 16 + g + 8 * h;
            if (tok >= ntok) continue;
            const float scale = inv_rms_in ? inv_rms_in[tok] : 1.0f;
#pragma unroll
            for (int j = 0; j < FN; j++) {
                const int row = row0 + warp_n * FN * 8 + j * 8 + t * 2;   // even: a (gate, up) pair
                const float v0 = acc[i][j][2 * h] * scale, v1 = acc[i][j][2 * h + 1] * scale;
                mma_store_pair<SILU_PAIRS>(tok, row, v0, v1, row_end, ldy, y, res, normw_out, xn_out);
            }
        }
    if (inv_rms_out == nullptr) return;

    // q8_mma.cu's last-block 1/rms: one ticket per row of token blocks (counter[0..7]), one beyond 8 rows
    const bool ticket_per_row = gridDim.y <= 8;
    unsigned int* ticket = counter + (ticket_per_row ? blockIdx.y : 0);
    const unsigned int blocks_in_ticket = ticket_per_row ? gridDim.x : gridDim.x * gridDim.y;
    __threadfence();   // this block's y is visible device-wide before its ticket is
    __syncthreads();
    if (tid == 0) sh.is_last_block = atomicAdd(ticket, 1u) == blocks_in_ticket - 1;
    __syncthreads();
    if (!sh.is_last_block) return;
    __threadfence();
    const int m_end = ticket_per_row ? min(tok0 + BM, ntok) : ntok;
    for (int m = (ticket_per_row ? tok0 : 0) + warp; m < m_end; m += QM_THREADS / 32) {
        const float* yrow = y + (long long)m * ldy;
        float sq = 0.f;
        for (int k = lane; k < N; k += 32) { float v = __ldcg(yrow + k); sq += v * v; }
        sq = warp_sum(sq);
        if (lane == 0) inv_rms_out[m] = 1.0f / sqrtf(sq / (float)N + eps);
    }
    if (tid == 0) *ticket = 0u;
}

template <class FA, class FB, int BM, int WARPS_M, bool SILU_PAIRS>
__device__ __forceinline__ void q4_mma_body(
        const unsigned char* qs, const unsigned char* meta, const float* x, int ldx, const float* inv_rms_in,
        float* y, int ldy, const float* res, const float* normw_out, float* xn_out, float* inv_rms_out,
        unsigned int* counter, float eps, int N, int K, int ntok, const unsigned char* qs_b,
        const unsigned char* meta_b, int rows_a, float* partials, unsigned int* tickets) {
    __shared__ MmaShared<BM> sh;   // one copy whichever part the block runs
    pdl_launch_dependents();
    const int head_blocks = (rows_a + QM_BN - 1) / QM_BN;
    if (same_format<FA, FB>::value || (int)blockIdx.x < head_blocks) {
        mma_part<FA, BM, WARPS_M, SILU_PAIRS>(sh, qs, meta, blockIdx.x * QM_BN, 0, rows_a, x, ldx, inv_rms_in, y,
                                              ldy, res, normw_out, xn_out, inv_rms_out, counter, eps, N, K, ntok,
                                              partials, tickets);
    } else {
        mma_part<FB, BM, WARPS_M, SILU_PAIRS>(sh, qs_b, meta_b, rows_a + (blockIdx.x - head_blocks) * QM_BN, rows_a,
                                              N, x, ldx, inv_rms_in, y, ldy, res, normw_out, xn_out, inv_rms_out,
                                              counter, eps, N, K, ntok, partials, tickets);
    }
}

// <fmt>[_<tail fmt>]_mma[16][_silu]: block_kernels.py's MMA_TILES; the split count is the grid's z
#define DEFINE_Q4_MMA(FA, FB, BM, WARPS_M, SILU, NAME)                                              \
    extern "C" __global__ void __launch_bounds__(QM_THREADS) NAME(                                 \
            const unsigned char* qs, const unsigned char* meta, const float* x, int ldx,           \
            const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out,  \
            float* xn_out, float* inv_rms_out, unsigned int* counter, float eps, int N, int K,     \
            int ntok, const unsigned char* qs_b, const unsigned char* meta_b, int rows_a,          \
            float* partials, unsigned int* tickets) {                                              \
        q4_mma_body<FA, FB, BM, WARPS_M, SILU>(qs, meta, x, ldx, inv_rms_in, y, ldy, res, normw_out,\
                                               xn_out, inv_rms_out, counter, eps, N, K, ntok, qs_b, \
                                               meta_b, rows_a, partials, tickets);                 \
    }
#define DEFINE_Q4_MMA_TILES(FA, FB, SILU, NAME)            \
    DEFINE_Q4_MMA(FA, FB, 64, 2, SILU, NAME)               \
    DEFINE_Q4_MMA(FA, FB, 16, 1, SILU, NAME##16)
DEFINE_Q4_MMA_TILES(FmtQ4_0, FmtQ4_0, false, q4_0_mma)
DEFINE_Q4_MMA(FmtQ4_0, FmtQ4_0, 64, 2, true, q4_0_mma_silu)
DEFINE_Q4_MMA(FmtQ4_0, FmtQ4_0, 16, 1, true, q4_0_mma16_silu)
DEFINE_Q4_MMA_TILES(FmtQ4_K, FmtQ4_K, false, q4_k_mma)
DEFINE_Q4_MMA(FmtQ4_K, FmtQ4_K, 64, 2, true, q4_k_mma_silu)
DEFINE_Q4_MMA(FmtQ4_K, FmtQ4_K, 16, 1, true, q4_k_mma16_silu)
DEFINE_Q4_MMA_TILES(FmtQ6_K, FmtQ6_K, false, q6_k_mma)
DEFINE_Q4_MMA(FmtQ6_K, FmtQ6_K, 64, 2, true, q6_k_mma_silu)
DEFINE_Q4_MMA(FmtQ6_K, FmtQ6_K, 16, 1, true, q6_k_mma16_silu)
DEFINE_Q4_MMA_TILES(FmtQ4_K, FmtQ6_K, false, q4_k_q6_k_mma)
