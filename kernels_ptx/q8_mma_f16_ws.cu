// Q8_0 matrix-matrix product on fp16 tensor cores, weights dequantised ONCE per block into shared memory
// (the tiles of kestrel_stream/cuda/mma_variants.F16_TILES), for steps of 128+ tokens that have no dense
// path (gated and layers=N modes' device steps; gpu mode runs q8_wgmma.cu / q8_gemm_f16.cu).  Arguments
// and epilogues are the GEMV's: fp16(q * d) weights, fp16(x * inv_rms_in) activations, fp32 sums;
// SiLU·mul row pairs, residual, xn and the last block's 1/rms.
//
// How:
//   - each thread dequantises exactly the 16-byte int8 chunks it itself copied by cp.async (so the int8
//     ring needs no barrier: a slot is read and refilled by the same thread) into an fp16 tile;
//   - x is rounded to fp16 into a second tile; both are double-buffered, one __syncthreads per BK stage,
//     and stage s + 1 is converted while stage s is multiplied;
//   - A and B fragments come by ldmatrix.x4 (A: one per 16 tokens x 16 k, B: one per 16 rows x 16 k)
//     from XOR-swizzled rows (16-byte chunk c of row r at c ^ f(r)): conflict-free for ldmatrix and for
//     the conversion's 16-byte stores.
// X_ASYNC (the "_xa" tiles): x comes by cp.async too, into a STAGES-deep fp32 ring, instead of waiting a
// stage ahead in registers (BM x BK / threads float4s each): fewer registers, more shared memory.
// Shared memory is dynamic (F16Tile.shared_bytes: STAGES x BN x BK int8 [+ STAGES x BM x BK fp32 x]
// + 2 x (BN + BM) x BK fp16); the kernel traps if launched with less.
#include "common.cuh"
#include "mma_epilogue.cuh"

__device__ __forceinline__ void ws_cp_async16(unsigned int dst, const void* gmem, bool valid) {
    int bytes = valid ? 16 : 0;   // 0: the 16 bytes are zero-filled (the K tail)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(bytes) : "memory");
}

__device__ __forceinline__ unsigned int ws_f16x2(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));   // first source -> upper half
    return r;
}

// Two signed bytes of `biased` (each xor 0x80), picked by `selector`, times the f16x2 scale pair d2:
// 0x64uu is the fp16 1024 + u exactly, so (0x64uu - 1152) is the byte's value and one mul rounds q * d.
__device__ __forceinline__ unsigned int ws_dequant_pair(unsigned int biased, unsigned int selector, unsigned int d2) {
    unsigned int h = __byte_perm(biased, 0x64646464u, selector), q, r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(q) : "r"(h), "r"(0x64806480u));
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(q), "r"(d2));
    return r;
}

