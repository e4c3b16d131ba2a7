// One token's x for the dp4a GEMV layouts (q4_gemv_dp4a.cuh): quantised per 32-block into two int8
// levels in shared memory, with the dp4a and rounding helpers both files use.
#pragma once
// (include common.cuh first: build.py splices includes one level deep)

// unsigned weight bytes (0..15, or 16 q) times signed x bytes, added to c
__device__ __forceinline__ int dp4a_us(unsigned int w, unsigned int x, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(w), "r"(x), "r"(c));
    return d;
}

__device__ __forceinline__ unsigned int word_of(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// v + 1.5 * 2^23 rounds v (|v| < 2^22) to an integer, to nearest even: the bits' low byte is that
// integer as int8 (what __float2int_rn then a byte mask give, without the quarter-rate F2I)
#define DP4A_ROUND 12582912.0f

__device__ __forceinline__ unsigned int pack_low_bytes(float a, float b, float c, float d) {
    const unsigned int ab = __byte_perm(__float_as_uint(a), __float_as_uint(b), 0x0040);
    const unsigned int cd = __byte_perm(__float_as_uint(c), __float_as_uint(d), 0x0040);
    return __byte_perm(ab, cd, 0x5410);
}

// 16 values of a 32-block (inv = 1/d, or 0 for an all-zero block) as hi and lo bytes: t = v inv,
// hi = rn(t) (q8_mma.cuh's rn(v inv)), lo = rn(128 (t - hi)), where t - hi and the 128 are exact
// (Sterbenz) and one FFMA rounds: one operation a value less than q8's fma(-hi, d, v) 128 inv, the
// same lo but for t's own rounding (2^-17 of d).  No clamp is needed: |t| <= 127 (1 + 3 ulp), |lo| <= 64.
__device__ __forceinline__ void quantise16(const float (&v)[16], float inv, uint4& hi, uint4& lo) {
    float rh[16], rl[16];
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const float t = __fmul_rn(v[i], inv);
        rh[i] = __fadd_rn(t, DP4A_ROUND);
        rl[i] = __fmaf_rn(__fsub_rn(t, __fsub_rn(rh[i], DP4A_ROUND)), 128.0f, DP4A_ROUND);
    }
    hi = make_uint4(pack_low_bytes(rh[0], rh[1], rh[2], rh[3]), pack_low_bytes(rh[4], rh[5], rh[6], rh[7]),
                    pack_low_bytes(rh[8], rh[9], rh[10], rh[11]), pack_low_bytes(rh[12], rh[13], rh[14], rh[15]));
    lo = make_uint4(pack_low_bytes(rl[0], rl[1], rl[2], rl[3]), pack_low_bytes(rl[4], rl[5], rl[6], rl[7]),
                    pack_low_bytes(rl[8], rl[9], rl[10], rl[11]), pack_low_bytes(rl[12], rl[13], rl[14], rl[15]));
}

// x [0, K) quantised into planes [8][dunits] (hi planes 0..3, lo planes 0..3), meta [dunits]
// {d0 / 128, sum0, d1 / 128, sum1} and sums16 [dunits][4] (each plane's 16 values: Q6_K's scales are per
// 16), a sum: of the quantised values, d / 128 * sum (128 hi + lo), so that the
// mins (and Q4_0's - 8) meet the same x as the levels: the product is then W times quantised x exactly,
// where the fp32 sum of x would add the error of sum level x_q against q x to it; elements past K (Q4_0's half D-unit) are zeros.  A warp takes 8
// D-units a turn, lane = 8 p + (v & 7): the two halves of a 32-block are lanes l and l ^ 8.
template <int THREADS>
__device__ __forceinline__ void quantise_x(const float* x, int K, int dunits, uint4* planes, float2* meta2,
                                           float* sums16) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, p = lane >> 3;
    for (int base = 8 * warp; base < dunits; base += 8 * (THREADS / 32)) {   // warp-uniform: full-mask shuffles
        const int v = base + (lane & 7), k = 64 * v + 16 * p;
        float xv[16];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float4 f = k < K ? ((const float4*)(x + k))[i] : make_float4(0.f, 0.f, 0.f, 0.f);
            xv[4 * i] = f.x;
            xv[4 * i + 1] = f.y;
            xv[4 * i + 2] = f.z;
            xv[4 * i + 3] = f.w;
        }
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < 16; i++) amax = fmaxf(amax, fabsf(xv[i]));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 8));
        const float d = amax / 127.0f;
        const float inv = d != 0.f ? 1.0f / d : 0.f;
        uint4 hi, lo;
        quantise16(xv, inv, hi, lo);
        int hi_sum = 0, lo_sum = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            hi_sum = dp4a_us(0x01010101u, word_of(hi, i), hi_sum);
            lo_sum = dp4a_us(0x01010101u, word_of(lo, i), lo_sum);
        }
        const int piece = 128 * hi_sum + lo_sum, sum = piece + __shfl_xor_sync(0xffffffffu, piece, 8);
        const float unit = d * (1.0f / 128.0f);   // of 128 hi + lo
        if (v < dunits) {
            planes[p * dunits + v] = hi;
            planes[(4 + p) * dunits + v] = lo;
            if ((p & 1) == 0) meta2[2 * v + (p >> 1)] = make_float2(unit, unit * (float)sum);
            sums16[4 * v + p] = unit * (float)piece;
        }
    }
}
