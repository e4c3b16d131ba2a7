// The building blocks of the 4/6-bit tensor-core GEMMs (q4_mma.cu, moe_mma.cu): tile sizes, shared memory,
// the m16n8k16 int8 mma, a stage's weights decoded to int8 and its x quantised in two levels (q4_mma.cu's
// header comment has the arithmetic).
#pragma once
#include "common.cuh"
#include "q4_formats.cuh"

#define QM_BN 64            // weight rows per block
#define QM_BK 128           // K per stage: a whole number of units of every format
#define QM_THREADS 128      // 4 warps: 2 x 2 for 64 tokens, 1 x 4 for 16
#define QM_STRIDE (QM_BK + 16)   // bytes per shared row: fragment loads spread over the banks
#define QM_GROUPS (QM_BK / 16)

template <int BM> struct MmaShared {
    __align__(16) unsigned char w_tile[QM_BN * QM_STRIDE];
    __align__(16) unsigned char x_tile[2][BM * QM_STRIDE];   // [hi|lo]
    __align__(16) float w_s[QM_GROUPS][QM_BN];
    __align__(16) float w_o[QM_GROUPS][QM_BN];
    float x_s[QM_GROUPS][BM];      // d / 128 per token and group
    float x_sum[QM_GROUPS][BM];    // fp32 sum of the group's x per token
    bool is_last_block, is_last_split;
};

// one group of 16: A rows g and g + 8 at k 4t..4t+3 (a0, a1), B column g at k 4t..4t+3 (b)
__device__ __forceinline__ void qm_mma_s8_k16(int (&d)[4], unsigned int a0, unsigned int a1, unsigned int b,
                                              const int (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]));
}

__device__ __forceinline__ int qm_quantise(float v, float inv) { return max(-127, min(127, __float2int_rn(v * inv))); }

__device__ __forceinline__ unsigned int qm_pack4(int q0, int q1, int q2, int q3) {
    return (q0 & 0xff) | ((q1 & 0xff) << 8) | ((q2 & 0xff) << 16) | ((unsigned int)(q3 & 0xff) << 24);
}

// unsigned level bytes minus BIAS as int8 bytes, byte-wise: v + (128 - BIAS) never carries for the
// formats' level ranges (Q4: 0..15, Q6_K: 0..63), and ^ 0x80 takes the 128 back off modulo 256
template <int BIAS>
__device__ __forceinline__ unsigned int levels_s8(unsigned int lv) {
    if (BIAS == 0) return lv;
    return (lv + 0x01010101u * (unsigned int)(128 - BIAS)) ^ 0x80808080u;
}

template <class F>
struct StageWeights {
    static constexpr int UNITS = QM_BK / F::UNIT;                  // units per row per stage
    static constexpr int SLOTS = QM_BN * UNITS / QM_THREADS;        // units per thread per stage
    static_assert(SLOTS >= 1 && QM_BN * UNITS % QM_THREADS == 0, "tile");
    typename F::Raw raw[SLOTS];

    __device__ __forceinline__ void load(const unsigned char* qs, const unsigned char* meta, int row0, int row_first,
                                         int row_end, int K, int k0) {
        const long long qs_row = F::qs_row(K), meta_row = F::meta_row(K);
        const int units = K / F::UNIT;
#pragma unroll
        for (int j = 0; j < SLOTS; j++) {
            const int slot = threadIdx.x + j * QM_THREADS, r = slot / UNITS, u = k0 / F::UNIT + slot % UNITS;
            const long long row = min(row0 + r, row_end - 1) - row_first;   // a clamped row is never stored
            if (u < units) {
                F::load(raw[j], qs + row * qs_row, meta + row * meta_row, u);
            } else {
                raw[j] = typename F::Raw{};   // the K tail (Q4_0): zero scales, zero products
            }
        }
    }

    template <class Shared>
    __device__ __forceinline__ void store(Shared& sh, int k0) const {
#pragma unroll
        for (int j = 0; j < SLOTS; j++) {
            const int slot = threadIdx.x + j * QM_THREADS, r = slot / UNITS, u = k0 / F::UNIT + slot % UNITS;
            Group g[F::GROUPS];
            F::decode(raw[j], u, g);
#pragma unroll
            for (int gi = 0; gi < F::GROUPS; gi++) {
                const int at = g[gi].k - k0;   // 0..QM_BK-16, a multiple of 16
                uint4 v;
                v.x = levels_s8<F::BIAS>(g[gi].lv[0]);
                v.y = levels_s8<F::BIAS>(g[gi].lv[1]);
                v.z = levels_s8<F::BIAS>(g[gi].lv[2]);
                v.w = levels_s8<F::BIAS>(g[gi].lv[3]);
                *(uint4*)&sh.w_tile[r * QM_STRIDE + at] = v;
                sh.w_s[at >> 4][r] = g[gi].s;
                sh.w_o[at >> 4][r] = g[gi].o;
            }
        }
    }
};

