// The 4/6-bit block formats of model/quant4.py as the kernels read them.
//
// A weight's device image per format part: qs bytes row after row, then meta bytes row
// after row (quant4.image_layout); each row holds K / QK blocks:
//   Q4_0  QK 32:  qs 16 B (byte j: element j low nibble, j + 16 high)   meta: d f16
//   Q4_K  QK 256: qs 128 B (bytes 32i..32i+31: sub-block 2i low, 2i+1 high)
//                 meta 16 B: d f16, dmin f16, 12 bytes of packed 6-bit scales and mins
//   Q6_K  QK 256: qs = ql 128 B, qh 64 B                meta 18 B: 16 int8 scales, d f16
//   Q8_0  QK 32:  qs 32 B (int8)                        meta: d f16  (the Q8_0 image of weight_window.py)
// A "unit" is what one thread decodes at a time: 16 B of qs (Q4_0, Q4_K: 32 weights; Q8_0: 16) or
// 3 x 16 B (Q6_K: 64 weights), as GROUPS groups of 16 weights w = s * (level - BIAS) - o
// with unsigned levels (one byte each, four per word), the group's first element k.
// The units of a row lie in K order in aligned runs: the units of elements [128 c, 128 c + 128)
// are units 128 c / UNIT .. (128 c + 128) / UNIT - 1 (what q4_mma.cu's stages rely on).
#pragma once
// (include common.cuh first: build.py splices includes one level deep)

struct Group {
    unsigned int lv[4];   // 16 levels, byte i of word w = element 4 w + i of the group
    float s, o;           // w = s * (level - BIAS) - o
    int k;                // the group's first element within the row
};

__device__ __forceinline__ uint4 load_weights16(const void* p) {
    // weights are read once per step: keep them out of L1, which holds x
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// a hint: the 32-byte sector (or more) of p into L2, no register, nothing to wait for
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// level byte `which` of `word` minus `bias`, exactly (the biased byte spliced into 2^23's mantissa)
__device__ __forceinline__ float level_float(unsigned int word, int which, float bias) {
    return __int_as_float(__byte_perm(word, 0x4B000000u, 0x7540 + which)) - (8388608.0f + bias);
}

struct FmtQ4_0 {
    static constexpr int UNIT = 32, GROUPS = 2, BIAS = 8;
    static constexpr bool MINS = false;
    struct Raw { uint4 q; unsigned int d; };
    static __device__ __forceinline__ long long qs_row(int K) { return K / 2; }
    static __device__ __forceinline__ long long meta_row(int K) { return K / 16; }
    static __device__ __forceinline__ void load(Raw& r, const unsigned char* qs, const unsigned char* meta, int u) {
        r.q = load_weights16(qs + 16 * u);
        r.d = __ldg((const half_bits*)meta + u);
    }
    static __device__ __forceinline__ void prefetch(const unsigned char* qs, const unsigned char* meta, int u) {
        prefetch_l2(qs + 16 * u);
        prefetch_l2((const half_bits*)meta + u);
    }
    static __device__ __forceinline__ void decode(const Raw& r, int u, Group (&g)[GROUPS]) {
        const unsigned int w[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
        const float d = half_to_float((half_bits)r.d);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            g[0].lv[i] = w[i] & 0x0F0F0F0Fu;
            g[1].lv[i] = (w[i] >> 4) & 0x0F0F0F0Fu;
        }
        g[0].s = g[1].s = d;
        g[0].o = g[1].o = 0.f;
        g[0].k = 32 * u;
        g[1].k = 32 * u + 16;
    }
};

// ggml's get_scale_min_k4 over the packed words W0 = q[0..3], W1 = q[4..7], W2 = q[8..11]
__device__ __forceinline__ void q4k_scale_min(int j, unsigned int w0, unsigned int w1, unsigned int w2, int& sc,
                                              int& mn) {
    if (j < 4) {
        sc = (w0 >> (8 * j)) & 63;
        mn = (w1 >> (8 * j)) & 63;
    } else {
        const int b = 8 * (j - 4);
        sc = ((w2 >> b) & 0xF) | (((w0 >> (b + 6)) & 3) << 4);
        mn = ((w2 >> (b + 4)) & 0xF) | (((w1 >> (b + 6)) & 3) << 4);
    }
}

struct FmtQ4_K {
    static constexpr int UNIT = 32, GROUPS = 2, BIAS = 0;
    static constexpr bool MINS = true;
    struct Raw { uint4 q, m; };
    static __device__ __forceinline__ long long qs_row(int K) { return K / 2; }
    static __device__ __forceinline__ long long meta_row(int K) { return K / 16; }
    static __device__ __forceinline__ void load(Raw& r, const unsigned char* qs, const unsigned char* meta, int u) {
        r.q = load_weights16(qs + 16 * u);                        // unit c of super-block u / 8: bytes 16 c
        r.m = __ldg((const uint4*)(meta + 16 * (u >> 3)));
    }
    static __device__ __forceinline__ void prefetch(const unsigned char* qs, const unsigned char* meta, int u) {
        prefetch_l2(qs + 16 * u);
        prefetch_l2(meta + 16 * (u >> 3));
    }
    static __device__ __forceinline__ void decode(const Raw& r, int u, Group (&g)[GROUPS]) {
        const int sb = u >> 3, c = u & 7, j = c >> 1, l0 = (c & 1) * 16;
        const unsigned int w[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            g[0].lv[i] = w[i] & 0x0F0F0F0Fu;           // sub-block 2j, elements l0..l0+15
            g[1].lv[i] = (w[i] >> 4) & 0x0F0F0F0Fu;    // sub-block 2j+1
        }
        const float d = half_to_float((half_bits)(r.m.x & 0xFFFFu)), dmin = half_to_float((half_bits)(r.m.x >> 16));
        int sc, mn;
        q4k_scale_min(2 * j, r.m.y, r.m.z, r.m.w, sc, mn);
        g[0].s = __fmul_rn(d, (float)sc);
        g[0].o = __fmul_rn(dmin, (float)mn);
        q4k_scale_min(2 * j + 1, r.m.y, r.m.z, r.m.w, sc, mn);
        g[1].s = __fmul_rn(d, (float)sc);
        g[1].o = __fmul_rn(dmin, (float)mn);
        g[0].k = 256 * sb + 64 * j + l0;
        g[1].k = 256 * sb + 64 * j + 32 + l0;
    }
};

struct FmtQ6_K {
    static constexpr int UNIT = 64, GROUPS = 4, BIAS = 32;
    static constexpr bool MINS = false;
    struct Raw { uint4 l0, l1, h; float sc[4]; unsigned int d; };
    static __device__ __forceinline__ long long qs_row(int K) { return K / 256 * 192; }
    static __device__ __forceinline__ long long meta_row(int K) { return K / 256 * 18; }
    // unit u: super-block u / 4, half hh = (u / 2) % 2, l0 = 16 (u % 2): elements 128 hh + 32 k + l0 + i
    static __device__ __forceinline__ void load(Raw& r, const unsigned char* qs, const unsigned char* meta, int u) {
        const int sb = u >> 2, hh = (u >> 1) & 1, l0 = (u & 1) * 16;
        const unsigned char* base = qs + 192 * (long long)sb;
        r.l0 = load_weights16(base + 64 * hh + l0);
        r.l1 = load_weights16(base + 64 * hh + 32 + l0);
        r.h = load_weights16(base + 128 + 32 * hh + l0);
        const unsigned char* m = meta + 18 * (long long)sb;
#pragma unroll
        for (int k = 0; k < 4; k++) r.sc[k] = (float)__ldg((const signed char*)m + 8 * hh + 2 * k + (l0 >> 4));
        r.d = __ldg((const half_bits*)(m + 16));
    }
    static __device__ __forceinline__ void prefetch(const unsigned char* qs, const unsigned char* meta, int u) {
        const int sb = u >> 2, hh = (u >> 1) & 1, l0 = (u & 1) * 16;
        const unsigned char* base = qs + 192 * (long long)sb;
        prefetch_l2(base + 64 * hh + l0);
        prefetch_l2(base + 64 * hh + 32 + l0);
        prefetch_l2(base + 128 + 32 * hh + l0);
        prefetch_l2(meta + 18 * (long long)sb + 8 * hh);
    }
    static __device__ __forceinline__ void decode(const Raw& r, int u, Group (&g)[GROUPS]) {
        const int sb = u >> 2, hh = (u >> 1) & 1, l0 = (u & 1) * 16;
        const unsigned int a[4] = {r.l0.x, r.l0.y, r.l0.z, r.l0.w};
        const unsigned int b[4] = {r.l1.x, r.l1.y, r.l1.z, r.l1.w};
        const unsigned int h[4] = {r.h.x, r.h.y, r.h.z, r.h.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            g[0].lv[i] = (a[i] & 0x0F0F0F0Fu) | ((h[i] << 4) & 0x30303030u);
            g[1].lv[i] = (b[i] & 0x0F0F0F0Fu) | ((h[i] << 2) & 0x30303030u);
            g[2].lv[i] = ((a[i] >> 4) & 0x0F0F0F0Fu) | (h[i] & 0x30303030u);
            g[3].lv[i] = ((b[i] >> 4) & 0x0F0F0F0Fu) | ((h[i] >> 2) & 0x30303030u);
        }
        const float d = half_to_float((half_bits)r.d);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            g[k].s = __fmul_rn(d, r.sc[k]);
            g[k].o = 0.f;
            g[k].k = 256 * sb + 128 * hh + 32 * k + l0;
        }
    }
};

