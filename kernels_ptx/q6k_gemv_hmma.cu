// Q6_K products for steps of a few tokens (2..16) that read each weight byte once, on fp16 tensor cores:
// q4k_gemv_hmma.cu's scheme over Q6_K's groups of 16 elements, with the GEMV's argument list and epilogues.
//
//   s[m, n] = sum over groups g of 16: d sc_g[n] * sum_{k in g} (q[n, k] - 32) * xs[m, k],  xs = (hi + lo)(x * inv_rms_in)
//
// The image (model/quant4.image_layout): qs 192 bytes a super-block of 256 elements (ql 128, qh 64), meta 18
// (16 int8 scales, d).  In half hh of a super-block, element 128 hh + 32 s + l (stream s = 0..3, l < 32) has its
// low four bits in ql[64 hh + l] (s 0, 2: low / high nibble) or ql[64 hh + 32 + l] (s 1, 3) and its top two in
// qh[32 hh + l] (bits 2 s, 2 s + 1); its scale is sc[8 hh + 2 s + l / 16].  A mma's 16 k are one group (16
// consecutive l of one stream): thread (g = lane / 4, t = lane % 4) takes l = 16 i + 4 t .. + 3, so for a quarter
// (hh, i) it loads 4 bytes of each of ql, ql + 32 and qh for rows g and g + 8 and gets 4 elements of all four
// streams.  Levels q - 32 are exact in fp16 (1024 + q, less 1056); each group's sums start from zero and are
// scaled by d sc in fp32; x goes in as hi + lo fp16 parts.
//
// Work layout: hmma_common.cuh's hmma_superblock_body (a warp takes whole super-blocks, one a step: twelve
// 4-byte loads a row and its 18 meta bytes).  Each 4-byte load of a warp is 8 rows x 16 bytes; the quarters
// i = 0, 1 read the two halves of the same sectors.
#include "common.cuh"
#include "hmma_common.cuh"

__device__ __forceinline__ unsigned int hmma_load4(const void* p) {
    unsigned int v;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// the bytes 0, 1 (p01) and 2, 3 (p23) of a word of 6-bit levels as exact fp16 pairs of level - 32
__device__ __forceinline__ void q6k_pairs(unsigned int v, unsigned int& p01, unsigned int& p23) {
    const unsigned int h01 = __byte_perm(v, 0x64646464u, 0x4140), h23 = __byte_perm(v, 0x64646464u, 0x4342);
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(p01) : "r"(h01), "r"(0x64206420u));   // 1024 + q - 1056
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(p23) : "r"(h23), "r"(0x64206420u));
}

// stream s's levels (4 elements) of a quarter from its ql words a (ql + l), b (ql + 32 + l) and qh word h
__device__ __forceinline__ unsigned int q6k_levels(int s, unsigned int a, unsigned int b, unsigned int h) {
    switch (s) {
        case 0: return (a & 0x0F0F0F0Fu) | ((h << 4) & 0x30303030u);
        case 1: return (b & 0x0F0F0F0Fu) | ((h << 2) & 0x30303030u);
        case 2: return ((a >> 4) & 0x0F0F0F0Fu) | (h & 0x30303030u);
        default: return ((b >> 4) & 0x0F0F0F0Fu) | ((h >> 2) & 0x30303030u);
    }
}

struct HmmaQ6K {
    static constexpr int Q_LANE = 4, X_LANE = 4;   // thread t's 4 bytes / elements at 4 t of each 16
    template <int RT> struct Raw {
        unsigned int a[RT][2][4], b[RT][2][4], h[RT][2][4];   // quarter 2 hh + i of rows g (h 0), g + 8 (h 1)
        unsigned int sc[RT][2][4], d[RT][2];                   // the 16 scale bytes as words, d's fp16 bits
    };
    static __device__ __forceinline__ long long qs_row(int K) { return K / 256 * 192; }
    static __device__ __forceinline__ long long meta_row(int K) { return K / 256 * 18; }

