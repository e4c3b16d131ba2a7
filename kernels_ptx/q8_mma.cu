// Q8_0 matrix-matrix product on int8 tensor cores for steps of more than 8
// tokens, with the argument list and epilogues of q8_matmul.cu / q8_gemv.cu
// (inv_rms_in scaling, SiLU·mul row pairs, residual, xn and last-block inv_rms).
//
// Activations (fp32) are quantised on the fly per token and 32-wide block in
// two int8 levels: d = amax / 127, hi = rn(v / d), lo = rn((v - hi d) 128 / d),
// so v = (128 hi + lo) d / 128 to about 2^-15 of the block's amax (one int8
// level alone, as llama.cpp's mmq does, is ~2^-8: too coarse to stay within
// 2e-3 of the fp32 reference after a few dozen layers).  A 32-block is exactly
// one mma.sync.m16n8k32 K step; hi and lo run as two chained mmas,
//   c = mma(lo, w, mma(hi, w, 0) << 7)      (exact in int32),
// and c * (d / 128) * w_scale goes into the fp32 accumulators.
//
// Roles: A (16 x 32, row) = activations, 16 tokens; B (32 x 8, col) = weights,
// 8 rows: a thread's C pair (c0, c1) is two adjacent weight rows of one token,
// so a (gate, up) row pair stays in one thread for the SiLU·mul epilogue.
// A block owns BM tokens x BN weight rows; per BK-wide K stage the weight tile
// arrives by cp.async (double buffered) while the next x tile waits in
// registers, to be quantised into shared memory after the current stage.  Few
// tokens mean little work per stage: those tiles take a longer BK, so more
// bytes are in flight per stage and a row of K costs fewer stage latencies.
//
// Split K (few tokens, few row tiles: too few blocks to keep the SMs' loads in flight): gridDim.z
// blocks share one output tile, each walking a contiguous run of ceil(stages / gridDim.z) K stages
// with the arithmetic of the unsplit kernel.  Every split parks its fp32 fragment in `partials`
// (in the thread's own fragment order, so stores and reloads are coalesced float4), then takes the
// tile's ticket; the last to arrive sums splits 0..z-1 in order (a fixed order: the result does not
// depend on which block came last), resets the ticket for the next launch or graph replay, and runs
// the epilogue alone.  gridDim.z == 1 never touches partials or tickets; tiles of more than 16
// tokens are compiled without the split (gridDim.z must be 1).
#include "common.cuh"
#include "mma_epilogue.cuh"
#include "q8_mma.cuh"

// bytes per shared row: BK + 16 keeps the fragment loads free of bank conflicts (BK a multiple of 64)
#define MMA_STRIDE (BK + 16)

