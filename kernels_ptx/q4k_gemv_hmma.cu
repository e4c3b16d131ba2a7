// Q4_K products for steps of a few tokens (2..16) that read each weight byte once, on fp16 tensor cores:
// q8_gemv_hmma.cu's scheme over Q4_K's 32-element sub-blocks, with the GEMV's argument list and epilogues.
//
//   s[m, n] = sum over sub-blocks j: d sc_j[n] * sum_{k in j} q[n, k] * xs[m, k] - dmin m_j[n] * sum_{k in j} xs[m, k]
//   xs = (hi + lo)(x[m, k] * inv_rms_in[m])
//
// The image (model/quant4.image_layout): qs K / 2 bytes a row, a super-block of 256 elements 128 bytes whose
// bytes 32 p .. 32 p + 31 hold sub-block 2 p in their low nibbles and 2 p + 1 in their high nibbles; meta 16
// bytes a super-block (d, dmin, 12 bytes of 6-bit scales and mins).  Thread (g = lane / 4, t = lane % 4) loads 8
// bytes of rows g and g + 8 at 32 p + 8 t: elements 8 t .. 8 t + 7 of two sub-blocks.  A mma's 16 k need only be
// the same k for the weights and x, so a word's low nibbles of bytes 0, 2 (1, 3) are one fp16 pair of A, and x's
// elements 0, 2 (1, 3) the matching pair of B; the levels 0..15 are exact in fp16 (1024 + q, less 1024), each
// sub-block's sums start from zero and are scaled by d sc in fp32.  The mins' sum of x over a sub-block comes
// from a mma of the same x fragments against ones: in the C layout, per token, at no extra conversion.
//
// Work layout (hmma_common.cuh's hmma_superblock_body): a block owns 16 RT rows and WK warps; a warp takes whole
// super-blocks, one a step (four 8-byte loads a row and its 16 meta bytes, all in flight).  NT groups of 8
// tokens (NT = 2: up to 16) share each weight fragment.
#include "common.cuh"
#include "q4_formats.cuh"
#include "hmma_common.cuh"

// the nibbles of a weight word as exact fp16 pairs: low nibbles of bytes (0, 2) and (1, 3), high nibbles the same
__device__ __forceinline__ void q4k_nibbles(unsigned int w, unsigned int& lo02, unsigned int& lo13, unsigned int& hi02,
                                            unsigned int& hi13) {
    constexpr unsigned int MAGIC = 0x64006400u;   // fp16 1024 in both halves: 1024 + q for a level q in the mantissa
    lo02 = (w & 0x000F000Fu) | MAGIC;
    lo13 = ((w >> 8) & 0x000F000Fu) | MAGIC;
    hi02 = ((w >> 4) & 0x000F000Fu) | MAGIC;
    hi13 = ((w >> 12) & 0x000F000Fu) | MAGIC;
    asm("sub.rn.f16x2 %0, %0, %1;" : "+r"(lo02) : "r"(MAGIC));
    asm("sub.rn.f16x2 %0, %0, %1;" : "+r"(lo13) : "r"(MAGIC));
    asm("sub.rn.f16x2 %0, %0, %1;" : "+r"(hi02) : "r"(MAGIC));
    asm("sub.rn.f16x2 %0, %0, %1;" : "+r"(hi13) : "r"(MAGIC));
}

// d sc_j and dmin m_j of sub-block j from a super-block's meta (as FmtQ4_K::decode)
__device__ __forceinline__ void q4k_scale(const uint4& m, int j, float& s, float& o) {
    int sc, mn;
    q4k_scale_min(j, m.y, m.z, m.w, sc, mn);
    s = __fmul_rn(half_to_float((half_bits)(m.x & 0xFFFFu)), (float)sc);
    o = __fmul_rn(half_to_float((half_bits)(m.x >> 16)), (float)mn);
}

// x of sub-block elements 8 t .. 8 t + 7 (times the token's scale) as the B pairs (0, 2), (1, 3), (4, 6), (5, 7),
// each hi + lo
__device__ __forceinline__ void q4k_x_pairs(const float* xp, float s, unsigned int (&hi)[4], unsigned int (&lo)[4]) {
    const float4 x0 = ((const float4*)xp)[0], x1 = ((const float4*)xp)[1];
    hmma_split(x0.x * s, x0.z * s, hi[0], lo[0]);
    hmma_split(x0.y * s, x0.w * s, hi[1], lo[1]);
    hmma_split(x1.x * s, x1.z * s, hi[2], lo[2]);
    hmma_split(x1.y * s, x1.w * s, hi[3], lo[3]);
}

// one sub-block of one row tile and token group: four mma (two k steps, x's hi and lo parts) into c
__device__ __forceinline__ void q4k_sub_mma(float (&c)[4], const unsigned int (&a0)[4], const unsigned int (&a1)[4],
                                            const unsigned int (&hi)[4], const unsigned int (&lo)[4]) {
    hmma_mma(c, a0, hi[0], hi[1]);
    hmma_mma(c, a0, lo[0], lo[1]);
    hmma_mma(c, a1, hi[2], hi[3]);
    hmma_mma(c, a1, lo[2], lo[3]);
}