__device__ __forceinline__ void ws_mma(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ws_ldmatrix_x4(unsigned int (&r)[4], unsigned int address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// Byte offset of 16-byte chunk `chunk` (8 halves) of row `row` in an fp16 tile of BK halves a row.
// BK 64 (8 chunks, 128 bytes): chunk ^ (row % 8); BK 32 (4 chunks, 64 bytes, two rows per 128-byte bank
// line): chunk ^ (row / 2 % 4).  Either way 8 consecutive rows of one chunk (an ldmatrix matrix) and
// the 8 chunks a quarter-warp stores land on 8 distinct 16-byte bank groups.
template <int BK>
__device__ __forceinline__ int ws_swizzle(int row, int chunk) {
    static_assert(BK == 32 || BK == 64, "BK");
    const int phys = BK == 64 ? (chunk ^ (row & 7)) : (chunk ^ ((row >> 1) & 3));
    return row * (BK * 2) + phys * 16;
}

template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES, bool X_ASYNC, bool SILU_PAIRS>
__device__ __forceinline__ void q8_f16mma_ws_body(
        const int8* __restrict__ qs, const half_bits* __restrict__ scales, const float* x, int ldx,
        const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out, float* xn_out,
        float* inv_rms_out, unsigned int* counter, float eps, int N, int K, int ntok) {
    constexpr int THREADS = 32 * WARPS_M * WARPS_N;
    constexpr int WTOK = BM / WARPS_M, WROW = BN / WARPS_N;        // a warp's output tile
    constexpr int FM = WTOK / 16, FN = WROW / 8;                     // mma tiles per warp
    constexpr int X_LOADS = BM * (BK / 4) / THREADS;                 // float4 of x per thread per stage
    constexpr int W_LOADS = BN * (BK / 16) / THREADS;                // 16-byte int8 chunks per thread per stage
    constexpr int W8_BYTES = BN * BK, W16_BYTES = BN * BK * 2, X16_BYTES = BM * BK * 2;
    constexpr int X32_BYTES = X_ASYNC ? BM * BK * 4 : 0;             // X_ASYNC: fp32 x ring slot
    constexpr unsigned int SHARED_BYTES = STAGES * (W8_BYTES + X32_BYTES) + 2 * (W16_BYTES + X16_BYTES);
    static_assert(FM >= 1 && FN >= 2 && FN % 2 == 0 && X_LOADS >= 1 && W_LOADS >= 1 && STAGES >= 2, "tile");
    static_assert(BM * (BK / 4) % THREADS == 0 && BN * (BK / 16) % THREADS == 0 && THREADS % 4 == 0, "tile");

    extern __shared__ __align__(128) unsigned char ws_shared[];
    pdl_launch_dependents();
    {
        unsigned int dynamic_bytes;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
        if (dynamic_bytes < SHARED_BYTES) __trap();   // launched without F16Tile.shared_bytes
    }
    unsigned char* w8 = ws_shared;                               // [STAGES][BN][BK] int8, thread-private chunks
    unsigned char* w16 = w8 + STAGES * W8_BYTES;                 // [2][BN][BK] fp16, swizzled
    unsigned char* x16 = w16 + 2 * W16_BYTES;                    // [2][BM][BK] fp16, swizzled
    unsigned char* x32 = x16 + 2 * X16_BYTES;                    // X_ASYNC: [STAGES][BM][BK] fp32, thread-private
    const unsigned int x32_s = (unsigned int)__cvta_generic_to_shared(x32);
    const unsigned int w8_s = (unsigned int)__cvta_generic_to_shared(w8);
    const unsigned int w16_s = (unsigned int)__cvta_generic_to_shared(w16);
    const unsigned int x16_s = (unsigned int)__cvta_generic_to_shared(x16);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
    const int tok0 = blockIdx.y * BM, row0 = blockIdx.x * BN;
    const int stages = (K + BK - 1) / BK, kblocks = K >> 5;

    // chunk j of this thread: row tid_chunk / (BK / 16), 16-byte part tid_chunk % (BK / 16); the same every stage
    auto issue_weights = [&](int slot, int k0) {
        if (k0 < K) {
#pragma unroll
            for (int j = 0; j < W_LOADS; j++) {
                const int chunk = tid + j * THREADS, r = chunk / (BK / 16), part = chunk % (BK / 16);
                const int row = min(row0 + r, N - 1);   // rows past N: finite values, never written
                const int k = k0 + part * 16;
                ws_cp_async16(w8_s + slot * W8_BYTES + chunk * 16, qs + (long long)row * K + min(k, K - 16), k < K);
            }
        }
    };
    auto commit = [] { asm volatile("cp.async.commit_group;" ::: "memory"); };   // one group per stage, empty past K
    // X_ASYNC: x of stage k0 by cp.async into ring slot `slot`, the float4s load_x would load (zeros past
    // ntok and K); like the weights, each thread reads back only what it copied
    auto issue_x = [&](int slot, int k0) {
        if (k0 < K) {
#pragma unroll
            for (int j = 0; j < X_LOADS; j++) {
                const int f = tid + j * THREADS, r = f / (BK / 4), k = k0 + (f % (BK / 4)) * 4, tok = tok0 + r;
                const float* src = x + (long long)min(tok, ntok - 1) * ldx + min(k, K - 4);
                ws_cp_async16(x32_s + slot * X32_BYTES + f * 16, src, tok < ntok && k < K);
            }
        }
    };
    auto read_x = [&](int slot, float4 (&dst)[X_LOADS]) {
#pragma unroll
        for (int j = 0; j < X_LOADS; j++) dst[j] = *(const float4*)(x32 + slot * X32_BYTES + (tid + j * THREADS) * 16);
    };
    auto load_scales = [&](int k0, unsigned int (&dst)[W_LOADS]) {
#pragma unroll
        for (int j = 0; j < W_LOADS; j++) {
            const int chunk = tid + j * THREADS, r = chunk / (BK / 16), part = chunk % (BK / 16);
            const int row = min(row0 + r, N - 1), block = (k0 + part * 16) >> 5;
            const unsigned int h = block < kblocks ? scales[(long long)row * kblocks + block] : 0u;
            dst[j] = h | (h << 16);
        }
    };
    auto load_x = [&](int k0, float4 (&dst)[X_LOADS]) {
#pragma unroll
        for (int j = 0; j < X_LOADS; j++) {
            const int f = tid + j * THREADS, r = f / (BK / 4), k = k0 + (f % (BK / 4)) * 4, tok = tok0 + r;
            dst[j] = (tok < ntok && k < K) ? *(const float4*)(x + (long long)tok * ldx + k)
                                           : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    float x_scale[X_LOADS];   // inv_rms_in of each x row this thread loads (the same rows every stage)
    // stage t's int8 (ring slot t % STAGES) and x registers -> fp16 buffer t % 2
    auto convert = [&](int t, const float4 (&xr)[X_LOADS], const unsigned int (&d2)[W_LOADS]) {
        const int buffer = t & 1;
        unsigned char* wdst = w16 + buffer * W16_BYTES;
        const unsigned char* wsrc = w8 + (t % STAGES) * W8_BYTES;
#pragma unroll
        for (int j = 0; j < W_LOADS; j++) {
            const int chunk = tid + j * THREADS, r = chunk / (BK / 16), part = chunk % (BK / 16);
            const uint4 q = *(const uint4*)(wsrc + chunk * 16);
            const unsigned int words[4] = {q.x ^ 0x80808080u, q.y ^ 0x80808080u, q.z ^ 0x80808080u,
                                           q.w ^ 0x80808080u};
            unsigned int h[8];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                h[2 * e] = ws_dequant_pair(words[e], 0x4140u, d2[j]);
                h[2 * e + 1] = ws_dequant_pair(words[e], 0x4342u, d2[j]);
            }
            *(uint4*)(wdst + ws_swizzle<BK>(r, 2 * part)) = make_uint4(h[0], h[1], h[2], h[3]);
            *(uint4*)(wdst + ws_swizzle<BK>(r, 2 * part + 1)) = make_uint4(h[4], h[5], h[6], h[7]);
        }
        unsigned char* xdst = x16 + buffer * X16_BYTES;
#pragma unroll
        for (int j = 0; j < X_LOADS; j++) {
            const int f = tid + j * THREADS, r = f / (BK / 4), c4 = f % (BK / 4);
            const float s = x_scale[j];
            *(uint2*)(xdst + ws_swizzle<BK>(r, c4 >> 1) + (c4 & 1) * 8) =
                    make_uint2(ws_f16x2(xr[j].x * s, xr[j].y * s), ws_f16x2(xr[j].z * s, xr[j].w * s));
        }
    };

    float acc[FM][FN][4];
#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int j = 0; j < FN; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

    float4 x_regs[X_LOADS];
    unsigned int scale_regs[W_LOADS];
#pragma unroll
    for (int st = 0; st < STAGES; st++) {
        issue_weights(st, st * BK);
        commit();
    }
    load_scales(0, scale_regs);
    pdl_wait();   // x and inv_rms_in are written by the previous kernel
#pragma unroll
    for (int j = 0; j < X_LOADS; j++) {
        const int tok = tok0 + (tid + j * THREADS) / (BK / 4);
        x_scale[j] = inv_rms_in && tok < ntok ? inv_rms_in[tok] : 1.0f;
    }
    if (X_ASYNC) {   // groups W0 .. W(STAGES-1), then X0 .. X(STAGES-1)
#pragma unroll
        for (int st = 0; st < STAGES; st++) {
            issue_x(st, st * BK);
            commit();
        }
    } else {
        load_x(0, x_regs);
    }
    // stage 0's own chunks are in (X_ASYNC: x of stage 0 too: all but the newest STAGES - 1 groups)
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1) : "memory");
    if (X_ASYNC) read_x(0, x_regs);
    convert(0, x_regs, scale_regs);
    if (stages > 1) {
        load_scales(BK, scale_regs);
        if (!X_ASYNC) load_x(BK, x_regs);
    }
    __syncthreads();

    // ldmatrix lane roles: A (16 tokens x 16 k): row lane % 16, chunk lane / 16;
    // B (16 rows x 16 k, two n tiles): row lane % 8 + 8 * (lane / 16), chunk lane / 8 % 2
    const int a_row = warp_m * WTOK + (lane & 15), a_chunk = lane >> 4;
    const int b_row = warp_n * WROW + (lane & 7) + ((lane >> 4) << 3), b_chunk = (lane >> 3) & 1;
    for (int s = 0; s < stages; s++) {
        issue_weights(s % STAGES, (s + STAGES) * BK);   // into stage s's slot: this thread converted it
        if (X_ASYNC) issue_x(s % STAGES, (s + STAGES) * BK);
        commit();
        if (s + 1 < stages) {
            asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1) : "memory");   // stage s + 1's chunks
            if (X_ASYNC) read_x((s + 1) % STAGES, x_regs);
            convert(s + 1, x_regs, scale_regs);   // into the other buffer: its readers passed the last barrier
            if (s + 2 < stages) {
                load_scales((s + 2) * BK, scale_regs);
                if (!X_ASYNC) load_x((s + 2) * BK, x_regs);
            }
        }
        const unsigned int xb = x16_s + (s & 1) * X16_BYTES, wb = w16_s + (s & 1) * W16_BYTES;
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            unsigned int a[FM][4];
#pragma unroll
            for (int i = 0; i < FM; i++) ws_ldmatrix_x4(a[i], xb + ws_swizzle<BK>(a_row + i * 16, kk * 2 + a_chunk));
#pragma unroll
            for (int jj = 0; jj < FN / 2; jj++) {
                unsigned int b[4];   // b0, b1 of n tile 2jj, then of n tile 2jj + 1
                ws_ldmatrix_x4(b, wb + ws_swizzle<BK>(b_row + jj * 16, kk * 2 + b_chunk));
#pragma unroll
                for (int i = 0; i < FM; i++) {
                    ws_mma(acc[i][2 * jj], a[i], b[0], b[1]);
                    ws_mma(acc[i][2 * jj + 1], a[i], b[2], b[3]);
                }
            }
        }
        __syncthreads();   // every warp is done with buffer s % 2 before stage s + 2 is converted into it
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");   // no copy outlives the block

