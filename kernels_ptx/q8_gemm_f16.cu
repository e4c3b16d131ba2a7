// The built-in GEMM of the dense path (kestrel_stream/cuda/dense_gemm.py) for steps of many tokens:
//
//   C[T, N] (+)= A[T, K] . W[N, K]^T      A fp16 (gemm_input_f16's), W Q8_0 (int8 qs + fp16 scale per 32 of K),
//                                          fp16 products on tensor cores, fp32 sums; += when `accumulate`
//
// The weight is expanded in registers, not in memory: what cuBLAS needs q8_dequant_f16 for (an fp16 copy
// of every weight, written and read back each step) is here one conversion per weight fragment, so a
// projection streams its int8 bytes once per block of tokens and nothing else.
//
//   - A, the int8 weight tile and the tile's fp16 scales arrive by cp.async in a STAGES-deep ring, one
//     __syncthreads per BK = 64 of K; weights and scales of the first stages are issued before pdl_wait
//     (they are constant), A after it (gemm_input_f16 writes it).
//   - B fragments come by ldmatrix from the int8 tile: one 8 x 8 b16 matrix is 8 weight rows x 16 int8 of
//     K, and gives each thread row g = lane / 4, int8 k = 4q .. 4q + 3 (q = lane % 4).  mma.m16n8k16 wants
//     k = 2q, 2q + 1 in b0 and 2q + 8, 2q + 9 in b1: the order of k inside a 16-wide product does not
//     matter as long as A agrees, so b0 carries k 4q, 4q + 1, b1 4q + 2, 4q + 3, and A's fragments are
//     read with one 64-bit shared load per row (its halves 4q .. 4q + 3) instead of ldmatrix.
//   - int8 -> fp16 exactly by splicing the biased byte into 0x64uu (1024 + u) and subtracting 1152, then one
//     fp16 multiply by the scale: fp16(q * d), the rounding q8_dequant_f16 does.
//   - rows are padded (A: 160 bytes for 128, int8: 80 for 64) so the 64-bit loads of a half warp and the
//     eight rows of an ldmatrix hit distinct banks.
//   - scales: each row's KB halves of a stage sit in the KB / 2 + 1 aligned 4-byte words around them (a
//     row's first scale is 2-byte aligned only when K / 32 is odd, or `scales` itself is 2 mod 4); the
//     parity says where they start.  Words past the array are zero-filled.
//   - blocks along x share a weight tile (consecutive blocks: its token tiles), so it is read from HBM once.
// Rows past N, tokens past T and K past the end are zero-filled in shared memory and never stored.
#include "common.cuh"
#include "cp_async.cuh"
#include "q8_tile.cuh"

__device__ __forceinline__ void gemm_mma(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                         unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES>
__device__ __forceinline__ void q8_gemm_f16_body(const int8* __restrict__ qs, const half_bits* __restrict__ scales,
                                                 const half_bits* __restrict__ a, int lda, float* c, int ldc, int T,
                                                 int N, int K, int accumulate) {
    constexpr int BK = Q8_TILE_K, KB = BK / 32, SW = Q8_TILE_SCALE_WORDS;   // K per stage, its 32-blocks, scale words a row
    constexpr int THREADS = 32 * WARPS_M * WARPS_N;
    constexpr int WTOK = BM / WARPS_M, WROW = BN / WARPS_N;  // a warp's output tile
    constexpr int FM = WTOK / 16, FN = WROW / 8;             // its mma tiles
    constexpr int A_STRIDE = BK * 2 + 32, B_STRIDE = Q8_TILE_STRIDE;
    constexpr int A_BYTES = BM * A_STRIDE, B_BYTES = BN * B_STRIDE, S_BYTES = BN * SW * 4;
    constexpr int STAGE_BYTES = A_BYTES + B_BYTES + S_BYTES;
    constexpr int A_CHUNKS = BM * (BK / 8);
    static_assert(FM >= 1 && FN % 4 == 0 && STAGES >= 2, "tile");
    static_assert(A_BYTES % 16 == 0 && B_BYTES % 16 == 0 && STAGE_BYTES % 16 == 0, "16-byte cp.async slots");

    extern __shared__ __align__(128) unsigned char gemm_shared[];
    pdl_launch_dependents();
    {
        unsigned int dynamic_bytes;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
        if (dynamic_bytes < (unsigned int)(STAGES * STAGE_BYTES)) __trap();   // launched without its shared bytes
    }
    const unsigned int base = (unsigned int)__cvta_generic_to_shared(gemm_shared);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
    const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
    const int tok0 = blockIdx.x * BM, row0 = blockIdx.y * BN;
    const int kblocks = K >> 5, stages = (K + BK - 1) / BK;
    const Q8Scales sc(scales, N, kblocks);

    auto issue_weights = [&](int s) {
        if (s >= stages) return;
        const unsigned int sb = base + (s % STAGES) * STAGE_BYTES + A_BYTES;
        q8_tile_issue<BN, THREADS>(sb, sb + B_BYTES, qs, sc, row0, s * BK, N, K, kblocks, tid);
    };
    auto issue_inputs = [&](int s) {
        if (s < stages) {
            const int k0 = s * BK;
            const unsigned int sa = base + (s % STAGES) * STAGE_BYTES;
#pragma unroll
            for (int j = 0; j < (A_CHUNKS + THREADS - 1) / THREADS; j++) {
                const int chunk = tid + j * THREADS;
                if (A_CHUNKS % THREADS != 0 && chunk >= A_CHUNKS) break;
                const int r = chunk / (BK / 8), part = chunk % (BK / 8), tok = tok0 + r, k = k0 + part * 8;
                cp_async16(sa + r * A_STRIDE + part * 16, a + (long long)min(tok, T - 1) * lda + min(k, K - 8),
                          tok < T && k < K);
            }
        }
        cp_async_commit();   // one group per stage, empty past K
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) issue_weights(s);
    pdl_wait();
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) issue_inputs(s);

    float acc[FM][FN][4];
#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int j = 0; j < FN; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

    const int a_row = warp_m * WTOK + g, b_row = warp_n * WROW;
    for (int s = 0; s < stages; s++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();   // stage s is in for every thread; every warp is done with stage s - 1's slot
        issue_weights(s + STAGES - 1);
        issue_inputs(s + STAGES - 1);

        const int slot = s % STAGES;
        const unsigned int sa = base + slot * STAGE_BYTES, sb = sa + A_BYTES;
        const half_bits* sscale = (const half_bits*)(gemm_shared + slot * STAGE_BYTES + A_BYTES + B_BYTES);
        unsigned int d2[FN][KB];
#pragma unroll
        for (int j = 0; j < FN; j++) {
            const int r = b_row + j * 8 + g;
            const int parity = sc.parity(row0 + r, kblocks, s * BK >> 5);
#pragma unroll
            for (int kb = 0; kb < KB; kb++) {
                const unsigned int d = sscale[r * SW * 2 + parity + kb];
                d2[j][kb] = d | (d << 16);
            }
        }
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            unsigned int af[FM][4];
#pragma unroll
            for (int i = 0; i < FM; i++) {
                unsigned int lo0, lo1, hi0, hi1;
                const unsigned int at = sa + (a_row + i * 16) * A_STRIDE + kk * 32 + q * 8;
                asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(lo0), "=r"(lo1) : "r"(at));
                asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(hi0), "=r"(hi1) : "r"(at + 8 * A_STRIDE));
                af[i][0] = lo0; af[i][1] = hi0; af[i][2] = lo1; af[i][3] = hi1;
            }
