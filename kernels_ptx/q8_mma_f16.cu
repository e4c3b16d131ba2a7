// Q8_0 matrix-matrix product on fp16 tensor cores for prefill-sized steps (mma_variants.F16_MIN_TOKENS
// tokens and more), with the argument list and epilogues of q8_mma.cu (inv_rms_in scaling, SiLU·mul
// row pairs, residual, xn and last-block inv_rms).
//
// Arithmetic: weights dequantised to fp16 as fp16(q * d) (one rounding of an exact product), the fp32
// activations rounded to fp16, products summed in fp32 by mma.sync.m16n8k16.f32.f16.f16.f32.  With
// inv_rms_in, x is scaled per token before it is rounded (fp16(x * inv_rms)), not the sums after: the
// normed activations are O(norm weight), while a raw residual stream (qkv's, gate_up's, lm_head's x)
// may hold values past fp16's 65504.
//
// Roles as in q8_mma.cu: A (16 x 16, row) = 16 tokens of x, B (16 x 8, col) = 8 weight rows, so a
// thread's C pair (c0, c1) is two adjacent weight rows of one token (a (gate, up) pair for SiLU·mul).
// Fragment layouts (PTX ISA, m16n8k16 .f16; g = lane / 4, c = lane % 4):
//   A: a0 = (g, k 2c..2c+1), a1 = (g+8, k 2c..), a2 = (g, k 2c+8..), a3 = (g+8, k 2c+8..)
//   B: b0 = (k 2c..2c+1, n g), b1 = (k 2c+8..2c+9, n g)
// A dot product does not care in which order K is summed, so within each 16-wide K step logical k
// (2c, 2c+1, 2c+8, 2c+9) is taken to be physical k 4c..4c+3, for A and B alike: a thread's B fragment
// is then one 32-bit word of int8 weights (four consecutive k of row g) and its A fragment two 64-bit
// loads of fp16 x (rows g and g + 8), with no shuffles and no ldmatrix.
//
// Pipeline per BK-wide K stage: the int8 weight tile arrives by cp.async, STAGES deep; each thread's
// weight scales and x float4s for a later stage (XPF stages ahead) wait in registers meanwhile, then x
// is rounded to fp16 into one half of a double-buffered shared tile.  Each weight word is
// dequantised in registers (PRMT into the mantissa of 1024, subtract, scale) once per warp and used by
// all FM of the warp's 16-token tiles.
#include "common.cuh"
#include "mma_epilogue.cuh"

#define F16_W_STRIDE (BK + 16)   // bytes per int8 weight row: 32-bit fragment loads free of bank conflicts
#define F16_X_STRIDE (BK + 16)   // halves per fp16 x row: 64-bit fragment loads free of bank conflicts


__device__ __forceinline__ void f16mma_cp_async16(void* smem, const void* gmem, bool valid) {
    unsigned int dst = (unsigned int)__cvta_generic_to_shared(smem);
    int bytes = valid ? 16 : 0;   // 0: the 16 bytes are zero-filled (the K tail)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(bytes) : "memory");
}

__device__ __forceinline__ unsigned int f16x2_of(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));   // first source -> upper half
    return r;
}

// Two signed bytes of `biased` (each xor 0x80), picked by `selector`, times the f16x2 scale pair d2:
// 0x64uu is the fp16 1024 + u exactly, so (0x64uu - 1152) is the byte's value and one mul rounds q * d.
__device__ __forceinline__ unsigned int dequant_pair(unsigned int biased, unsigned int selector, unsigned int d2) {
    unsigned int h = __byte_perm(biased, 0x64646464u, selector), q, r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(q) : "r"(h), "r"(0x64806480u));
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(q), "r"(d2));
    return r;
}