#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int tok = tok0 + warp_m * WTOK + i * 16 + g + 8 * h;
            if (tok >= ntok) continue;
#pragma unroll
            for (int j = 0; j < FN; j++) {
                const int row = row0 + warp_n * WROW + j * 8 + c * 2;   // even: a (gate, up) pair
                const float v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];
                mma_store_pair<SILU_PAIRS>(tok, row, v0, v1, N, ldy, y, res, normw_out, xn_out);
            }
        }
    if (inv_rms_out == nullptr) return;

    // The last block of each row of token blocks computes its tokens' 1/rms, as q8_mma.cu's (one
    // ticket per row of blocks, counter[0..7]; more than 8 rows of blocks: one ticket).
    const bool ticket_per_row = gridDim.y <= 8;
    unsigned int* ticket = counter + (ticket_per_row ? blockIdx.y : 0);
    const unsigned int blocks_in_ticket = ticket_per_row ? gridDim.x : gridDim.x * gridDim.y;
    __threadfence();   // this block's y is visible device-wide before its ticket is
    __syncthreads();
    const bool last = tid == 0 && atomicAdd(ticket, 1u) == blocks_in_ticket - 1;
    if (!__syncthreads_or(last)) return;
    __threadfence();
    const int m_end = ticket_per_row ? min(tok0 + BM, ntok) : ntok;
    for (int m = (ticket_per_row ? tok0 : 0) + warp; m < m_end; m += THREADS / 32) {
        const float* row = y + (long long)m * ldy;
        float sq = 0.f;
        for (int k = lane; k < N; k += 32) { float v = __ldcg(row + k); sq += v * v; }
        sq = warp_sum(sq);
        if (lane == 0) inv_rms_out[m] = 1.0f / sqrtf(sq / (float)N + eps);
    }
    if (tid == 0) *ticket = 0u;
}

