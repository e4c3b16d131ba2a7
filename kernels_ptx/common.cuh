// Shared helpers for every kernel family.  No CUDA headers: the NVRTC wheel
// ships none (cuda_fp16.h in particular), so fp16 goes through inline PTX.
#pragma once
typedef signed char int8;
typedef unsigned short half_bits;   // an IEEE fp16 value as stored by numpy

__device__ __forceinline__ float half_to_float(half_bits h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Signed byte `which` (0..3) of a 32-bit word as float, exactly: the biased byte
// is spliced into the mantissa of 2^23 (one PRMT + one FADD, no I2F, which is
// quarter rate and would cap a q8 stream below HBM bandwidth).
__device__ __forceinline__ float byte_to_float(unsigned int word_biased, int which) {
    unsigned int bits = __byte_perm(word_biased, 0x4B000000u, 0x7540 + which);
    return __int_as_float(bits) - 8388736.0f;   // 2^23 + 128
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

#define INFINITY __int_as_float(0x7f800000)

// Programmatic dependent launch (sm_90+; no-ops before, and for launches made without the
// attribute).  Every kernel calls pdl_launch_dependents() first, so the next kernel of the
// step may be scheduled while this one runs, and pdl_wait() before it touches anything an
// earlier kernel wrote (or anything an earlier kernel still reads): pdl_wait returns once the
// preceding grid has completed and its memory is visible, and since that grid waited in turn,
// the whole step stays ordered.  Only reads of constant weights may come before pdl_wait.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