#pragma unroll
            for (int jj = 0; jj < FN / 4; jj++) {
                unsigned int raw[4];
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                             : "=r"(raw[0]), "=r"(raw[1]), "=r"(raw[2]), "=r"(raw[3])
                             : "r"(sb + (b_row + jj * 32 + lane) * B_STRIDE + kk * 16));
#pragma unroll
                for (int t = 0; t < 4; t++) {
                    const int j = jj * 4 + t;
                    const unsigned int biased = raw[t] ^ 0x80808080u;
                    const unsigned int b0 = q8_dequant_pair(biased, 0x4140u, d2[j][kk / 2]);
                    const unsigned int b1 = q8_dequant_pair(biased, 0x4342u, d2[j][kk / 2]);
#pragma unroll
                    for (int i = 0; i < FM; i++) gemm_mma(acc[i][j], af[i], b0, b1);
                }
            }
        }
    }
    cp_async_wait<0>();   // no copy outlives the block

#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int tok = tok0 + a_row + i * 16 + 8 * h;
            if (tok >= T) continue;
#pragma unroll
            for (int j = 0; j < FN; j++) {
                const int n = row0 + b_row + j * 8 + q * 2;
                if (n >= N) continue;
                float2* out = (float2*)(c + (long long)tok * ldc + n);
                float2 v = make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                if (accumulate) {
                    const float2 old = *out;
                    v.x += old.x;
                    v.y += old.y;
                }
                *out = v;
            }
        }
}

// q8_gemm_f16_<BM>x<BN>_w<WM>x<WN>_s<STAGES>: kestrel_stream/cuda/dense_gemm.GEMM_TILES; MINB blocks per SM
// cap the registers (65536 / (MINB x threads))
#define DEFINE_Q8_GEMM_F16(BM, BN, WM, WN, ST, MINB)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * WM * WN, MINB) q8_gemm_f16_##BM##x##BN##_w##WM##x##WN##_s##ST( \
            const int8* qs, const half_bits* scales, const half_bits* a, int lda, float* c, int ldc, int T,   \
            int N, int K, int accumulate) {                                                                   \
        q8_gemm_f16_body<BM, BN, WM, WN, ST>(qs, scales, a, lda, c, ldc, T, N, K, accumulate);                \
    }
DEFINE_Q8_GEMM_F16(128, 256, 2, 4, 4, 1)
DEFINE_Q8_GEMM_F16(256, 128, 4, 2, 3, 1)
DEFINE_Q8_GEMM_F16(128, 128, 2, 4, 4, 1)
DEFINE_Q8_GEMM_F16(128, 128, 2, 2, 3, 2)
DEFINE_Q8_GEMM_F16(64, 128, 2, 2, 4, 2)
DEFINE_Q8_GEMM_F16(64, 64, 2, 2, 4, 3)