// d += a * b over one 16 x 8 x 16 tile
__device__ __forceinline__ void mma_f16_acc(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                            unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES, int XPF, bool SILU_PAIRS>
__device__ __forceinline__ void q8_f16mma_body(
        const int8* __restrict__ qs, const half_bits* __restrict__ scales, const float* x, int ldx,
        const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out, float* xn_out,
        float* inv_rms_out, unsigned int* counter, float eps, int N, int K, int ntok) {
    constexpr int THREADS = 32 * WARPS_M * WARPS_N;
    constexpr int FM = BM / 16 / WARPS_M, FN = BN / 8 / WARPS_N;   // mma tiles per warp
    constexpr int KB = BK / 32;                                    // Q8_0 blocks per stage
    constexpr int X_LOADS = BM * (BK / 4) / THREADS;               // float4 of x per thread per stage
    constexpr int W_LOADS = BN * (BK / 16) / THREADS;              // 16-byte weight chunks per thread
    static_assert(FM >= 1 && FN >= 1 && X_LOADS >= 1 && W_LOADS >= 1 && BK % 32 == 0 && STAGES >= 2 && XPF >= 1,
                  "tile");
    static_assert(BM * (BK / 4) % THREADS == 0 && BN * (BK / 16) % THREADS == 0, "tile shape");

    __shared__ __align__(16) unsigned char w_tile[STAGES][BN * F16_W_STRIDE];
    __shared__ __align__(16) half_bits x_tile[2][BM * F16_X_STRIDE];   // 128 x 128, 4 stages: 48 KiB in all
    pdl_launch_dependents();

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c = lane & 3;                          // mma fragment coordinates
    const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
    const int tok0 = blockIdx.y * BM, row0 = blockIdx.x * BN;
    const int stages = (K + BK - 1) / BK, kblocks = K >> 5;

    auto issue_weights = [&](int slot, int k0) {   // constant weights: safe before pdl_wait
        if (k0 < K) {
#pragma unroll
            for (int j = 0; j < W_LOADS; j++) {
                int chunk = tid + j * THREADS, r = chunk / (BK / 16), part = chunk % (BK / 16);
                int row = min(row0 + r, N - 1);   // rows past N: finite values, never written
                int k = k0 + part * 16;
                const int8* src = qs + (long long)row * K + min(k, K - 16);
                f16mma_cp_async16(&w_tile[slot][r * F16_W_STRIDE + part * 16], src, k < K);
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");   // one group per stage, empty past K
    };
    // the f16x2 scale pair (d, d) of this thread's B-fragment row g of each n tile, per block of a stage
    auto load_scales = [&](int k0, unsigned int (&dst)[FN][KB]) {
#pragma unroll
        for (int j = 0; j < FN; j++) {
            const int row = min(row0 + warp_n * FN * 8 + j * 8 + g, N - 1);
#pragma unroll
            for (int b = 0; b < KB; b++) {
                const int block = (k0 >> 5) + b;
                const unsigned int h = block < kblocks ? scales[(long long)row * kblocks + block] : 0u;
                dst[j][b] = h | (h << 16);
            }
        }
    };
    auto load_x = [&](int k0, float4 (&dst)[X_LOADS]) {
#pragma unroll
        for (int j = 0; j < X_LOADS; j++) {
            int f = tid + j * THREADS, r = f / (BK / 4), k = k0 + (f % (BK / 4)) * 4;
            int tok = tok0 + r;
            dst[j] = (tok < ntok && k < K) ? *(const float4*)(x + (long long)tok * ldx + k)
                                           : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    float x_scale[X_LOADS];   // inv_rms_in of each x row this thread loads (the same rows every stage)
    auto store_x = [&](int buffer, const float4 (&src)[X_LOADS]) {
#pragma unroll
        for (int j = 0; j < X_LOADS; j++) {
            int f = tid + j * THREADS, r = f / (BK / 4), c4 = f % (BK / 4);
            const float4 v = make_float4(src[j].x * x_scale[j], src[j].y * x_scale[j], src[j].z * x_scale[j],
                                         src[j].w * x_scale[j]);
            *(uint2*)&x_tile[buffer][r * F16_X_STRIDE + c4 * 4] = make_uint2(f16x2_of(v.x, v.y), f16x2_of(v.z, v.w));
        }
    };

    float acc[FM][FN][4];
#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int j = 0; j < FN; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

    // x and the scales of stage s wait in set s % XPF of these registers, loaded XPF stages ahead
    float4 x_regs[XPF][X_LOADS];
    unsigned int scale_regs[XPF][FN][KB];
#pragma unroll
    for (int st = 0; st < STAGES - 1; st++) issue_weights(st, st * BK);
#pragma unroll
    for (int d = 0; d < XPF; d++) load_scales(d * BK, scale_regs[d]);
    pdl_wait();   // x and inv_rms_in are written by the previous kernel
#pragma unroll
    for (int j = 0; j < X_LOADS; j++) {
        const int tok = tok0 + (tid + j * THREADS) / (BK / 4);
        x_scale[j] = inv_rms_in && tok < ntok ? inv_rms_in[tok] : 1.0f;
    }
#pragma unroll
    for (int d = 0; d < XPF; d++) load_x(d * BK, x_regs[d]);   // past K: zeros

    auto stage = [&](int s, float4 (&x_next)[X_LOADS], unsigned int (&scale_next)[FN][KB]) {
        const int buffer = s & 1, slot = s % STAGES;
        store_x(buffer, x_next);
        unsigned int scale[FN][KB];
#pragma unroll
        for (int j = 0; j < FN; j++)
#pragma unroll
            for (int b = 0; b < KB; b++) scale[j][b] = scale_next[j][b];
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");   // stage s's weights are in
        __syncthreads();   // ... for every thread, x of stage s too; every warp is done with stage s - 1
        issue_weights((s + STAGES - 1) % STAGES, (s + STAGES - 1) * BK);   // into stage s - 1's slot
        if (s + XPF < stages) {
            load_scales((s + XPF) * BK, scale_next);
            load_x((s + XPF) * BK, x_next);
        }
        const half_bits* xt = x_tile[buffer];
        const unsigned char* wt = w_tile[slot];
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            unsigned int a[FM][4];
#pragma unroll
            for (int i = 0; i < FM; i++) {
                const half_bits* p = xt + (warp_m * FM * 16 + i * 16 + g) * F16_X_STRIDE + kk * 16 + c * 4;
                const uint2 top = *(const uint2*)p, bottom = *(const uint2*)(p + 8 * F16_X_STRIDE);
                a[i][0] = top.x;      // physical k 4c, 4c+1 = logical 2c, 2c+1
                a[i][1] = bottom.x;
                a[i][2] = top.y;      // physical k 4c+2, 4c+3 = logical 2c+8, 2c+9
                a[i][3] = bottom.y;
            }
#pragma unroll
            for (int j = 0; j < FN; j++) {
                const unsigned int word =
                        *(const unsigned int*)(wt + (warp_n * FN * 8 + j * 8 + g) * F16_W_STRIDE + kk * 16 + c * 4);
                const unsigned int biased = word ^ 0x80808080u, d2 = scale[j][kk >> 1];
                const unsigned int b0 = dequant_pair(biased, 0x4140u, d2), b1 = dequant_pair(biased, 0x4342u, d2);
#pragma unroll
                for (int i = 0; i < FM; i++) mma_f16_acc(acc[i][j], a[i], b0, b1);
            }
        }
    };
    for (int s0 = 0; s0 < stages; s0 += XPF)   // unrolled by XPF: each register set has a fixed name
#pragma unroll
        for (int d = 0; d < XPF; d++)
            if (s0 + d < stages) stage(s0 + d, x_regs[d], scale_regs[d]);
    asm volatile("cp.async.wait_group 0;" ::: "memory");   // no copy outlives the block

#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int tok = tok0 + warp_m * FM * 16 + i * 16 + g + 8 * h;
            if (tok >= ntok) continue;
#pragma unroll
            for (int j = 0; j < FN; j++) {
                const int row = row0 + warp_n * FN * 8 + j * 8 + c * 2;   // even: a (gate, up) pair
                const float v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];   // inv_rms_in: already in x
                mma_store_pair<SILU_PAIRS>(tok, row, v0, v1, N, ldy, y, res, normw_out, xn_out);
            }
        }
    if (inv_rms_out == nullptr) return;

    // The last block of each row of token blocks computes its tokens' 1/rms, as in q8_mma.cu (one
    // ticket per row of blocks, counter[0..7]; more than 8 rows of blocks: one ticket).
    const bool ticket_per_row = gridDim.y <= 8;
    unsigned int* ticket = counter + (ticket_per_row ? blockIdx.y : 0);
    const unsigned int blocks_in_ticket = ticket_per_row ? gridDim.x : gridDim.x * gridDim.y;
    __threadfence();   // this block's y is visible device-wide before its ticket is
    __syncthreads();
    const bool last = tid == 0 && atomicAdd(ticket, 1u) == blocks_in_ticket - 1;
    if (!__syncthreads_or(last)) return;   // the block's verdict, without a shared flag
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

// q8_f16mma_<BM>x<BN>[k<BK>][w<warps>][_s<STAGES>][_x<XPF>][_b<MINB>] (+ _silu): the tiles of
// kestrel_stream/cuda/mma_variants.F16_TILES; MINB blocks per SM caps the registers (65536 / (MINB x threads));
// XPF: stages x is loaded ahead of its use
#define DEFINE_F16MMA(BM, BN, BK, WM, WN, ST, XPF, MINB, SILU, NAME)                                 \
    extern "C" __global__ void __launch_bounds__(32 * WM * WN, MINB) NAME(                           \
            const int8* qs, const half_bits* scales, const float* x, int ldx,                        \
            const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out,    \
            float* xn_out, float* inv_rms_out, unsigned int* counter, float eps, int N, int K,       \
            int ntok) {                                                                              \
        q8_f16mma_body<BM, BN, BK, WM, WN, ST, XPF, SILU>(qs, scales, x, ldx, inv_rms_in, y, ldy, res,    \
                                                     normw_out, xn_out, inv_rms_out, counter, eps, N, K, \
                                                     ntok);                                          \
    }
#define DEFINE_F16MMA_PAIR(BM, BN, BK, WM, WN, ST, XPF, MINB, SUFFIX)                  \
    DEFINE_F16MMA(BM, BN, BK, WM, WN, ST, XPF, MINB, false, q8_f16mma_##SUFFIX)        \
    DEFINE_F16MMA(BM, BN, BK, WM, WN, ST, XPF, MINB, true, q8_f16mma_##SUFFIX##_silu)
DEFINE_F16MMA_PAIR(128, 128, 32, 2, 4, 4, 1, 1, 128x128)
DEFINE_F16MMA_PAIR(128, 128, 32, 2, 4, 4, 2, 1, 128x128_x2)
DEFINE_F16MMA_PAIR(128, 128, 32, 2, 4, 4, 1, 2, 128x128_b2)
DEFINE_F16MMA_PAIR(128, 128, 32, 2, 4, 3, 1, 1, 128x128_s3)
DEFINE_F16MMA_PAIR(64, 128, 32, 1, 4, 4, 1, 1, 64x128)
DEFINE_F16MMA_PAIR(64, 128, 32, 1, 4, 4, 2, 1, 64x128_x2)
DEFINE_F16MMA_PAIR(64, 128, 32, 2, 4, 4, 1, 1, 64x128w8)
DEFINE_F16MMA_PAIR(64, 128, 32, 2, 4, 4, 2, 1, 64x128w8_x2)
DEFINE_F16MMA_PAIR(128, 64, 32, 2, 2, 4, 1, 1, 128x64)
DEFINE_F16MMA_PAIR(64, 64, 32, 1, 2, 4, 1, 1, 64x64)
DEFINE_F16MMA_PAIR(64, 64, 64, 2, 2, 4, 1, 1, 64x64k64)
