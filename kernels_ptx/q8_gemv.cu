// Q8_0 matrix-vector products for decode (M = 1..8 tokens per launch; more tokens
// go to q8_matmul.cu).
//
//   s[m, n] = sum_k W[n, k] * x[m, k]          W = qs[n, k] * scale[n, k/32]
//   s[m, n] *= inv_rms_in[m]                    when inv_rms_in: x is the residual stream
//                                               already multiplied by the norm weight
//                                               (xn below), so this IS the RMSNorm
//   y[m, n] = s (+ res[m, n])                   y may alias res (one thread per element)
//   SILU_PAIRS: rows come as (gate j, up j) pairs (interleaved at load), and
//   y[m, j] = silu(s[2j]) * s[2j + 1]           the MLP activation, in the epilogue
//   xn[m, n] = y[m, n] * normw_out[n]           when xn_out: the next RMSNorm's input
//   inv_rms_out[m] = 1/sqrt(mean_n y[m, n]^2 + eps)
//                                               each block adds its outputs' squares to
//                                               a per-token sum (atomics), the last block
//                                               to finish (atomic ticket) turns the sums
//                                               into 1/rms and zeroes them and the ticket
// `counter` is a zeroed 64-byte scratch: [0] the ticket, floats [8..15] the sums.
// So no GEMV block ever re-reads x to normalise or gate it, and no block re-reads y:
// the folded work happens once per element, in the epilogue of the kernel that
// produced it.
//
// Work layout: a block of THREADS threads owns ROWS rows; threads split K into
// 16-byte chunks (half a Q8_0 block) and take UNROLL chunks per iteration, so each
// thread has ROWS*UNROLL independent 16-byte loads in flight.  The variants trade
// blocks for bytes in flight per thread (kestrel_stream/cuda/gemv_variants.py):
// 128 threads x 2 rows suits many rows, one warp x 2 rows x 4 chunks keeps a short
// K=2048 row's whole weight in flight at once and reduces with shuffles only.
// The first chunks' weight loads are issued before pdl_wait(): under programmatic
// dependent launch they overlap the previous kernel's tail.
#include "common.cuh"


