// The routed layer's experts on int8 tensor cores for steps of many tokens (kestrel_stream/cuda/moe_kernels.py
// picks them over moe.cu's expert GEMVs from the step's token count): a grouped GEMM, q8_mma.cu's tile with a
// third grid dimension over the chosen experts, with moe.cu's arguments (moe_experts_<fmt>_m<M>) and groups.
//
//   moe_mma_<fmt>_<BM>x<BN>[_silu]
//                 grid (row tiles, token tile slots, experts): block (x, y, s) takes the s-th chosen expert that
//                 has a slot in the expert pool (blocks past the step's count exit), rows [BN x, BN x + BN) of
//                 its weight from the slot, and its tokens' tiles y, y + gridDim.y, ... of BM (the grid is
//                 sized for the worst case on the host; what a step routes is read here, on the device).
//                 gate_up (_silu): x rows gathered by token through `sorted`, times 1/rms, SiLU of (gate, up)
//                 row pairs -> act rows in grouped order; down: the act rows in order -> one output row per
//                 choice, which moe_combine sums as it does the GEMVs'.
//
// Q8_0: q8_mma.cu's arithmetic (q8_mma.cuh): x quantised per token and 32-block in two int8 levels into
// shared memory, the weight tile by cp.async (double buffered), c = mma(lo, w, mma(hi, w, 0) << 7) per block,
// c * (d / 128) * w_scale into fp32.  Q4_0, Q4_K, Q6_K: q4_mma.cu's (q4_mma.cuh): weights decoded to int8
// levels per stage of 128, x in two levels per group of 16, a group's scale and min per product.  The store
// is mma_epilogue.cuh's (a thread's C pair is two adjacent weight rows, a (gate, up) pair).  No split K: a
// step that routes many tokens has blocks enough.
// Expert pool (moe.cu): slot s's rows at qs + s * qs_slot and meta + s * meta_slot in q4_formats.cuh's layout
// (Q8_0: int8 [N, K] and fp16 scales [N, K / 32], the dense layout q8_mma.cu reads).
#include "common.cuh"
#include "mma_epilogue.cuh"
#include "q8_mma.cuh"
#include "q4_formats.cuh"
#include "q4_mma.cuh"

#define MOE_MMA_STRIDE(BK) ((BK) + 16)   // bytes per shared row, as q8_mma.cu: fragment loads free of bank conflicts

// the expert of block z and its slot's rows: false where the step chose fewer experts (the block exits)
struct ExpertRows {
    int first, end;               // its choices: sorted[first .. end)
    const unsigned char* qs;      // its slot's rows
    const unsigned char* meta;
};

__device__ __forceinline__ bool expert_of_block(ExpertRows& ex, const unsigned char* qs, const unsigned char* meta,
                                                long long qs_slot, long long meta_slot, const int* slot_of,
                                                const int* groups, int E) {
    const int* active = groups + E + 1;
    if ((int)blockIdx.z >= active[E]) return false;
    const int e = active[blockIdx.z];
    const long long slot = slot_of[e];
    ex = {groups[e], groups[e + 1], qs + slot * qs_slot, meta + slot * meta_slot};
    return true;
}

// a block's finished tile: its rows (the expert's choices p0.., ntok of them) times 1/rms where given (gate_up:
// the token's, found through `sorted` when x was gathered), SiLU of (gate, up) pairs or the plain rows, into y
template <int FM, int FN, bool SILU>
__device__ __forceinline__ void store_expert_tile(const float (&acc)[FM][FN][4], int p0, int ntok, int row0,
                                                  int warp_m, int warp_n, int g, int t, const float* inv_rms,
                                                  int gather, const int* sorted, int k, int N, int ldy, float* y) {
#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int m = warp_m * FM * 16 + i * 16 + g + 8 * h;
            if (m >= ntok) continue;
            const float scale = inv_rms ? inv_rms[gather ? sorted[p0 + m] / k : p0 + m] : 1.0f;
#pragma unroll
            for (int j = 0; j < FN; j++) {
                const int row = row0 + warp_n * FN * 8 + j * 8 + t * 2;   // even: a (gate, up) pair
                mma_store_pair<SILU>(p0 + m, row, acc[i][j][2 * h] * scale, acc[i][j][2 * h + 1] * scale, N,
                                     ldy, y, nullptr, nullptr, nullptr);
            }
        }
}

