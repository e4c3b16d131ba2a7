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
//   inv_rms_out[m] = 1/sqrt(mean_n y[m, n]^2 + eps)   by the last block to finish
//                                               (atomic ticket on `counter`, reset by it)
// So no GEMV block ever re-reads x to normalise or gate it: the folded prologue
// work happens once per element, in the epilogue of the kernel that produced it.
//
// Work layout: a block of 128 threads owns ROWS (2 or 4) rows; threads split K
// into 16-byte chunks (half a Q8_0 block) and take UNROLL chunks per iteration
// so each thread has ROWS*UNROLL independent 16-byte loads in flight.  Few rows
// per block means many blocks: occupancy is what keeps HBM busy.
#include "common.cuh"

#define GEMV_THREADS 128
#define GEMV_WARPS (GEMV_THREADS / 32)

__device__ __forceinline__ uint4 load_stream(const void* p) {
    // weights are read once per step: keep them out of L1, which holds x
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ float silu_mul(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

template <int M, int ROWS, bool SILU_PAIRS>
__device__ __forceinline__ void q8_gemv_body(
        const int8* __restrict__ qs, const half_bits* __restrict__ scales, const float* x, int ldx,
        const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out, float* xn_out,
        float* inv_rms_out, unsigned int* counter, float eps, int N, int K, int ntok) {
    constexpr int UNROLL = 2;   // 4 with 2 rows measured slower: registers cost occupancy
    __shared__ float partial[GEMV_WARPS][ROWS * M];
    __shared__ bool is_last_block;
    __shared__ float block_sums[GEMV_WARPS];
    const int row0 = blockIdx.x * ROWS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    float acc[ROWS][M];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int m = 0; m < M; m++) acc[r][m] = 0.f;

    const int chunks = K >> 4, scale_stride = K >> 5;
    for (int c0 = threadIdx.x; c0 < chunks; c0 += GEMV_THREADS * UNROLL) {
        uint4 raw[UNROLL][ROWS];
        float scale[UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int c = c0 + u * GEMV_THREADS;
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                int row = min(row0 + r, N - 1);   // a clamped row computes garbage that is never stored
                if (c < chunks) {
                    raw[u][r] = load_stream(qs + (long long)row * K + c * 16);
                    scale[u][r] = half_to_float(__ldg(scales + (long long)row * scale_stride + (c >> 1)));
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int c = c0 + u * GEMV_THREADS;
            if (c >= chunks) break;
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
        for (int w = 0; w < GEMV_WARPS; w++) s += partial[w][i];
        if (inv_rms_in) s *= inv_rms_in[m];
        partial[0][i] = s;   // each thread rewrites only its own entry
    }
    __syncthreads();
    const int outputs = SILU_PAIRS ? ROWS / 2 : ROWS;
    if (threadIdx.x < outputs * M) {
        int r = threadIdx.x / M, m = threadIdx.x % M;
        int col = SILU_PAIRS ? row0 / 2 + r : row0 + r;
        if (col < (SILU_PAIRS ? N / 2 : N)) {
            float s = SILU_PAIRS ? silu_mul(partial[0][(2 * r) * M + m], partial[0][(2 * r + 1) * M + m])
                                 : partial[0][r * M + m];
            long long at = (long long)m * ldy + col;
            if (res) s += res[at];
            y[at] = s;
            if (xn_out) xn_out[at] = s * normw_out[col];
        }
    }
    if (inv_rms_out == nullptr) return;

    __threadfence();   // this block's y is visible device-wide before its ticket is
    __syncthreads();
    if (threadIdx.x == 0) is_last_block = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!is_last_block) return;
    __threadfence();
    // the whole block per token, loads from L2 (not a possibly stale L1), 4 in flight per thread
    // (scalar: y rows need not be 16-byte aligned)
    for (int m = 0; m < ntok; m++) {
        const float* row = y + (long long)m * ldy;
        float sq = 0.f;
#pragma unroll 4
        for (int k = threadIdx.x; k < N; k += GEMV_THREADS) {
            float v = __ldcg(row + k);
            sq += v * v;
        }
        sq = warp_sum(sq);
        if (lane == 0) block_sums[warp] = sq;
        __syncthreads();
        if (threadIdx.x == 0) {
            float total = 0.f;
#pragma unroll
            for (int w = 0; w < GEMV_WARPS; w++) total += block_sums[w];
            inv_rms_out[m] = 1.0f / sqrtf(total / (float)N + eps);
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) *counter = 0u;
}

#define DEFINE_GEMV(M, ROWS, SILU, NAME)                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) NAME(                             \
            const int8* qs, const half_bits* scales, const float* x, int ldx,                    \
            const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out,\
            float* xn_out, float* inv_rms_out, unsigned int* counter, float eps, int N, int K,   \
            int ntok) {                                                                          \
        q8_gemv_body<M, ROWS, SILU>(qs, scales, x, ldx, inv_rms_in, y, ldy, res, normw_out,      \
                                    xn_out, inv_rms_out, counter, eps, N, K, ntok);              \
    }
#define DEFINE_GEMV_M(M) DEFINE_GEMV(M, 2, false, q8_gemv_m##M) DEFINE_GEMV(M, 2, true, q8_gemv_m##M##_silu)

DEFINE_GEMV_M(1)
DEFINE_GEMV_M(2)
DEFINE_GEMV_M(3)
DEFINE_GEMV_M(4)
DEFINE_GEMV_M(5)
DEFINE_GEMV_M(6)
DEFINE_GEMV_M(7)
DEFINE_GEMV_M(8)
// 4 rows per block for one token: half the x traffic per weight byte; tall matrices
DEFINE_GEMV(1, 4, false, q8_gemv_m1_r4)
DEFINE_GEMV(1, 4, true, q8_gemv_m1_r4_silu)