__device__ __forceinline__ uint4 load_stream(const void* p) {
    // weights are read once per step: keep them out of L1, which holds x
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ float4 load_x4(const float4* p) {
    // an L1-cached load the compiler may not merge with the same load for another row
    float4 v;
    asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ float silu_mul(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

template <int M, int ROWS, bool SILU_PAIRS, int THREADS, int UNROLL, bool ROW_OUTER = false>
__device__ __forceinline__ void q8_gemv_body(
        const int8* __restrict__ qs, const half_bits* __restrict__ scales, const float* x, int ldx,
        const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out, float* xn_out,
        float* inv_rms_out, unsigned int* counter, float eps, int N, int K, int ntok) {
    constexpr int WARPS = THREADS / 32;
    __shared__ float partial[WARPS][ROWS * M];
    __shared__ bool is_last_block;
    pdl_launch_dependents();
    const int row0 = blockIdx.x * ROWS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    float acc[ROWS][M];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int m = 0; m < M; m++) acc[r][m] = 0.f;

    const int chunks = K >> 4, scale_stride = K >> 5;
    for (int c0 = threadIdx.x; c0 < chunks; c0 += THREADS * UNROLL) {
        uint4 raw[UNROLL][ROWS];
        float scale[UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int c = c0 + u * THREADS;
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                int row = min(row0 + r, N - 1);   // a clamped row computes garbage that is never stored
                if (c < chunks) {
                    raw[u][r] = load_stream(qs + (long long)row * K + c * 16);
                    scale[u][r] = half_to_float(__ldg(scales + (long long)row * scale_stride + (c >> 1)));
                }
            }
        }
        if (c0 == (int)threadIdx.x) pdl_wait();   // x (and y, res) belong to earlier kernels
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int c = c0 + u * THREADS;
            if (c >= chunks) break;
            if constexpr (ROW_OUTER) {
                // several tokens: one row's 16 weights at a time, x re-read (from L1) per row, so the
                // registers hold 16 weights instead of ROWS * 16 and more warps stay resident
#pragma unroll
                for (int r = 0; r < ROWS; r++) {
                    float wf[16];
                    unsigned int words[4] = {raw[u][r].x ^ 0x80808080u, raw[u][r].y ^ 0x80808080u,
                                             raw[u][r].z ^ 0x80808080u, raw[u][r].w ^ 0x80808080u};
#pragma unroll
                    for (int w = 0; w < 4; w++)
#pragma unroll
                        for (int b = 0; b < 4; b++) wf[4 * w + b] = byte_to_float(words[w], b);
#pragma unroll
                    for (int m = 0; m < M; m++) {
                        const float4* xp = (const float4*)(x + (long long)m * ldx) + c * 4;
                        float dot = 0.f;
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            float4 v = load_x4(xp + i);   // not merged across rows: registers stay few
                            dot = fmaf(wf[4 * i], v.x, dot);
                            dot = fmaf(wf[4 * i + 1], v.y, dot);
                            dot = fmaf(wf[4 * i + 2], v.z, dot);
                            dot = fmaf(wf[4 * i + 3], v.w, dot);
                        }
                        acc[r][m] = fmaf(scale[u][r], dot, acc[r][m]);
                    }
                }
            } else {
                float wf[ROWS][16];   // weights converted once per chunk, x loaded once per token
#pragma unroll
                for (int r = 0; r < ROWS; r++) {
                    unsigned int words[4] = {raw[u][r].x ^ 0x80808080u, raw[u][r].y ^ 0x80808080u,
                                             raw[u][r].z ^ 0x80808080u, raw[u][r].w ^ 0x80808080u};
#pragma unroll
                    for (int w = 0; w < 4; w++)
#pragma unroll
                        for (int b = 0; b < 4; b++) wf[r][4 * w + b] = byte_to_float(words[w], b);
                }
#pragma unroll
                for (int m = 0; m < M; m++) {
                    const float4* xp = (const float4*)(x + (long long)m * ldx) + c * 4;
                    float xin[16];
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        float4 v = xp[i];
                        xin[4 * i] = v.x; xin[4 * i + 1] = v.y; xin[4 * i + 2] = v.z; xin[4 * i + 3] = v.w;
                    }
#pragma unroll
                    for (int r = 0; r < ROWS; r++) {
                        float dot = 0.f;
#pragma unroll
                        for (int i = 0; i < 16; i++) dot = fmaf(wf[r][i], xin[i], dot);
                        acc[r][m] = fmaf(scale[u][r], dot, acc[r][m]);
                    }
                }
            }
        }
    }

    pdl_wait();   // threads with no chunk (K < 16 * threadIdx.x) wait here
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int m = 0; m < M; m++) {
            float s = warp_sum(acc[r][m]);
            if (lane == 0) partial[warp][r * M + m] = s;
        }
    __syncthreads();
    if (threadIdx.x < ROWS * M) {
        int i = threadIdx.x, m = i % M;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) s += partial[w][i];
        if (inv_rms_in) s *= inv_rms_in[m];
        partial[0][i] = s;   // each thread rewrites only its own entry
    }
    __syncthreads();
    const int outputs = SILU_PAIRS ? ROWS / 2 : ROWS;
    __shared__ float squares[ROWS * M];
    if (threadIdx.x < outputs * M) {
        int r = threadIdx.x / M, m = threadIdx.x % M;
        int col = SILU_PAIRS ? row0 / 2 + r : row0 + r;
        float s = 0.f;
        if (col < (SILU_PAIRS ? N / 2 : N)) {
            s = SILU_PAIRS ? silu_mul(partial[0][(2 * r) * M + m], partial[0][(2 * r + 1) * M + m])
                           : partial[0][r * M + m];
            long long at = (long long)m * ldy + col;
            if (res) s += res[at];
            y[at] = s;
            if (xn_out) xn_out[at] = s * normw_out[col];
        }
        squares[threadIdx.x] = s * s;   // [r][m]; rows past N add 0
    }
    if (inv_rms_out == nullptr) return;

    float* sums = (float*)(counter + 8);
    __syncthreads();
    if (threadIdx.x == 0) {   // one thread adds the block's squares and takes the ticket: one fence per block
        for (int m = 0; m < ntok; m++) {
            float sq = 0.f;
#pragma unroll
            for (int r = 0; r < outputs; r++) sq += squares[r * M + m];
            atomicAdd(sums + m, sq);
        }
        __threadfence();   // the sums land before the ticket is taken
        is_last_block = atomicAdd(counter, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!is_last_block) return;
    __threadfence();
    if (threadIdx.x < ntok) {
        float total = atomicExch(sums + threadIdx.x, 0.f);   // read at L2, and zeroed for the next launch
        inv_rms_out[threadIdx.x] = 1.0f / sqrtf(total / (float)N + eps);
    }
    if (threadIdx.x == 0) *counter = 0u;
}