// Q8_0: q8_mma.cu's double-buffered tile over the expert's token tiles
template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, bool SILU>
__device__ __forceinline__ void moe_mma_q8_body(
        const unsigned char* qs, const unsigned char* meta, long long qs_slot, long long meta_slot,
        const int* slot_of, const int* groups, const float* x, int ldx, int gather, const float* inv_rms,
        float* y, int ldy, int N, int K, int E, int k) {
    constexpr int THREADS = 32 * WARPS_M * WARPS_N, STRIDE = MOE_MMA_STRIDE(BK);
    constexpr int FM = BM / 16 / WARPS_M, FN = BN / 8 / WARPS_N;   // mma tiles per warp
    constexpr int KB = BK / 32;                                    // Q8_0 blocks per stage
    constexpr int X_LOADS = BM * (BK / 4) / THREADS;               // float4 of x per thread per stage
    constexpr int W_LOADS = BN * (BK / 16) / THREADS;              // 16-byte weight chunks per thread
    constexpr int S_LOADS = BN * KB / THREADS;                     // weight scales per thread
    static_assert(FM >= 1 && FN >= 1 && X_LOADS >= 1 && W_LOADS >= 1 && S_LOADS >= 1 && BK % 64 == 0, "tile");
    static_assert(BM * (BK / 4) % THREADS == 0 && BN * (BK / 16) % THREADS == 0 && BN * KB % THREADS == 0,
                  "tile shape");

    __shared__ __align__(16) unsigned char w_tile[2][BN * STRIDE];
    __shared__ __align__(16) unsigned char x_tile[2][2][BM * STRIDE];   // [stage][hi|lo]
    __shared__ float w_scale[2][KB][BN];    // [stage][block of the stage][row]
    __shared__ float x_scale[2][KB][BM];    // [stage][block of the stage][token of the tile]
    pdl_launch_dependents();
    pdl_wait();   // the route kernel's groups, x and 1/rms (and which expert's weights: no load before this)

    ExpertRows ex;
    if (!expert_of_block(ex, qs, meta, qs_slot, meta_slot, slot_of, groups, E)) return;
    const int* sorted = groups + 2 * (E + 1);
    const int8* wq = (const int8*)ex.qs;
    const half_bits* scales = (const half_bits*)ex.meta;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;                          // mma fragment coordinates
    const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
    const int row0 = blockIdx.x * BN, kblocks = K >> 5, stages = (K + BK - 1) / BK;

    auto issue_weights = [&](int stage, int k0) {
#pragma unroll
        for (int j = 0; j < W_LOADS; j++) {
            const int c = tid + j * THREADS, r = c / (BK / 16), part = c % (BK / 16);
            const int row = min(row0 + r, N - 1);   // a clamped row is never stored
            const int kk = k0 + part * 16;
            cp_async16(&w_tile[stage][r * STRIDE + part * 16], wq + (long long)row * K + min(kk, K - 16), kk < K);
        }
        asm volatile("cp.async.commit_group;");
    };
    float w_scale_regs[S_LOADS];
    auto load_weight_scales = [&](int k0) {
#pragma unroll
        for (int j = 0; j < S_LOADS; j++) {
            const int s = tid + j * THREADS, b = s / BN, r = s % BN;
            const int row = min(row0 + r, N - 1), block = (k0 >> 5) + b;
            w_scale_regs[j] = block < kblocks ? half_to_float(scales[(long long)row * kblocks + block]) : 0.f;
        }
    };

    for (int p0 = ex.first + (int)blockIdx.y * BM; p0 < ex.end; p0 += gridDim.y * BM) {
        const int ntok = min(BM, ex.end - p0);
        // this thread's x rows of the tile: by token (gate_up: choice sorted[p] is token sorted[p] / k) or in
        // grouped order (down); none past the expert's tokens (zeros, never stored)
        const float* x_rows[X_LOADS];
#pragma unroll
        for (int j = 0; j < X_LOADS; j++) {
            const int r = (tid + j * THREADS) / (BK / 4);
            x_rows[j] = r < ntok ? x + (long long)(gather ? sorted[p0 + r] / k : p0 + r) * ldx : nullptr;
        }
        float4 x_regs[X_LOADS];
        auto load_x = [&](int k0) {
#pragma unroll
            for (int j = 0; j < X_LOADS; j++) {
                const int kk = k0 + ((tid + j * THREADS) % (BK / 4)) * 4;
                x_regs[j] = x_rows[j] != nullptr && kk < K ? *(const float4*)(x_rows[j] + kk)
                                                           : make_float4(0.f, 0.f, 0.f, 0.f);
            }
        };
        auto store_stage = [&](int stage) {   // quantise x (q8_mma.cu's two levels), park the scales
#pragma unroll
            for (int j = 0; j < X_LOADS; j++) {
                const int f = tid + j * THREADS, r = f / (BK / 4), c4 = f % (BK / 4);
                const float4 v = x_regs[j];
                float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
                for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
                const float d = amax / 127.0f;
                const float inv = d != 0.f ? 1.0f / d : 0.f;
                unsigned int hi, lo;
                quantise4(v, d, inv, hi, lo);
                *(unsigned int*)&x_tile[stage][0][r * STRIDE + c4 * 4] = hi;
                *(unsigned int*)&x_tile[stage][1][r * STRIDE + c4 * 4] = lo;
                if ((c4 & 7) == 0) x_scale[stage][c4 >> 3][r] = d * (1.0f / 128.0f);   // the unit of 128 hi + lo
            }
#pragma unroll
            for (int j = 0; j < S_LOADS; j++) {
                const int s = tid + j * THREADS;
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

        issue_weights(0, 0);
        load_weight_scales(0);
        load_x(0);
        for (int s = 0; s < stages; s++) {
            const int cur = s & 1;
            store_stage(cur);
            asm volatile("cp.async.wait_group 0;" ::: "memory");
            __syncthreads();   // stage `cur` complete; every warp is done with the other stage
            if (s + 1 < stages) {
                issue_weights(cur ^ 1, (s + 1) * BK);
                load_weight_scales((s + 1) * BK);
                load_x((s + 1) * BK);
            }
            mma_stage_q8<BM, BN, KB, FM, FN, STRIDE>(acc, x_tile[cur][0], x_tile[cur][1], w_tile[cur],
                                                     x_scale[cur][0], w_scale[cur][0], warp_m, warp_n, g, t);
        }

        store_expert_tile<FM, FN, SILU>(acc, p0, ntok, row0, warp_m, warp_n, g, t, inv_rms, gather, sorted, k, N,
                                        ldy, y);
        __syncthreads();   // the next tile's first stage overwrites shared memory the last one read
    }
}

// the 4/6-bit formats: q4_mma.cu's stages (QM_BN rows, QM_BK of K) over the expert's token tiles
template <class F, int BM, int WARPS_M, bool SILU>
__device__ __forceinline__ void moe_mma_blocks_body(
        const unsigned char* qs, const unsigned char* meta, long long qs_slot, long long meta_slot,
        const int* slot_of, const int* groups, const float* x, int ldx, int gather, const float* inv_rms,
        float* y, int ldy, int N, int K, int E, int k) {
    constexpr int WARPS_N = QM_THREADS / 32 / WARPS_M;
    constexpr int FM = BM / 16 / WARPS_M, FN = QM_BN / 8 / WARPS_N;   // mma tiles per warp
    static_assert(FM >= 1 && FN >= 1 && BM % (16 * WARPS_M) == 0, "tile");
    __shared__ MmaShared<BM> sh;
    pdl_launch_dependents();
    pdl_wait();   // the route kernel's groups, x and 1/rms (and which expert's weights: no load before this)
    ExpertRows ex;
    if (!expert_of_block(ex, qs, meta, qs_slot, meta_slot, slot_of, groups, E)) return;
    const int* sorted = groups + 2 * (E + 1);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
    const int row0 = blockIdx.x * QM_BN, stages = (K + QM_BK - 1) / QM_BK;

    for (int p0 = ex.first + (int)blockIdx.y * BM; p0 < ex.end; p0 += gridDim.y * BM) {
        const int ntok = min(BM, ex.end - p0);
        const float* x_rows[StageX<BM>::LOADS];   // as moe_mma_q8_body's
#pragma unroll
        for (int j = 0; j < StageX<BM>::LOADS; j++) {
            const int r = (tid + j * QM_THREADS) / (QM_BK / 4);
            x_rows[j] = r < ntok ? x + (long long)(gather ? sorted[p0 + r] / k : p0 + r) * ldx : nullptr;
        }
        float acc[FM][FN][4];
#pragma unroll
        for (int i = 0; i < FM; i++)
#pragma unroll
            for (int j = 0; j < FN; j++)
#pragma unroll
                for (int c = 0; c < 4; c++) acc[i][j][c] = 0.f;

        StageWeights<F> weights;
        weights.load(ex.qs, ex.meta, row0, 0, N, K, 0);
        StageX<BM> xs;
        if (StageX<BM>::AHEAD) xs.load_rows(x_rows, K, 0);
        for (int s = 0; s < stages; s++) {
            const int k0 = s * QM_BK;
            weights.store(sh, k0);
            if (!StageX<BM>::AHEAD) xs.load_rows(x_rows, K, k0);
            xs.store(sh);
            __syncthreads();
            if (s + 1 < stages) {
                weights.load(ex.qs, ex.meta, row0, 0, N, K, k0 + QM_BK);
                if (StageX<BM>::AHEAD) xs.load_rows(x_rows, K, k0 + QM_BK);
            }
            mma_stage_blocks<F, BM, WARPS_M>(sh, acc, warp_m, warp_n, g, t);
            __syncthreads();   // every warp is done with the tiles before the next stage overwrites them
        }

        store_expert_tile<FM, FN, SILU>(acc, p0, ntok, row0, warp_m, warp_n, g, t, inv_rms, gather, sorted, k, N,
                                        ldy, y);
    }
}

// moe_mma_<fmt>_<BM>x<BN> (+ _silu): the tiles of kestrel_stream/cuda/moe_kernels.py's MMA_TILES
#define DEFINE_MOE_MMA(BM, BN, BK, WM, WN, SILU, NAME)                                                \
    extern "C" __global__ void __launch_bounds__(32 * WM * WN) NAME(                                   \
            const unsigned char* qs, const unsigned char* meta, long long qs_slot, long long meta_slot,  \
            const int* slot_of, const int* groups, const float* x, int ldx, int gather,               \
            const float* inv_rms, float* y, int ldy, int N, int K, int E, int k) {                    \
        moe_mma_q8_body<BM, BN, BK, WM, WN, SILU>(qs, meta, qs_slot, meta_slot, slot_of, groups, x, ldx,  \
                                                  gather, inv_rms, y, ldy, N, K, E, k);                \
    }
#define DEFINE_MOE_MMA_PAIR(BM, BN, BK, WM, WN, SUFFIX)                   \
    DEFINE_MOE_MMA(BM, BN, BK, WM, WN, false, moe_mma_q8_0_##SUFFIX)       \
    DEFINE_MOE_MMA(BM, BN, BK, WM, WN, true, moe_mma_q8_0_##SUFFIX##_silu)
DEFINE_MOE_MMA_PAIR(16, 64, 64, 1, 4, 16x64)
DEFINE_MOE_MMA_PAIR(32, 64, 64, 2, 2, 32x64)
DEFINE_MOE_MMA_PAIR(64, 64, 64, 2, 2, 64x64)

#define DEFINE_MOE_MMA_BLOCKS(F, BM, WM, SILU, NAME)                                                  \
    extern "C" __global__ void __launch_bounds__(QM_THREADS) NAME(                                     \
            const unsigned char* qs, const unsigned char* meta, long long qs_slot, long long meta_slot,  \
            const int* slot_of, const int* groups, const float* x, int ldx, int gather,               \
            const float* inv_rms, float* y, int ldy, int N, int K, int E, int k) {                    \
        moe_mma_blocks_body<F, BM, WM, SILU>(qs, meta, qs_slot, meta_slot, slot_of, groups, x, ldx, gather, \
                                             inv_rms, y, ldy, N, K, E, k);                            \
    }
#define DEFINE_MOE_MMA_BLOCK_TILES(F, CODE)                                   \
    DEFINE_MOE_MMA_BLOCKS(F, 16, 1, false, moe_mma_##CODE##_16x64)            \
    DEFINE_MOE_MMA_BLOCKS(F, 16, 1, true, moe_mma_##CODE##_16x64_silu)        \
    DEFINE_MOE_MMA_BLOCKS(F, 32, 2, false, moe_mma_##CODE##_32x64)            \
    DEFINE_MOE_MMA_BLOCKS(F, 32, 2, true, moe_mma_##CODE##_32x64_silu)        \
    DEFINE_MOE_MMA_BLOCKS(F, 64, 2, false, moe_mma_##CODE##_64x64)            \
    DEFINE_MOE_MMA_BLOCKS(F, 64, 2, true, moe_mma_##CODE##_64x64_silu)
DEFINE_MOE_MMA_BLOCK_TILES(FmtQ4_0, q4_0)
DEFINE_MOE_MMA_BLOCK_TILES(FmtQ4_K, q4_k)
DEFINE_MOE_MMA_BLOCK_TILES(FmtQ6_K, q6_k)