struct HmmaQ4K {
    static constexpr int Q_LANE = 8, X_LANE = 8;   // thread t's bytes 8 t .. 8 t + 7 of 32: elements 8 t .. 8 t + 7
    template <int RT> struct Raw {
        uint2 w[RT][2][4];   // the super-block's 8-byte words 32 p + 8 t of rows g (h 0), g + 8 (h 1)
        uint4 m[RT][2];      // and their meta
    };
    static __device__ __forceinline__ long long qs_row(int K) { return K / 2; }
    static __device__ __forceinline__ long long meta_row(int K) { return K / 16; }

    template <int RT>
    static __device__ __forceinline__ void load(const unsigned char* const (&qp)[RT][2],
                                                const unsigned char* const (&mp)[RT][2], int sb, Raw<RT>& r) {
#pragma unroll
        for (int p = 0; p < 4; p++)
#pragma unroll
            for (int i = 0; i < RT; i++)
#pragma unroll
                for (int h = 0; h < 2; h++) r.w[i][h][p] = hmma_load8(qp[i][h] + 128 * (long long)sb + 32 * p);
#pragma unroll
        for (int i = 0; i < RT; i++)
#pragma unroll
            for (int h = 0; h < 2; h++) r.m[i][h] = __ldg((const uint4*)(mp[i][h] + 16 * (long long)sb));
    }

    // the super-block sb of a loaded step into acc
    template <int NT, int RT>
    static __device__ __forceinline__ void step(const Raw<RT>& r, int sb, const float* const (&xrow)[NT],
                                                const float (&xscale)[NT], float (&acc)[RT][NT][4]) {
        constexpr unsigned int ONES = 0x3C003C00u;   // fp16 1.0 pairs: a mma against them sums x over k
        const unsigned int ones[4] = {ONES, ONES, ONES, ONES};
#pragma unroll
        for (int p = 0; p < 4; p++) {
            // x of sub-blocks 2 p (q = 0) and 2 p + 1 (q = 1) for each token group, and their sums over k
            unsigned int hi[2][NT][4], lo[2][NT][4];
            float xsum[2][NT][4];
#pragma unroll
            for (int q = 0; q < 2; q++)
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    q4k_x_pairs(xrow[j] + 256 * sb + 64 * p + 32 * q, xscale[j], hi[q][j], lo[q][j]);
#pragma unroll
                    for (int e = 0; e < 4; e++) xsum[q][j][e] = 0.f;
                    q4k_sub_mma(xsum[q][j], ones, ones, hi[q][j], lo[q][j]);
                }
#pragma unroll
            for (int i = 0; i < RT; i++) {
                // k steps 0 (word x) and 1 (word y) of sub-block 2 p (low nibbles) and 2 p + 1 (high): rows g in
                // a[0], a[2], g + 8 in a[1], a[3]
                unsigned int l0[4], l1[4], h0[4], h1[4];
                q4k_nibbles(r.w[i][0][p].x, l0[0], l0[2], h0[0], h0[2]);
                q4k_nibbles(r.w[i][1][p].x, l0[1], l0[3], h0[1], h0[3]);
                q4k_nibbles(r.w[i][0][p].y, l1[0], l1[2], h1[0], h1[2]);
                q4k_nibbles(r.w[i][1][p].y, l1[1], l1[3], h1[1], h1[3]);
                float sc[2][2], mn[2][2];   // [sub-block q][row half h]
#pragma unroll
                for (int q = 0; q < 2; q++)
#pragma unroll
                    for (int h = 0; h < 2; h++) q4k_scale(r.m[i][h], 2 * p + q, sc[q][h], mn[q][h]);
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int q = 0; q < 2; q++) {
                        float c[4] = {0.f, 0.f, 0.f, 0.f};
                        if (q == 0) q4k_sub_mma(c, l0, l1, hi[0][j], lo[0][j]);
                        else q4k_sub_mma(c, h0, h1, hi[1][j], lo[1][j]);
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int h = e >> 1;
                            acc[i][j][e] = fmaf(-mn[q][h], xsum[q][j][e], fmaf(c[e], sc[q][h], acc[i][j][e]));
                        }
                    }
            }
        }
    }
};

// q4k_hmma_t<8 NT>_k<WK>[r<RT>] (+ _silu): the layouts of kestrel_stream/cuda/gemv_variants.HMMA_Q4K_VARIANTS
DEFINE_SUPERBLOCK_HMMA_LAYOUT(HmmaQ4K, q4k_hmma, 1, 8, false, k8)
DEFINE_SUPERBLOCK_HMMA_LAYOUT(HmmaQ4K, q4k_hmma, 1, 4, false, k4)
DEFINE_SUPERBLOCK_HMMA_LAYOUT(HmmaQ4K, q4k_hmma, 2, 4, false, k4r2)
DEFINE_SUPERBLOCK_HMMA_LAYOUT(HmmaQ4K, q4k_hmma, 2, 2, false, k2r2)
DEFINE_SUPERBLOCK_HMMA_LAYOUT(HmmaQ4K, q4k_hmma, 1, 4, true, k4p)
DEFINE_SUPERBLOCK_HMMA_LAYOUT(HmmaQ4K, q4k_hmma, 2, 4, true, k4r2p)
DEFINE_SUPERBLOCK_HMMA_LAYOUT(HmmaQ4K, q4k_hmma, 2, 2, true, k2r2p)
DEFINE_SUPERBLOCK_HMMA_LAYOUT(HmmaQ4K, q4k_hmma, 1, 2, true, k2p)
