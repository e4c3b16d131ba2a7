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

// (value, index) of the largest element, first index on ties (numpy argmax's rule), over a
// block: every thread passes its candidate, thread 0 gets the block's.  A thread with no
// candidate passes (-inf, INT_MAX).
__device__ __forceinline__ void argmax_merge(float& bv, int& bi, float ov, int oi) {
    if (ov > bv || (ov == bv && oi < bi) || (bi == 0x7fffffff && oi != 0x7fffffff)) { bv = ov; bi = oi; }
}

__device__ __forceinline__ void block_argmax(float& bv, int& bi) {
    __shared__ float best_val[32];
    __shared__ int best_idx[32];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        argmax_merge(bv, bi, __shfl_xor_sync(0xffffffffu, bv, offset), __shfl_xor_sync(0xffffffffu, bi, offset));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane == 0) { best_val[warp] = bv; best_idx[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        bv = lane < warps ? best_val[lane] : -INFINITY;
        bi = lane < warps ? best_idx[lane] : 0x7fffffff;
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1)
            argmax_merge(bv, bi, __shfl_xor_sync(0xffffffffu, bv, offset), __shfl_xor_sync(0xffffffffu, bi, offset));
    }
    __syncthreads();   // best_* may be reused by the caller's next call
}

// out[t] = argmax logits[t, 0:V]; grid T, block 1024 (one block per row)
extern "C" __global__ void __launch_bounds__(1024) argmax_rows(const float* __restrict__ logits, int V,
                                                               int* __restrict__ out) {
    pdl_launch_dependents();
    pdl_wait();   // see common.cuh
    const float* row = logits + (long long)blockIdx.x * V;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += blockDim.x) argmax_merge(bv, bi, row[i], i);   // ascending: ties keep the first
    block_argmax(bv, bi);
    if (threadIdx.x == 0) out[blockIdx.x] = bi;
}

// The same over grid (S, T): block s of row t scans a 1/S slice and leaves its (value, index)
// in part_val/part_idx [T, S]; the row's last block to finish (ticket in counters[t], reset
// by it) merges the S candidates.  The greedy decode step's only output: 4 bytes per token.
extern "C" __global__ void __launch_bounds__(256) argmax_split(
        const float* __restrict__ logits, int V, float* part_val, int* part_idx, unsigned int* counters,
        int* __restrict__ out) {
    __shared__ bool is_last;
    pdl_launch_dependents();
    pdl_wait();
    const int s = blockIdx.x, S = gridDim.x, t = blockIdx.y;
    const int per = (V + S - 1) / S, begin = s * per, end = min(begin + per, V);
    const float* row = logits + (long long)t * V;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = begin + threadIdx.x; i < end; i += blockDim.x) argmax_merge(bv, bi, row[i], i);
    block_argmax(bv, bi);
    if (threadIdx.x == 0) {
        part_val[t * S + s] = bv;
        part_idx[t * S + s] = bi;
        __threadfence();
        is_last = atomicAdd(counters + t, 1u) == (unsigned int)(S - 1);
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    bv = -INFINITY;
    bi = 0x7fffffff;
    for (int i = threadIdx.x; i < S; i += blockDim.x)
        argmax_merge(bv, bi, __ldcg(part_val + t * S + i), __ldcg(part_idx + t * S + i));
    block_argmax(bv, bi);
    if (threadIdx.x == 0) {
        out[t] = bi;
        counters[t] = 0u;
    }
}

// Chained greedy decoding: after a step's argmax, the next step's input in device memory.
// Row t's token becomes its next input id, its position advances, and the token is appended
// to history[step * ntok + t] (step: the device counter, advanced by thread 0).  Padded rows
// (kvbase == scratch_base, the scratch cache) stay at token 0, position 0.  grid 1, block 32.
extern "C" __global__ void __launch_bounds__(32) chain_advance(
        int* __restrict__ ids, int* __restrict__ pos, const long long* __restrict__ kvbase,
        const int* __restrict__ argmax_out, int* __restrict__ counter, int* __restrict__ history,
        long long scratch_base, int ntok) {
    pdl_launch_dependents();
    pdl_wait();
    const int step = *counter;
    for (int t = threadIdx.x; t < ntok; t += blockDim.x) {
        const int token = argmax_out[t];
        history[(long long)step * ntok + t] = token;
        if (kvbase[t] != scratch_base) {
            ids[t] = token;
            pos[t] += 1;
        }
    }
    __syncwarp();
    if (threadIdx.x == 0) *counter = step + 1;
}

// A small host-to-device copy made by the SMs: `src` is page-locked host memory (under unified addressing
// its host address is a device address), read over PCIe by the kernel, so the copy does not queue behind
// the copy engine's bulk transfers (mode offload streams weights on it while the step's activations go
// up).  n 32-bit words; grid-stride, block 256.
extern "C" __global__ void __launch_bounds__(256) copy_words(unsigned int* __restrict__ dst,
                                                             const unsigned int* __restrict__ src, int n) {
    pdl_launch_dependents();
    pdl_wait();   // see common.cuh: dst may still be read by an earlier kernel
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] = src[i];
}