template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, bool SILU_PAIRS>
__device__ __forceinline__ void q8_mma_body(
        const int8* __restrict__ qs, const half_bits* __restrict__ scales, const float* x, int ldx,
        const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out, float* xn_out,
        float* inv_rms_out, unsigned int* counter, float eps, int N, int K, int ntok, float* partials,
        unsigned int* tickets) {
    constexpr int THREADS = 32 * WARPS_M * WARPS_N;
    constexpr int FM = BM / 16 / WARPS_M, FN = BN / 8 / WARPS_N;   // mma tiles per warp
    constexpr int KB = BK / 32;                                    // Q8_0 blocks per stage
    constexpr int X_LOADS = BM * (BK / 4) / THREADS;               // float4 of x per thread per stage
    constexpr int W_LOADS = BN * (BK / 16) / THREADS;              // 16-byte weight chunks per thread
    constexpr int S_LOADS = BN * KB / THREADS;                     // weight scales per thread
    // only the 16-token tiles of few-token steps split K: the others keep the registers of their
    // prefill-sized tiles (mma_variants.Tile.splits_k); their grid's z is 1
    constexpr bool SPLIT_K = BM == 16;
    static_assert(FM >= 1 && FN >= 1 && X_LOADS >= 1 && W_LOADS >= 1 && S_LOADS >= 1 && BK % 64 == 0, "tile");
    static_assert(BM * (BK / 4) % THREADS == 0 && BN * (BK / 16) % THREADS == 0 && BN * KB % THREADS == 0,
                  "tile shape");

    __shared__ __align__(16) unsigned char w_tile[2][BN * MMA_STRIDE];
    __shared__ __align__(16) unsigned char x_tile[2][2][BM * MMA_STRIDE];   // [stage][hi|lo]
    __shared__ float w_scale[2][KB][BN];    // [stage][block of the stage][row]
    __shared__ float x_scale[2][KB][BM];    // [stage][block of the stage][token]
    __shared__ bool is_last_block, is_last_split;
    pdl_launch_dependents();

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;                          // mma fragment coordinates
    const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
    const int tok0 = blockIdx.y * BM, row0 = blockIdx.x * BN;
    const int kblocks = K >> 5;
    // this split's K stages [stage_begin, stage_end): the host picks gridDim.z so none is empty
    const int splits = gridDim.z, stages_all = (K + BK - 1) / BK, stages_per_split = (stages_all + splits - 1) / splits;
    const int stage_begin = blockIdx.z * stages_per_split, stage_end = min(stages_all, stage_begin + stages_per_split);

    auto issue_weights = [&](int stage, int k0) {   // constant weights: safe before pdl_wait
#pragma unroll
        for (int j = 0; j < W_LOADS; j++) {
            int c = tid + j * THREADS, r = c / (BK / 16), part = c % (BK / 16);
            int row = min(row0 + r, N - 1);
            int k = k0 + part * 16;
            const int8* src = qs + (long long)row * K + min(k, K - 16);
            cp_async16(&w_tile[stage][r * MMA_STRIDE + part * 16], src, k < K);
        }
        asm volatile("cp.async.commit_group;");
    };
    float w_scale_regs[S_LOADS];
    auto load_weight_scales = [&](int k0) {
#pragma unroll
        for (int j = 0; j < S_LOADS; j++) {
            int s = tid + j * THREADS, b = s / BN, r = s % BN;
            int row = min(row0 + r, N - 1), block = (k0 >> 5) + b;
            w_scale_regs[j] = block < kblocks ? half_to_float(scales[(long long)row * kblocks + block]) : 0.f;
        }
    };
    float4 x_regs[X_LOADS];
    auto load_x = [&](int k0) {
#pragma unroll
        for (int j = 0; j < X_LOADS; j++) {
            int f = tid + j * THREADS, r = f / (BK / 4), k = k0 + (f % (BK / 4)) * 4;
            int tok = tok0 + r;
            x_regs[j] = (tok < ntok && k < K) ? *(const float4*)(x + (long long)tok * ldx + k)
                                              : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    auto store_stage = [&](int stage) {   // quantise x, park the scales
#pragma unroll
        for (int j = 0; j < X_LOADS; j++) {
            int f = tid + j * THREADS, r = f / (BK / 4), c4 = f % (BK / 4);
            float4 v = x_regs[j];
            float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            float d = amax / 127.0f;
            float inv = d != 0.f ? 1.0f / d : 0.f;
            unsigned int hi, lo;
            quantise4(v, d, inv, hi, lo);
            *(unsigned int*)&x_tile[stage][0][r * MMA_STRIDE + c4 * 4] = hi;
            *(unsigned int*)&x_tile[stage][1][r * MMA_STRIDE + c4 * 4] = lo;
            if ((c4 & 7) == 0) x_scale[stage][c4 >> 3][r] = d * (1.0f / 128.0f);   // the unit of 128 hi + lo
        }
#pragma unroll
        for (int j = 0; j < S_LOADS; j++) {
            int s = tid + j * THREADS;
            w_scale[stage][s / BN][s % BN] = w_scale_regs[j];
        }
    };

    float acc[FM][FN][4];
#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int j = 0; j < FN; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[i][j][c] = 0.f;

    issue_weights(0, stage_begin * BK);
    load_weight_scales(stage_begin * BK);
    pdl_wait();   // x is written by the previous kernel
    load_x(stage_begin * BK);
    for (int s = stage_begin; s < stage_end; s++) {
        const int cur = (s - stage_begin) & 1;
        store_stage(cur);
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncthreads();   // stage `cur` complete; every warp is done with the other stage
        if (s + 1 < stage_end) {
            issue_weights(cur ^ 1, (s + 1) * BK);
            load_weight_scales((s + 1) * BK);
            load_x((s + 1) * BK);
        }
        const unsigned char* xt = x_tile[cur][0];
        const unsigned char* xt_lo = x_tile[cur][1];
        const unsigned char* wt = w_tile[cur];
#pragma unroll
        for (int b = 0; b < KB; b++) {
            unsigned int a[FM][4], a_lo[FM][4], bw[FN][2];
#pragma unroll
            for (int i = 0; i < FM; i++) {
                const int at = (warp_m * FM * 16 + i * 16 + g) * MMA_STRIDE + b * 32 + t * 4;
#pragma unroll
                for (int level = 0; level < 2; level++) {
                    const unsigned char* p = (level ? xt_lo : xt) + at;
                    unsigned int (&frag)[4] = level ? a_lo[i] : a[i];
                    frag[0] = *(const unsigned int*)p;
                    frag[1] = *(const unsigned int*)(p + 8 * MMA_STRIDE);
                    frag[2] = *(const unsigned int*)(p + 16);
                    frag[3] = *(const unsigned int*)(p + 8 * MMA_STRIDE + 16);
                }
            }
#pragma unroll
            for (int j = 0; j < FN; j++) {
                const unsigned char* p = wt + (warp_n * FN * 8 + j * 8 + g) * MMA_STRIDE + b * 32 + t * 4;
                bw[j][0] = *(const unsigned int*)p;
                bw[j][1] = *(const unsigned int*)(p + 16);
            }
#pragma unroll
            for (int i = 0; i < FM; i++) {
                const int m = warp_m * FM * 16 + i * 16 + g;
                const float xs0 = x_scale[cur][b][m], xs1 = x_scale[cur][b][m + 8];
#pragma unroll
                for (int j = 0; j < FN; j++) {
                    const int n = warp_n * FN * 8 + j * 8 + t * 2;
                    const float2 ws = *(const float2*)&w_scale[cur][b][n];
                    const int zero[4] = {0, 0, 0, 0};
                    int hi[4], d[4];
                    mma_s8(hi, a[i], bw[j], zero);
#pragma unroll
                    for (int c = 0; c < 4; c++) hi[c] <<= 7;   // |hi| <= 32 * 127 * 127: no overflow
                    mma_s8(d, a_lo[i], bw[j], hi);
                    acc[i][j][0] = fmaf((float)d[0], xs0 * ws.x, acc[i][j][0]);
                    acc[i][j][1] = fmaf((float)d[1], xs0 * ws.y, acc[i][j][1]);
                    acc[i][j][2] = fmaf((float)d[2], xs1 * ws.x, acc[i][j][2]);
                    acc[i][j][3] = fmaf((float)d[3], xs1 * ws.y, acc[i][j][3]);
                }
            }
        }
    }

    if (SPLIT_K && splits > 1) {
        const int tile = blockIdx.y * gridDim.x + blockIdx.x;
        float4* tile_partials = reinterpret_cast<float4*>(partials) + (long long)tile * splits * (FM * FN * THREADS);
        float4* mine = tile_partials + blockIdx.z * (FM * FN * THREADS);
#pragma unroll
        for (int i = 0; i < FM; i++)
#pragma unroll
            for (int j = 0; j < FN; j++)
                __stcg(mine + (i * FN + j) * THREADS + tid,
                       make_float4(acc[i][j][0], acc[i][j][1], acc[i][j][2], acc[i][j][3]));
        __threadfence();   // this split's partial is visible device-wide before its ticket is
        __syncthreads();
        if (tid == 0) is_last_split = atomicAdd(tickets + tile, 1u) == (unsigned int)splits - 1;
        __syncthreads();
        if (!is_last_split) return;
        __threadfence();
        // acc = split 0 + split 1 + ... in that order, this split's own part read back too (the same bits)
        const float4* part = tile_partials + tid;
        for (int z = 0; z < splits; z++, part += FM * FN * THREADS)
#pragma unroll
            for (int i = 0; i < FM; i++)
#pragma unroll
                for (int j = 0; j < FN; j++) {
                    const float4 v = __ldcg(part + (i * FN + j) * THREADS);
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
                mma_store_pair<SILU_PAIRS>(tok, row, v0, v1, N, ldy, y, res, normw_out, xn_out);
            }
        }
    if (inv_rms_out == nullptr) return;

    // The last block of each row of token blocks computes its tokens' 1/rms (one ticket per row of
    // blocks, counter[0..7]; the GEMV's sums live at [8..15]): several blocks share the reduction,
    // which for one block alone costs as much as a 512-token GEMM.  More than 8 rows: one ticket.
    const bool ticket_per_row = gridDim.y <= 8;
    unsigned int* ticket = counter + (ticket_per_row ? blockIdx.y : 0);
    const unsigned int blocks_in_ticket = ticket_per_row ? gridDim.x : gridDim.x * gridDim.y;
    __threadfence();   // this block's y is visible device-wide before its ticket is
    __syncthreads();
    if (tid == 0) is_last_block = atomicAdd(ticket, 1u) == blocks_in_ticket - 1;
    __syncthreads();
    if (!is_last_block) return;
    __threadfence();
    const int m_end = ticket_per_row ? min(tok0 + BM, ntok) : ntok;
    for (int m = (ticket_per_row ? tok0 : 0) + warp; m < m_end; m += THREADS / 32) {
        const float* row = y + (long long)m * ldy;
        float sq = 0.f;
        for (int k = lane; k < N; k += 32) { float v = __ldcg(row + k); sq += v * v; }
        sq = warp_sum(sq);
        if (lane == 0) inv_rms_out[m] = 1.0f / sqrtf(sq / (float)N + eps);
    }
    if (tid == 0) *ticket = 0u;
}

// q8_mma_<BM>x<BN>[k<BK>] (+ _silu): the tile shapes of kestrel_stream/cuda/mma_variants.py; the
// split count is the grid's z (mma_variants.choose_splits), not a kernel of its own
#define DEFINE_MMA(BM, BN, BK, WM, WN, SILU, NAME)                                               \
    extern "C" __global__ void __launch_bounds__(32 * WM * WN) NAME(                             \
            const int8* qs, const half_bits* scales, const float* x, int ldx,                    \
            const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out,\
            float* xn_out, float* inv_rms_out, unsigned int* counter, float eps, int N, int K,   \
            int ntok, float* partials, unsigned int* tickets) {                                  \
        q8_mma_body<BM, BN, BK, WM, WN, SILU>(qs, scales, x, ldx, inv_rms_in, y, ldy, res, normw_out,\
                                          xn_out, inv_rms_out, counter, eps, N, K, ntok, partials,   \
                                          tickets);                                              \
    }
#define DEFINE_MMA_PAIR(BM, BN, BK, WM, WN, SUFFIX)                     \
    DEFINE_MMA(BM, BN, BK, WM, WN, false, q8_mma_##SUFFIX)               \
    DEFINE_MMA(BM, BN, BK, WM, WN, true, q8_mma_##SUFFIX##_silu)
DEFINE_MMA_PAIR(16, 64, 64, 1, 4, 16x64)
DEFINE_MMA_PAIR(16, 64, 128, 1, 4, 16x64k128)
DEFINE_MMA_PAIR(16, 32, 256, 1, 4, 16x32k256)
DEFINE_MMA_PAIR(16, 32, 128, 1, 4, 16x32k128)
DEFINE_MMA_PAIR(16, 16, 256, 1, 2, 16x16k256)
DEFINE_MMA_PAIR(32, 64, 64, 2, 2, 32x64)
DEFINE_MMA_PAIR(32, 64, 128, 2, 2, 32x64k128)
DEFINE_MMA_PAIR(64, 64, 64, 2, 2, 64x64)
DEFINE_MMA_PAIR(64, 128, 64, 2, 4, 64x128)
