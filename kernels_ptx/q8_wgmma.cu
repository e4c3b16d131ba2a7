// The built-in dense GEMM on sm_90's warpgroup tensor cores (wgmma): what q8_gemm_f16.cu computes,
//
//   C[T, N] (+)= A[T, K] . W[N, K]^T      A fp16 (gemm_input_f16's), W Q8_0, fp16 products, fp32 sums
//
// with the weight as wgmma's A operand, from registers, and the tokens as its B operand, from shared
// memory: a warpgroup multiplies 64 weight rows by BT tokens (BT = wgmma's N, 128 or 256) per k16 step.
//   - The int8 weight tile, its fp16 scales and the fp16 token tile arrive by cp.async in a STAGES-deep
//     ring (one __syncthreads per BK = 64 of K; weights before pdl_wait, tokens after it).
//   - Token rows are 128 bytes (64 halves of K) in the 128-byte swizzle wgmma's descriptor reads: 16-byte
//     chunk c of row r at chunk c ^ (r % 8), 8-row groups 1024 bytes apart (the descriptor's stride); the
//     k16 steps advance the descriptor's start by 32 bytes.  Stages start at 1024-byte boundaries.
//   - Each thread expands its A fragment (rows g and g + 8 of its warp's 16, k 2q, 2q + 1, 2q + 8, 2q + 9)
//     from the int8 tile: two 16-bit shared loads a row, the bytes spliced into fp16 1024 + u, 1152
//     subtracted, times the scale: fp16(q * d), the rounding of q8_dequant_f16 and q8_gemm_f16.cu.
//   - The stage's four wgmmas are committed as one group and waited for before the next stage's barrier
//     (their A registers and the slot they read must outlive them); fence.proxy.async orders the cp.async
//     writes before wgmma's reads.
// The accumulator fragment (64 rows x BT columns) is stored transposed: C rows are tokens, C columns
// weight rows.  Rows past N, tokens past T and K past its end are zero-filled and never stored.
// wgmma needs sm_90a (kernels_ptx/build.py compiles this file for it); on other GPUs the kernels trap.
#include "common.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KESTREL_WGMMA 1
#include "q8_tile.cuh"
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], const unsigned int (&a)[4], unsigned long long desc) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], const unsigned int (&a)[4], unsigned long long desc) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

__device__ __forceinline__ unsigned long long wgmma_desc(unsigned int smem_address) {
    return (unsigned long long)((smem_address & 0x3FFFF) >> 4)   // start address
           | (1ull << 16)                                      // leading byte offset: unused with the swizzle
           | ((unsigned long long)(1024 >> 4) << 32)           // stride byte offset: 8 rows of 128 bytes
           | (1ull << 62);                                     // 128-byte swizzle
}
#endif

template <int WG, int BT, int STAGES>
__device__ __forceinline__ void q8_wgmma_body(const int8* __restrict__ qs, const half_bits* __restrict__ scales,
                                              const half_bits* __restrict__ a, int lda, float* c, int ldc, int T,
                                              int N, int K, int accumulate) {
#ifdef KESTREL_WGMMA
    constexpr int BK = Q8_TILE_K, SW = Q8_TILE_SCALE_WORDS;
    constexpr int BW = 64 * WG, THREADS = 128 * WG, ACC = BT / 2;
    constexpr int X_BYTES = BT * 128, W_STRIDE = Q8_TILE_STRIDE, W_BYTES = BW * W_STRIDE, S_BYTES = BW * SW * 4;
    constexpr int STAGE_BYTES = (X_BYTES + W_BYTES + S_BYTES + 1023) / 1024 * 1024;
    constexpr int X_CHUNKS = BT * (BK / 8);
    static_assert(BT == 128 || BT == 256, "wgmma N");

    extern __shared__ __align__(1024) unsigned char wg_shared[];
    pdl_launch_dependents();
    {
        unsigned int dynamic_bytes;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
        if (dynamic_bytes < (unsigned int)(STAGES * STAGE_BYTES + 1024)) __trap();
    }
    const unsigned int raw_base = (unsigned int)__cvta_generic_to_shared(wg_shared);
    const unsigned int base = (raw_base + 1023) & ~1023u;            // stages at 1024-byte boundaries
    unsigned char* const generic_base = wg_shared + (base - raw_base);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
    const int tok0 = blockIdx.x * BT, row0 = blockIdx.y * BW;
    const int kblocks = K >> 5, stages = (K + BK - 1) / BK;
    const Q8Scales sc(scales, N, kblocks);

    auto issue_weights = [&](int s) {
        if (s >= stages) return;
        const unsigned int sw = base + (s % STAGES) * STAGE_BYTES + X_BYTES;
        q8_tile_issue<BW, THREADS>(sw, sw + W_BYTES, qs, sc, row0, s * BK, N, K, kblocks, tid);
    };
    auto issue_tokens = [&](int s) {
        if (s < stages) {
            const int k0 = s * BK;
            const unsigned int sx = base + (s % STAGES) * STAGE_BYTES;
#pragma unroll
            for (int j = 0; j < (X_CHUNKS + THREADS - 1) / THREADS; j++) {
                const int chunk = tid + j * THREADS;
                if (X_CHUNKS % THREADS != 0 && chunk >= X_CHUNKS) break;
                const int r = chunk / (BK / 8), part = chunk % (BK / 8), tok = tok0 + r, k = k0 + part * 8;
                cp_async16(sx + r * 128 + ((part ^ (r & 7)) << 4),
                           a + (long long)min(tok, T - 1) * lda + min(k, K - 8), tok < T && k < K);
            }
        }
        cp_async_commit();
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) issue_weights(s);
    pdl_wait();
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) issue_tokens(s);

    float acc[ACC];
