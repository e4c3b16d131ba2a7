// Q8_0 matrix-matrix product for prefill (more than 8 tokens), with the same
// contract as q8_gemv.cu (inv_rms_in scaling, SiLU·mul row pairs, residual, xn
// and last-block inv_rms epilogues):
//   y[m, n] = sum_k W[n, k] * x[m, k]  (...)
// A block computes a 64-row x 64-token tile; per 32-wide K step (one Q8_0
// block) it dequantises the weight tile and transforms the x tile into shared
// memory once, then each of 256 threads accumulates a 4x4 sub-tile in fp32
// (4 consecutive rows: gate/up pairs stay in one thread).
// Dequantise-then-multiply is also what the numpy reference does.
#include "common.cuh"

#define MM_TILE 64
#define MM_K 32
#define MM_THREADS 256

__device__ __forceinline__ float silu_mul(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

template <bool SILU_PAIRS>
__device__ __forceinline__ void q8_matmul_body(
        const int8* __restrict__ qs, const half_bits* __restrict__ scales, const float* x, int ldx,
        const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out, float* xn_out,
        float* inv_rms_out, unsigned int* counter, float eps, int N, int K, int ntok) {
    __shared__ float w_tile[MM_K][MM_TILE + 4];   // [k][row]; +4 keeps float4 rows aligned, banks spread
    __shared__ float x_tile[MM_K][MM_TILE + 4];   // [k][token]
    __shared__ bool is_last_block;
    pdl_launch_dependents();
    pdl_wait();   // see common.cuh
    const int row0 = blockIdx.x * MM_TILE, tok0 = blockIdx.y * MM_TILE;
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const int load_row = threadIdx.x >> 2, load_k = (threadIdx.x & 3) * 8;   // 8 elements per thread
    float acc[4][4] = {};

    for (int k0 = 0; k0 < K; k0 += MM_K) {
        {   // weight tile: 64 rows x 32 int8, one fp16 scale per row
            int row = min(row0 + load_row, N - 1);
            const int8* src = qs + (long long)row * K + k0 + load_k;
            uint2 raw = *(const uint2*)src;
            float scale = half_to_float(scales[(long long)row * (K >> 5) + (k0 >> 5)]);
            unsigned int words[2] = {raw.x ^ 0x80808080u, raw.y ^ 0x80808080u};
#pragma unroll
            for (int i = 0; i < 8; i++)
                w_tile[load_k + i][load_row] = byte_to_float(words[i >> 2], i & 3) * scale;
        }
        {   // x tile: 64 tokens x 32 values
            int tok = tok0 + load_row;
            float v[8];
            if (tok < ntok) {
                const float* src = x + (long long)tok * ldx + k0 + load_k;
#pragma unroll
                for (int i = 0; i < 8; i++) v[i] = src[i];
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++) v[i] = 0.f;
            }
#pragma unroll
            for (int i = 0; i < 8; i++) x_tile[load_k + i][load_row] = v[i];
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < MM_K; kk++) {
            float4 a = *(const float4*)&w_tile[kk][ty * 4];
            float4 b = *(const float4*)&x_tile[kk][tx * 4];
            float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
    }

#pragma unroll
    for (int j = 0; j < 4; j++) {
        int tok = tok0 + tx * 4 + j;
        if (tok >= ntok) continue;
        float scale = inv_rms_in ? inv_rms_in[tok] : 1.0f;
#pragma unroll
        for (int i = 0; i < (SILU_PAIRS ? 2 : 4); i++) {
            int row = row0 + ty * 4 + (SILU_PAIRS ? 2 * i : i);
            if (row >= N) continue;
            int col = SILU_PAIRS ? row / 2 : row;
            long long at = (long long)tok * ldy + col;
            float s = SILU_PAIRS ? silu_mul(acc[2 * i][j] * scale, acc[2 * i + 1][j] * scale) : acc[i][j] * scale;
            if (res) s += res[at];
            y[at] = s;
            if (xn_out) xn_out[at] = s * normw_out[col];
        }
    }
    if (inv_rms_out == nullptr) return;

    __threadfence();   // this block's y is visible device-wide before its ticket is
    __syncthreads();
    if (threadIdx.x == 0) is_last_block = atomicAdd(counter, 1u) == gridDim.x * gridDim.y - 1;
    __syncthreads();
    if (!is_last_block) return;
    __threadfence();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int m = warp; m < ntok; m += MM_THREADS / 32) {
        const float* row = y + (long long)m * ldy;
        float sq = 0.f;
        for (int k = lane; k < N; k += 32) { float v = __ldcg(row + k); sq += v * v; }
        sq = warp_sum(sq);
        if (lane == 0) inv_rms_out[m] = 1.0f / sqrtf(sq / (float)N + eps);
    }
    if (threadIdx.x == 0) *counter = 0u;
}

#define DEFINE_MATMUL(SILU, NAME)                                                                \
    extern "C" __global__ void __launch_bounds__(MM_THREADS) NAME(                               \
            const int8* qs, const half_bits* scales, const float* x, int ldx,                    \
            const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out,\
            float* xn_out, float* inv_rms_out, unsigned int* counter, float eps, int N, int K,   \
            int ntok) {                                                                          \
        q8_matmul_body<SILU>(qs, scales, x, ldx, inv_rms_in, y, ldy, res, normw_out, xn_out,     \
                             inv_rms_out, counter, eps, N, K, ntok);                             \
    }
DEFINE_MATMUL(false, q8_matmul)
DEFINE_MATMUL(true, q8_matmul_silu)
