// Device helpers of the int8 tensor-core GEMMs (q8_mma.cu, q8_mma_pipe.cu, moe_mma.cu): cp.async, the
// m16n8k32 int8 mma, the two-level activation quantisation (hi, lo) they share, and q8_mma.cu's stage.
#pragma once


__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    unsigned int dst = (unsigned int)__cvta_generic_to_shared(smem);
    int bytes = valid ? 16 : 0;   // 0: the 16 bytes are zero-filled (the K tail)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(bytes));
}

// d = a * b + c over one 16 x 8 x 32 int8 tile
__device__ __forceinline__ void mma_s8(int (&d)[4], const unsigned int (&a)[4], const unsigned int (&b)[2],
                                       const int (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]));
}

__device__ __forceinline__ int quantise(float v, float inv) { return max(-127, min(127, __float2int_rn(v * inv))); }

__device__ __forceinline__ unsigned int pack4(int q0, int q1, int q2, int q3) {
    return (q0 & 0xff) | ((q1 & 0xff) << 8) | ((q2 & 0xff) << 16) | ((unsigned int)(q3 & 0xff) << 24);
}

// Four values of a block with scale d (inv = 1/d, or 0 for an all-zero block): the hi and lo words.
__device__ __forceinline__ void quantise4(float4 v, float d, float inv, unsigned int& hi, unsigned int& lo) {
    const int h0 = quantise(v.x, inv), h1 = quantise(v.y, inv), h2 = quantise(v.z, inv), h3 = quantise(v.w, inv);
    const float inv_lo = inv * 128.0f;   // exact: a power of two
    hi = pack4(h0, h1, h2, h3);
    lo = pack4(quantise(__fmaf_rn(-(float)h0, d, v.x), inv_lo), quantise(__fmaf_rn(-(float)h1, d, v.y), inv_lo),
               quantise(__fmaf_rn(-(float)h2, d, v.z), inv_lo), quantise(__fmaf_rn(-(float)h3, d, v.w), inv_lo));
}

// One BK-wide stage of q8_mma.cu's double-buffered tiles (its main loop's arithmetic, which moe_mma.cu calls):
// a warp's FM x FN mma tiles of the quantised x tile (hi and lo levels, BM rows STRIDE bytes apart) against
// the weight tile (BN rows), c = mma(lo, w, mma(hi, w, 0) << 7) per Q8_0 block, c * (d / 128) * w_scale into
// the fp32 accumulators; x_scale [KB][BM] (d / 128), w_scale [KB][BN].
template <int BM, int BN, int KB, int FM, int FN, int STRIDE>
__device__ __forceinline__ void mma_stage_q8(float (&acc)[FM][FN][4], const unsigned char* xt,
                                             const unsigned char* xt_lo, const unsigned char* wt,
                                             const float* x_scale, const float* w_scale,
                                             int warp_m, int warp_n, int g, int t) {
#pragma unroll
    for (int b = 0; b < KB; b++) {
        unsigned int a[FM][4], a_lo[FM][4], bw[FN][2];
#pragma unroll
        for (int i = 0; i < FM; i++) {
            const int at = (warp_m * FM * 16 + i * 16 + g) * STRIDE + b * 32 + t * 4;
#pragma unroll
            for (int level = 0; level < 2; level++) {
                const unsigned char* p = (level ? xt_lo : xt) + at;
                unsigned int (&frag)[4] = level ? a_lo[i] : a[i];
                frag[0] = *(const unsigned int*)p;
                frag[1] = *(const unsigned int*)(p + 8 * STRIDE);
                frag[2] = *(const unsigned int*)(p + 16);
                frag[3] = *(const unsigned int*)(p + 8 * STRIDE + 16);
            }
        }
#pragma unroll
        for (int j = 0; j < FN; j++) {
            const unsigned char* p = wt + (warp_n * FN * 8 + j * 8 + g) * STRIDE + b * 32 + t * 4;
            bw[j][0] = *(const unsigned int*)p;
            bw[j][1] = *(const unsigned int*)(p + 16);
        }
#pragma unroll
        for (int i = 0; i < FM; i++) {
            const int m = warp_m * FM * 16 + i * 16 + g;
            const float xs0 = x_scale[b * BM + m], xs1 = x_scale[b * BM + m + 8];
#pragma unroll
            for (int j = 0; j < FN; j++) {
                const int n = warp_n * FN * 8 + j * 8 + t * 2;
                const float2 ws = *(const float2*)&w_scale[b * BN + n];
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
