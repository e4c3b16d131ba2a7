/* What the host kernel files share: whether the x86 SIMD paths are compiled, their target attributes,
   the ISA and weight-format numbers (kernels.py's ISAS and FORMATS), and IEEE halves to float. */
#ifndef KS_HOST_SIMD_H
#define KS_HOST_SIMD_H
#include <stdint.h>
#include <string.h>

/* KS_X86: the SIMD paths (x86-64 and x86); elsewhere, or built with -DKS_NO_X86, every ISA runs the
   scalar C (the tests build that too). */
#if (defined(__x86_64__) || defined(__i386__)) && !defined(KS_NO_X86)
#define KS_X86 1
#include <immintrin.h>
#else
#define KS_X86 0
#endif

/* a spinning thread's pause (a waiter on another thread's flag) */
static inline void cpu_relax(void) {
#if KS_X86
    _mm_pause();
#endif
}

/* AVXVNNI: AVX2 and the 256-bit (VEX) vpdpbusd of Intel's cores from 2021 and AMD's Zen 5, which lack AVX-512
   (a CPU may have either VNNI without the other: each path runs at its own ISA exactly, never above it);
   AMX: AVX-512 VNNI and AMX-INT8 tiles */
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVXVNNI = 2, ISA_AVX512VNNI = 3, ISA_AMX = 4 };
/* Q4_K_R16 and Q6_K_R16: Q4_K and Q6_K weights repacked 16 rows together (host_kquants.c) */
enum { FMT_Q8_0 = 0, FMT_Q4_0 = 1, FMT_Q4_K = 2, FMT_Q6_K = 3, FMT_Q4_K_R16 = 4, FMT_Q6_K_R16 = 5 };

#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TARGET_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
/* Each path names every extension it uses: the library is built with -march=native, and on a CPU without
   AVX-512 an intrinsic of an extension its target lacks stops the whole build (tests/test_native_build.py
   compiles it for other CPUs' -march) */
#define TARGET_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#define TARGET_AMX __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,amx-tile,amx-int8")))

#if defined(__FLT16_MAX__) && !defined(KS_NO_FLOAT16)     /* KS_NO_FLOAT16: the tests build the other too */
static inline float h2f(uint16_t h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}
#else
static inline float h2f(uint16_t h) {    /* IEEE half to float by its fields, where there is no _Float16 */
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {                              /* subnormal: normalize */
        int shift = 0;
        while (!(mant & 0x400)) {
            mant <<= 1;
            shift++;
        }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

static inline float h2f_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h2f(h);
}

#define LO_SCALE 0.0078125f     /* 1/128: the lo activation level's step in units of d */

/* The 8 six-bit scales and mins of a Q4_K super-block from its 12 packed bytes (as model/quant4.q4k_scale_min). */
static inline void q4k_scale_min(const uint8_t *q, int *sc, int *m) {
    for (int j = 0; j < 4; j++) {
        sc[j] = q[j] & 63;
        m[j] = q[j + 4] & 63;
        sc[j + 4] = (q[j + 8] & 0x0F) | ((q[j] >> 6) << 4);
        m[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
    }
}
#endif
