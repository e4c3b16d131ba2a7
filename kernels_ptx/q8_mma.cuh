// Device helpers of the int8 tensor-core GEMMs (q8_mma.cu, q8_mma_pipe.cu): cp.async, the
// m16n8k32 int8 mma, and the two-level activation quantisation (hi, lo) both kernels share.
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
