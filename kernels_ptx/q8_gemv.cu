// Q8_0 matrix-vector products for decode (M = 1..8 tokens per launch) and, with
// blockIdx.y walking 8-token slices, for prefill.
//
//   y[m, n] = sum_k W[n, k] * xin(m, k)  (+ res[m, n])      W = qs[n, k] * scale[n, k/32]
//
// xin by MODE (folded prologues, so no separate launch and no round trip of the
// activation through memory):
//   0  x[m, k]
//   1  rmsnorm: x[m, k] * normw[k] / sqrt(mean_k x[m]^2 + eps)
//   2  silu·mul: silu(x[m, k]) * x[m, K + k]   (x holds gate then up, ldx >= 2K)
// The residual add is the epilogue; y may alias res (each element is read then
// written by the same thread).
//
// Layout of work: a block of 128 threads owns ROWS consecutive rows; its threads
// split K into 16-byte chunks (16 int8 = half a Q8_0 block), so one block issues
// ROWS independent 16-byte loads per thread before using any of them.
#include "common.cuh"

#define GEMV_THREADS 128
#define GEMV_WARPS (GEMV_THREADS / 32)

template <int M, int ROWS, int MODE>
__device__ __forceinline__ void q8_gemv_body(
        const int8* __restrict__ qs, const half_bits* __restrict__ scales,
        const float* __restrict__ x, int ldx, const float* __restrict__ normw, float eps,
        float* y, int ldy, const float* res, int N, int K, int ntok) {
    __shared__ float inv_rms[M];
    __shared__ float partial[GEMV_WARPS][ROWS * M];
    const int m0 = blockIdx.y * M;
    const int row0 = blockIdx.x * ROWS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* xm = x + (long long)m0 * ldx;

    if (MODE == 1) {
#pragma unroll
        for (int m = 0; m < M; m++) {
            float sq = 0.f;
            if (m0 + m < ntok)
                for (int k = threadIdx.x; k < K; k += GEMV_THREADS) { float v = xm[m * ldx + k]; sq += v * v; }
            sq = warp_sum(sq);
            if (lane == 0) partial[warp][m] = sq;
        }
        __syncthreads();
        if (threadIdx.x < M) {
            float s = 0.f;
#pragma unroll
            for (int w = 0; w < GEMV_WARPS; w++) s += partial[w][threadIdx.x];
            inv_rms[threadIdx.x] = 1.0f / sqrtf(s / (float)K + eps);
        }
        __syncthreads();
    }

    float acc[ROWS][M];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int m = 0; m < M; m++) acc[r][m] = 0.f;

    const int chunks = K >> 4;
    const int scale_stride = K >> 5;
    for (int c = threadIdx.x; c < chunks; c += GEMV_THREADS) {
        uint4 raw[ROWS];
        float scale[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            int row = min(row0 + r, N - 1);   // clamped rows compute garbage that is never stored
            raw[r] = __ldg((const uint4*)(qs + (long long)row * K) + c);
            scale[r] = half_to_float(__ldg(scales + (long long)row * scale_stride + (c >> 1)));
        }
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            raw[r].x ^= 0x80808080u; raw[r].y ^= 0x80808080u;
            raw[r].z ^= 0x80808080u; raw[r].w ^= 0x80808080u;
        }
#pragma unroll
        for (int m = 0; m < M; m++) {
            if (M > 1 && m0 + m >= ntok) break;
            float xin[16];
            const float4* xp = (const float4*)(xm + m * ldx) + c * 4;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float4 v = __ldg(xp + i);
                xin[4 * i] = v.x; xin[4 * i + 1] = v.y; xin[4 * i + 2] = v.z; xin[4 * i + 3] = v.w;
            }
            if (MODE == 1) {
                const float4* wp = (const float4*)normw + c * 4;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float4 v = __ldg(wp + i);
                    xin[4 * i] *= v.x; xin[4 * i + 1] *= v.y; xin[4 * i + 2] *= v.z; xin[4 * i + 3] *= v.w;
                }
            } else if (MODE == 2) {
                const float4* up = (const float4*)(xm + m * ldx + K) + c * 4;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float4 u = __ldg(up + i);
                    float uu[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        float g = xin[4 * i + j];
                        xin[4 * i + j] = g / (1.0f + expf(-g)) * uu[j];
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                unsigned int words[4] = {raw[r].x, raw[r].y, raw[r].z, raw[r].w};
                float dot = 0.f;
#pragma unroll
                for (int w = 0; w < 4; w++)
#pragma unroll
                    for (int b = 0; b < 4; b++) dot = fmaf(byte_to_float(words[w], b), xin[4 * w + b], dot);
                acc[r][m] = fmaf(scale[r], dot, acc[r][m]);
            }
        }
    }

    if (MODE == 1) __syncthreads();   // partial[] is reused below
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int m = 0; m < M; m++) {
            float s = warp_sum(acc[r][m]);
            if (lane == 0) partial[warp][r * M + m] = s;
        }
    __syncthreads();
    for (int i = threadIdx.x; i < ROWS * M; i += GEMV_THREADS) {
        int r = i / M, m = i % M;
        int row = row0 + r;
        if (row >= N || m0 + m >= ntok) continue;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < GEMV_WARPS; w++) s += partial[w][i];
        if (MODE == 1) s *= inv_rms[m];
        long long at = (long long)(m0 + m) * ldy + row;
        if (res) s += res[at];
        y[at] = s;
    }
}

// rows per block: more rows keep more loads in flight; fewer leave registers for
// the M accumulators and x values of larger batches.
#define ROWS_FOR(M) ((M) == 1 ? 8 : ((M) <= 4 ? 4 : 2))

#define DEFINE_GEMV(M, MODE)                                                                   \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) q8_gemv_m##M##_mode##MODE(      \
            const int8* qs, const half_bits* scales, const float* x, int ldx,                  \
            const float* normw, float eps, float* y, int ldy, const float* res,                \
            int N, int K, int ntok) {                                                          \
        q8_gemv_body<M, ROWS_FOR(M), MODE>(qs, scales, x, ldx, normw, eps, y, ldy, res, N, K,  \
                                           ntok);                                              \
    }
#define DEFINE_GEMV_MODES(M) DEFINE_GEMV(M, 0) DEFINE_GEMV(M, 1) DEFINE_GEMV(M, 2)

DEFINE_GEMV_MODES(1)
DEFINE_GEMV_MODES(2)
DEFINE_GEMV_MODES(3)
DEFINE_GEMV_MODES(4)
DEFINE_GEMV_MODES(5)
DEFINE_GEMV_MODES(6)
DEFINE_GEMV_MODES(7)
DEFINE_GEMV_MODES(8)