// x [tok0, tok0 + BM) x [k0, k0 + BK): loaded into registers (zeros past ntok and K), then quantised into
// shared memory.  The 16-token tile loads the next stage's x with its weights, while a stage computes
// (16 registers); the 64-token one loads each stage's as it quantises it (64 would be too many).
template <int BM> struct StageX {
    static constexpr int LOADS = BM * (QM_BK / 4) / QM_THREADS;
    static constexpr bool AHEAD = BM <= 16;
    static_assert(LOADS >= 1 && BM * (QM_BK / 4) % QM_THREADS == 0, "x tile");
    float4 v[LOADS];

    __device__ __forceinline__ void load(const float* x, int ldx, int tok0, int ntok, int K, int k0) {
#pragma unroll
        for (int j = 0; j < LOADS; j++) {
            const int f = threadIdx.x + j * QM_THREADS, r = f / (QM_BK / 4), c4 = f % (QM_BK / 4);
            const int tok = tok0 + r, k = k0 + 4 * c4;
            v[j] = (tok < ntok && k < K) ? *(const float4*)(x + (long long)tok * ldx + k)
                                         : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }

    // rows[j]: the x row of this thread's j-th load (moe_mma.cu's gathered tokens), nullptr past the tile's tokens
    __device__ __forceinline__ void load_rows(const float* const (&rows)[LOADS], int K, int k0) {
#pragma unroll
        for (int j = 0; j < LOADS; j++) {
            const int k = k0 + 4 * ((threadIdx.x + j * QM_THREADS) % (QM_BK / 4));
            v[j] = rows[j] != nullptr && k < K ? *(const float4*)(rows[j] + k) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }

    __device__ __forceinline__ void store(MmaShared<BM>& sh) const {
#pragma unroll
        for (int j = 0; j < LOADS; j++) {
            const int f = threadIdx.x + j * QM_THREADS, r = f / (QM_BK / 4), c4 = f % (QM_BK / 4);
            const float4 x4 = v[j];
            // a group of 16 is 4 consecutive lanes
            float amax = fmaxf(fmaxf(fabsf(x4.x), fabsf(x4.y)), fmaxf(fabsf(x4.z), fabsf(x4.w)));
            float sum = (x4.x + x4.y) + (x4.z + x4.w);
#pragma unroll
            for (int o = 1; o < 4; o <<= 1) {
                amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
                sum += __shfl_xor_sync(0xffffffffu, sum, o);
            }
            const float d = amax / 127.0f;
            const float inv = d != 0.f ? 1.0f / d : 0.f;
            const float inv_lo = inv * 128.0f;   // exact: a power of two
            const int h0 = qm_quantise(x4.x, inv), h1 = qm_quantise(x4.y, inv), h2 = qm_quantise(x4.z, inv),
                      h3 = qm_quantise(x4.w, inv);
            *(unsigned int*)&sh.x_tile[0][r * QM_STRIDE + 4 * c4] = qm_pack4(h0, h1, h2, h3);
            *(unsigned int*)&sh.x_tile[1][r * QM_STRIDE + 4 * c4] =
                qm_pack4(qm_quantise(__fmaf_rn(-(float)h0, d, x4.x), inv_lo),
                         qm_quantise(__fmaf_rn(-(float)h1, d, x4.y), inv_lo),
                         qm_quantise(__fmaf_rn(-(float)h2, d, x4.z), inv_lo),
                         qm_quantise(__fmaf_rn(-(float)h3, d, x4.w), inv_lo));
            if ((c4 & 3) == 0) {
                sh.x_s[c4 >> 2][r] = d * (1.0f / 128.0f);   // the unit of 128 hi + lo
                sh.x_sum[c4 >> 2][r] = sum;
            }
        }
    }
};

// One stage of q4_mma.cu's main loop (its arithmetic, which moe_mma.cu calls): a warp's FM x FN mma tiles of
// the stage's quantised x against its decoded weights, a group of 16 per m16n8k16 step,
//   acc += mma(lo, w, mma(hi, w, 0) << 7) * (d / 128) * s  - xsum * o
template <class F, int BM, int WARPS_M>
__device__ __forceinline__ void mma_stage_blocks(const MmaShared<BM>& sh,
                                                 float (&acc)[BM / 16 / WARPS_M][QM_BN / 8 / (QM_THREADS / 32 / WARPS_M)][4],
                                                 int warp_m, int warp_n, int g, int t) {
    constexpr int WARPS_N = QM_THREADS / 32 / WARPS_M;
    constexpr int FM = BM / 16 / WARPS_M, FN = QM_BN / 8 / WARPS_N;
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
}