    template <int RT>
    static __device__ __forceinline__ void load(const unsigned char* const (&qp)[RT][2],
                                                const unsigned char* const (&mp)[RT][2], int sb, Raw<RT>& r) {
#pragma unroll
        for (int q = 0; q < 4; q++)
#pragma unroll
            for (int i = 0; i < RT; i++)
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    const unsigned char* base = qp[i][hf] + 192 * (long long)sb;
                    const int hh = q >> 1, l = 16 * (q & 1);
                    r.a[i][hf][q] = hmma_load4(base + 64 * hh + l);
                    r.b[i][hf][q] = hmma_load4(base + 64 * hh + 32 + l);
                    r.h[i][hf][q] = hmma_load4(base + 128 + 32 * hh + l);
                }
#pragma unroll
        for (int i = 0; i < RT; i++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const unsigned short* m = (const unsigned short*)(mp[i][hf] + 18 * (long long)sb);   // 2-byte aligned
#pragma unroll
                for (int w = 0; w < 4; w++) r.sc[i][hf][w] = __ldg(m + 2 * w) | ((unsigned int)__ldg(m + 2 * w + 1) << 16);
                r.d[i][hf] = __ldg(m + 8);
            }
    }

    template <int NT, int RT>
    static __device__ __forceinline__ void step(const Raw<RT>& r, int sb, const float* const (&xrow)[NT],
                                                const float (&xscale)[NT], float (&acc)[RT][NT][4]) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int hh = q >> 1, l = 16 * (q & 1);
#pragma unroll
            for (int s = 0; s < 4; s++) {
                unsigned int hi[NT][2], lo[NT][2];   // x pairs (0, 1), (2, 3) of the thread's 4 elements
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    const float4 v = *(const float4*)(xrow[j] + 256 * sb + 128 * hh + 32 * s + l);
                    const float c = xscale[j];
                    hmma_split(v.x * c, v.y * c, hi[j][0], lo[j][0]);
                    hmma_split(v.z * c, v.w * c, hi[j][1], lo[j][1]);
                }
                const int k = 8 * hh + 2 * s + (q & 1);   // the group's scale byte
#pragma unroll
                for (int i = 0; i < RT; i++) {
                    unsigned int w[4];   // rows g in w[0], w[2], g + 8 in w[1], w[3]
                    q6k_pairs(q6k_levels(s, r.a[i][0][q], r.b[i][0][q], r.h[i][0][q]), w[0], w[2]);
                    q6k_pairs(q6k_levels(s, r.a[i][1][q], r.b[i][1][q], r.h[i][1][q]), w[1], w[3]);
                    float scale[2];
#pragma unroll
                    for (int hf = 0; hf < 2; hf++) {
                        const float sc = (float)(signed char)((r.sc[i][hf][k >> 2] >> (8 * (k & 3))) & 0xFFu);
                        scale[hf] = __fmul_rn(half_to_float((half_bits)r.d[i][hf]), sc);   // as FmtQ6_K
                    }
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        float c[4] = {0.f, 0.f, 0.f, 0.f};
                        hmma_mma(c, w, hi[j][0], hi[j][1]);
                        hmma_mma(c, w, lo[j][0], lo[j][1]);
#pragma unroll
                        for (int e = 0; e < 4; e++) acc[i][j][e] = fmaf(c[e], scale[e >> 1], acc[i][j][e]);
                    }
                }
            }
        }
    }
};

// q6k_hmma_t<8 NT>_k<WK>[r<RT>] (+ _silu): the layouts of kestrel_stream/cuda/gemv_variants.HMMA_Q6K_VARIANTS
DEFINE_SUPERBLOCK_HMMA_LAYOUT(HmmaQ6K, q6k_hmma, 1, 8, false, k8)
DEFINE_SUPERBLOCK_HMMA_LAYOUT(HmmaQ6K, q6k_hmma, 1, 4, false, k4)
DEFINE_SUPERBLOCK_HMMA_LAYOUT(HmmaQ6K, q6k_hmma, 2, 4, false, k4r2)
DEFINE_SUPERBLOCK_HMMA_LAYOUT(HmmaQ6K, q6k_hmma, 1, 4, true, k4p)
DEFINE_SUPERBLOCK_HMMA_LAYOUT(HmmaQ6K, q6k_hmma, 2, 4, true, k4r2p)
DEFINE_SUPERBLOCK_HMMA_LAYOUT(HmmaQ6K, q6k_hmma, 2, 2, true, k2r2p)