// q8_f16mma_<BM>x<BN>[k<BK>]_ws[_xa]_s<STAGES>[_b<MINB>] (+ _silu): the "_ws" tiles of
// mma_variants.F16_TILES; XA (_xa): x by cp.async too; MINB blocks per SM caps the registers (65536 / (MINB x threads))
#define DEFINE_F16MMA_WS(BM, BN, BK, WM, WN, ST, XA, MINB, SILU, NAME)                               \
    extern "C" __global__ void __launch_bounds__(32 * WM * WN, MINB) NAME(                           \
            const int8* qs, const half_bits* scales, const float* x, int ldx,                        \
            const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out,    \
            float* xn_out, float* inv_rms_out, unsigned int* counter, float eps, int N, int K,       \
            int ntok) {                                                                              \
        q8_f16mma_ws_body<BM, BN, BK, WM, WN, ST, XA, SILU>(qs, scales, x, ldx, inv_rms_in, y, ldy, res,  \
                                                           normw_out, xn_out, inv_rms_out, counter, eps, N, \
                                                           K, ntok);                                 \
    }
#define DEFINE_F16MMA_WS_PAIR(BM, BN, BK, WM, WN, ST, XA, MINB, SUFFIX)            \
    DEFINE_F16MMA_WS(BM, BN, BK, WM, WN, ST, XA, MINB, false, q8_f16mma_##SUFFIX)  \
    DEFINE_F16MMA_WS(BM, BN, BK, WM, WN, ST, XA, MINB, true, q8_f16mma_##SUFFIX##_silu)
DEFINE_F16MMA_WS_PAIR(64, 64, 64, 2, 2, 3, 1, 2, 64x64k64_ws_xa_s3_b2)
DEFINE_F16MMA_WS_PAIR(128, 256, 32, 2, 4, 4, 1, 1, 128x256_ws_xa_s4)
DEFINE_F16MMA_WS_PAIR(64, 128, 64, 2, 4, 4, 0, 2, 64x128k64_ws_s4_b2)
DEFINE_F16MMA_WS_PAIR(128, 128, 64, 2, 4, 3, 0, 1, 128x128k64_ws_s3)
DEFINE_F16MMA_WS_PAIR(128, 128, 32, 2, 4, 3, 1, 2, 128x128_ws_xa_s3_b2)