// Q8_0 in the same terms, for the kernels written over the formats (moe.cu): a unit is half a block,
// 16 int8 weights as levels biased by 128 (the sign bit flipped), exact in fp32 as level_float makes them
struct FmtQ8_0 {
    static constexpr int UNIT = 16, GROUPS = 1, BIAS = 128;
    static constexpr bool MINS = false;
    struct Raw { uint4 q; unsigned int d; };
    static __device__ __forceinline__ long long qs_row(int K) { return K; }
    static __device__ __forceinline__ long long meta_row(int K) { return K / 16; }
    static __device__ __forceinline__ void load(Raw& r, const unsigned char* qs, const unsigned char* meta, int u) {
        r.q = load_weights16(qs + 16 * u);
        r.d = __ldg((const half_bits*)meta + (u >> 1));
    }
    static __device__ __forceinline__ void prefetch(const unsigned char* qs, const unsigned char* meta, int u) {
        prefetch_l2(qs + 16 * u);
        prefetch_l2((const half_bits*)meta + (u >> 1));
    }
    static __device__ __forceinline__ void decode(const Raw& r, int u, Group (&g)[GROUPS]) {
        g[0].lv[0] = r.q.x ^ 0x80808080u;
        g[0].lv[1] = r.q.y ^ 0x80808080u;
        g[0].lv[2] = r.q.z ^ 0x80808080u;
        g[0].lv[3] = r.q.w ^ 0x80808080u;
        g[0].s = half_to_float((half_bits)r.d);
        g[0].o = 0.f;
        g[0].k = 16 * u;
    }
};

template <class A, class B> struct same_format { static constexpr bool value = false; };
template <class A> struct same_format<A, A> { static constexpr bool value = true; };