#pragma unroll
    for (int i = 0; i < ACC; i++) acc[i] = 0.f;
    const int r_lo = (warp >> 2) * 64 + (warp & 3) * 16 + g, r_hi = r_lo + 8;   // this thread's A rows in the tile
    for (int s = 0; s < stages; s++) {
        cp_async_wait<STAGES - 2>();
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // cp.async writes -> wgmma's reads
        __syncthreads();
        issue_weights(s + STAGES - 1);
        issue_tokens(s + STAGES - 1);

        const int slot = s % STAGES;
        const unsigned int sx = base + slot * STAGE_BYTES;
        const unsigned char* wtile = generic_base + slot * STAGE_BYTES + X_BYTES;
        const half_bits* sscale = (const half_bits*)(wtile + W_BYTES);
        const int kb0 = (s * BK) >> 5;
        const int p_lo = sc.parity(row0 + r_lo, kblocks, kb0), p_hi = sc.parity(row0 + r_hi, kblocks, kb0);
        unsigned int af[BK / 16][4];
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            const unsigned int d_lo = sscale[r_lo * SW * 2 + p_lo + kk / 2], d_hi = sscale[r_hi * SW * 2 + p_hi + kk / 2];
            const unsigned short* lo = (const unsigned short*)(wtile + r_lo * W_STRIDE + kk * 16 + 2 * q);
            const unsigned short* hi = (const unsigned short*)(wtile + r_hi * W_STRIDE + kk * 16 + 2 * q);
            const unsigned int w_lo = ((unsigned int)lo[0] | ((unsigned int)lo[4] << 16)) ^ 0x80808080u;
            const unsigned int w_hi = ((unsigned int)hi[0] | ((unsigned int)hi[4] << 16)) ^ 0x80808080u;
            af[kk][0] = q8_dequant_pair(w_lo, 0x4140u, d_lo | (d_lo << 16));   // row g, k 2q, 2q + 1
            af[kk][1] = q8_dequant_pair(w_hi, 0x4140u, d_hi | (d_hi << 16));   // row g + 8
            af[kk][2] = q8_dequant_pair(w_lo, 0x4342u, d_lo | (d_lo << 16));   // row g, k 2q + 8, 2q + 9
            af[kk][3] = q8_dequant_pair(w_hi, 0x4342u, d_hi | (d_hi << 16));
        }
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            if constexpr (BT == 128) wgmma_m64n128k16(acc, af[kk], wgmma_desc(sx + kk * 32));
            else wgmma_m64n256k16(acc, af[kk], wgmma_desc(sx + kk * 32));
        }
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
        for (int i = 0; i < ACC; i++) asm volatile("" : "+f"(acc[i])::"memory");
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++)
            asm volatile("" : "+r"(af[kk][0]), "+r"(af[kk][1]), "+r"(af[kk][2]), "+r"(af[kk][3])::"memory");
    }
    cp_async_wait<0>();

    // acc[4j + e]: weight row r_lo (e < 2) or r_hi, token 8j + 2q + (e & 1)
#pragma unroll
    for (int j = 0; j < BT / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int tok = tok0 + 8 * j + 2 * q + (e & 1), n = row0 + (e < 2 ? r_lo : r_hi);
            if (tok < T && n < N) {
                float* out = c + (long long)tok * ldc + n;
                *out = accumulate ? *out + acc[4 * j + e] : acc[4 * j + e];
            }
        }
#else
    __trap();
#endif
}

// q8_wgmma_<64 x WG>x<BT>_s<STAGES>: kestrel_stream/cuda/dense_gemm.WGMMA_TILES
#define DEFINE_Q8_WGMMA(WG, BW, BT, ST)                                                                     \
    extern "C" __global__ void __launch_bounds__(128 * WG, 1) q8_wgmma_##BW##x##BT##_s##ST(                  \
            const int8* qs, const half_bits* scales, const half_bits* a, int lda, float* c, int ldc, int T,  \
            int N, int K, int accumulate) {                                                                  \
        q8_wgmma_body<WG, BT, ST>(qs, scales, a, lda, c, ldc, T, N, K, accumulate);                          \
    }
DEFINE_Q8_WGMMA(2, 128, 128, 4)
DEFINE_Q8_WGMMA(2, 128, 256, 4)
DEFINE_Q8_WGMMA(1, 64, 128, 4)
DEFINE_Q8_WGMMA(1, 64, 256, 4)
