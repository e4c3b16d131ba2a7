// Step entry and exit: the Q8_0 embedding lookup and the argmax over logits.
#include "common.cuh"

// out[t, :] = dequant(embed[ids[t], :]), xn[t, :] = out[t, :] * normw (the first layer's norm
// weight) and inv_rms[t] = 1/sqrt(mean(out[t]^2) + eps): the residual stream plus what the
// first GEMV needs to apply RMSNorm in its epilogue; grid T, block 256
extern "C" __global__ void __launch_bounds__(256) embed_q8(
        const int8* __restrict__ qs, const half_bits* __restrict__ scales, const int* __restrict__ ids,
        float* __restrict__ out, float* __restrict__ xn, const float* __restrict__ normw,
        float* __restrict__ inv_rms, float eps, int H) {
    __shared__ float warp_sums[8];
    pdl_launch_dependents();
    pdl_wait();   // see common.cuh
    const int t = blockIdx.x;
    const long long row = ids[t];
    float sq = 0.f;
    for (int k = threadIdx.x; k < H; k += blockDim.x) {
        float v = (float)qs[row * H + k] * half_to_float(scales[row * (H >> 5) + (k >> 5)]);
        out[(long long)t * H + k] = v;
        xn[(long long)t * H + k] = v * normw[k];
        sq += v * v;
    }
    sq = warp_sum(sq);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sq;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) total += warp_sums[w];
        inv_rms[t] = 1.0f / sqrtf(total / (float)H + eps);
    }
}

// out[t] = first index of the largest logits[t, :] (numpy argmax's tie rule);
// grid T, block 1024
extern "C" __global__ void __launch_bounds__(1024) argmax_rows(const float* __restrict__ logits, int V,
                                                               int* __restrict__ out) {
    __shared__ float best_val[32];
    __shared__ int best_idx[32];
    pdl_launch_dependents();
    pdl_wait();   // see common.cuh
    const float* row = logits + (long long)blockIdx.x * V;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        float v = row[i];
        if (v > bv) { bv = v; bi = i; }   // strided ascending: first hit wins ties
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, offset);
        int oi = __shfl_xor_sync(0xffffffffu, bi, offset);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { best_val[warp] = bv; best_idx[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        int warps = blockDim.x >> 5;
        bv = lane < warps ? best_val[lane] : -INFINITY;
        bi = lane < warps ? best_idx[lane] : 0x7fffffff;
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, offset);
            int oi = __shfl_xor_sync(0xffffffffu, bi, offset);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) out[blockIdx.x] = bi;
    }
}