#define DEFINE_GEMV(M, ROWS, SILU, THREADS, UNROLL, NAME) DEFINE_GEMV_AS(M, ROWS, SILU, THREADS, UNROLL, false, NAME)
#define DEFINE_GEMV_AS(M, ROWS, SILU, THREADS, UNROLL, ROW_OUTER, NAME)                          \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(                                  \
            const int8* qs, const half_bits* scales, const float* x, int ldx,                    \
            const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out,\
            float* xn_out, float* inv_rms_out, unsigned int* counter, float eps, int N, int K,   \
            int ntok) {                                                                          \
        q8_gemv_body<M, ROWS, SILU, THREADS, UNROLL, ROW_OUTER>(qs, scales, x, ldx, inv_rms_in, y,  \
                                                     ldy, res, normw_out, xn_out, inv_rms_out,   \
                                                     counter, eps, N, K, ntok);                  \
    }
#define DEFINE_GEMV_M(M) DEFINE_GEMV(M, 2, false, 128, 2, q8_gemv_m##M) \
                         DEFINE_GEMV(M, 2, true, 128, 2, q8_gemv_m##M##_silu)
// single-token variants: THREADS x ROWS x UNROLL (the names in kestrel_stream/cuda/gemv_variants.py)
#define DEFINE_GEMV_1(ROWS, THREADS, UNROLL, SUFFIX)                                               \
    DEFINE_GEMV(1, ROWS, false, THREADS, UNROLL, q8_gemv_m1_##SUFFIX)                            \
    DEFINE_GEMV(1, ROWS, true, THREADS, UNROLL, q8_gemv_m1_##SUFFIX##_silu)

DEFINE_GEMV_M(1)
DEFINE_GEMV_M(2)
DEFINE_GEMV_M(3)
DEFINE_GEMV_M(4)
DEFINE_GEMV_M(5)
DEFINE_GEMV_M(6)
DEFINE_GEMV_M(7)
DEFINE_GEMV_M(8)
DEFINE_GEMV_1(4, 128, 2, r4)         // 4 rows per block: half the x traffic per weight byte
DEFINE_GEMV_1(2, 32, 4, w32r2u4)     // one warp, 2 rows, 8 loads in flight per lane
DEFINE_GEMV_1(4, 32, 2, w32r4u2)
DEFINE_GEMV_1(2, 32, 2, w32r2u2)
DEFINE_GEMV_1(2, 64, 4, w64r2u4)
DEFINE_GEMV_1(4, 64, 2, w64r4u2)
DEFINE_GEMV_1(2, 128, 4, w128r2u4)
DEFINE_GEMV_1(4, 32, 4, w32r4u4)     // K = 2048: a row's 128 chunks in one pass, 16 loads in flight
DEFINE_GEMV_1(8, 64, 2, w64r8u2)
DEFINE_GEMV_1(4, 128, 3, w128r4u3)   // K = 6144: a row's 384 chunks in one pass, 12 loads in flight
DEFINE_GEMV_1(2, 128, 3, w128r2u3)
// multi-token variants, row-outer (names in gemv_variants.MULTI_VARIANTS): tokens 2..8, plain and SiLU
#define DEFINE_GEMV_MN_1(M, ROWS, THREADS, UNROLL, SUFFIX)                                         \
    DEFINE_GEMV_AS(M, ROWS, false, THREADS, UNROLL, true, q8_gemv_m##M##_##SUFFIX)               \
    DEFINE_GEMV_AS(M, ROWS, true, THREADS, UNROLL, true, q8_gemv_m##M##_##SUFFIX##_silu)
#define DEFINE_GEMV_MN(ROWS, THREADS, UNROLL, SUFFIX)                                              \
    DEFINE_GEMV_MN_1(2, ROWS, THREADS, UNROLL, SUFFIX) DEFINE_GEMV_MN_1(3, ROWS, THREADS, UNROLL, SUFFIX) \
    DEFINE_GEMV_MN_1(4, ROWS, THREADS, UNROLL, SUFFIX) DEFINE_GEMV_MN_1(5, ROWS, THREADS, UNROLL, SUFFIX) \
    DEFINE_GEMV_MN_1(6, ROWS, THREADS, UNROLL, SUFFIX) DEFINE_GEMV_MN_1(7, ROWS, THREADS, UNROLL, SUFFIX) \
    DEFINE_GEMV_MN_1(8, ROWS, THREADS, UNROLL, SUFFIX)
DEFINE_GEMV_MN(4, 64, 2, o64r4u2)
DEFINE_GEMV_MN(4, 128, 1, o128r4u1)
