// Sampling after lm_head: temperature / top-k / top-p / min-p over one logits row, one block per
// row, the token id written to out[row] (4 bytes back per token, as a greedy step).  The numpy
// reference is kestrel_stream/text/sampling.py; both keep the logits at or above a cut (ties
// stay), so the cuts are found by radix selection on order-preserving keys, never by sorting:
//   top-k: the k-th largest key (four 8-bit digit passes counting elements);
//   top-p: among the top-k survivors, the key where the mass from the top first reaches p
//          (four passes summing softmax mass per digit);
//   min-p: logit >= max + log(min_p).
// The draw is an inverse CDF in token-id order at the temperature, with one uniform number
// from Philox4x32-10 (key = seed, counter = (step, 0, step >> 32, 0)), bit-identical to
// sampling.philox_uniform.  state[row]: 8 words {temperature, top_k, top_p, min_p (floats but
// top_k), seed lo, seed hi, step lo, step hi}; the kernel advances the step, so chained
// steps draw fresh numbers without a host upload.
#include "common.cuh"

__device__ __forceinline__ unsigned int order_key(float x) {
    const unsigned int b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float philox_uniform(unsigned int k0, unsigned int k1, unsigned int c0, unsigned int c2) {
    unsigned int c1 = 0u, c3 = 0u;
#pragma unroll
    for (int r = 0; r < 10; r++) {
        const unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        const unsigned int n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    return (float)(c0 >> 8) * (1.0f / 16777216.0f);
}

template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, T* scratch, Op op) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = scratch[0];
    for (int w = 1; w < warps; w++) v = op(v, scratch[w]);
    return v;
}

struct MaxOp { __device__ float operator()(float a, float b) const { return fmaxf(a, b); } };
struct AddOp { __device__ float operator()(float a, float b) const { return a + b; } };
struct MaxIntOp { __device__ int operator()(int a, int b) const { return a > b ? a : b; } };

// grid T (rows), block 1024
extern "C" __global__ void __launch_bounds__(1024) sample_rows(
        const float* __restrict__ logits, int V, unsigned int* __restrict__ state, int* __restrict__ out) {
    __shared__ float fscratch[32];
    __shared__ int iscratch[32];
    __shared__ unsigned int count_hist[256];
    __shared__ float mass_hist[256];
    __shared__ unsigned int cut_shared;
    __shared__ float need_shared;
    pdl_launch_dependents();
    pdl_wait();   // see common.cuh
    const float* row = logits + (long long)blockIdx.x * V;
    unsigned int* st = state + 8 * blockIdx.x;
    const float temperature = __uint_as_float(st[0]);
    const int top_k = (int)st[1];
    const float top_p = __uint_as_float(st[2]), min_p = __uint_as_float(st[3]);

    float vmax = -INFINITY;
    for (int i = threadIdx.x; i < V; i += blockDim.x) vmax = fmaxf(vmax, row[i]);
    vmax = block_reduce(vmax, fscratch, MaxOp());
    unsigned int cut = 0u;                           // keep keys >= cut

    if (top_k > 0 && top_k < V) {                    // the k-th largest key, digit by digit
        unsigned int prefix = 0u, mask = 0u, remaining = (unsigned int)top_k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = threadIdx.x; b < 256; b += blockDim.x) count_hist[b] = 0u;
            __syncthreads();
            for (int i = threadIdx.x; i < V; i += blockDim.x) {
                const unsigned int key = order_key(row[i]);
                if ((key & mask) == prefix) atomicAdd(&count_hist[(key >> shift) & 255u], 1u);
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                unsigned int above = 0u;
                int b = 255;
                for (; b > 0 && above + count_hist[b] < remaining; b--) above += count_hist[b];
                cut_shared = (unsigned int)b;
                need_shared = __uint_as_float(remaining - above);
            }
            __syncthreads();
            prefix |= cut_shared << shift;
            mask |= 255u << shift;
            remaining = __float_as_uint(need_shared);
            __syncthreads();
        }
        cut = prefix;
    }
    if (top_p < 1.0f) {                              // the key where the mass from the top reaches p
        float z = 0.f;
        for (int i = threadIdx.x; i < V; i += blockDim.x)
            if (order_key(row[i]) >= cut) z += expf(row[i] - vmax);
        z = block_reduce(z, fscratch, AddOp());
        float need = top_p * z;
        unsigned int prefix = 0u, mask = 0u;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = threadIdx.x; b < 256; b += blockDim.x) mass_hist[b] = 0.f;
            __syncthreads();
            for (int i = threadIdx.x; i < V; i += blockDim.x) {
                const unsigned int key = order_key(row[i]);
                if (key >= cut && (key & mask) == prefix) atomicAdd(&mass_hist[(key >> shift) & 255u], expf(row[i] - vmax));
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                float above = 0.f;
                int b = 255, last_nonzero = -1;
                for (; b >= 0; b--) {
                    if (mass_hist[b] > 0.f) last_nonzero = b;
                    if (mass_hist[b] > 0.f && above + mass_hist[b] >= need) break;
                    above += mass_hist[b];
                }
                if (b < 0) b = last_nonzero;             // rounding: the smallest digit that holds mass
                cut_shared = (unsigned int)b;
                need_shared = need - above;
            }
            __syncthreads();
            prefix |= cut_shared << shift;
            mask |= 255u << shift;
            need = need_shared;
            __syncthreads();
        }
        cut = max(cut, prefix);
    }
    if (min_p > 0.0f) cut = max(cut, order_key(vmax + logf(min_p)));

    // inverse CDF in id order: each thread owns a contiguous chunk; an exclusive scan of chunk sums
    const int chunk = (V + blockDim.x - 1) / blockDim.x;
    const int lo = threadIdx.x * chunk, hi = min(V, lo + chunk);
    const float inv_t = 1.0f / temperature;
    float mine = 0.f;
    int last_kept = -1;
    for (int i = lo; i < hi; i++)
        if (order_key(row[i]) >= cut) { mine += expf((row[i] - vmax) * inv_t); last_kept = i; }
    float incl = mine;                               // inclusive scan: warps, then warp totals
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const float v = __shfl_up_sync(0xffffffffu, incl, offset);
        if (lane >= offset) incl += v;
    }
    __syncthreads();
    if (lane == 31) fscratch[warp] = incl;
    __syncthreads();
    float warp_base = 0.f, total = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) {
        if (w < warp) warp_base += fscratch[w];
        total += fscratch[w];
    }
    const float excl = warp_base + incl - mine;
    const int fallback = block_reduce(last_kept, iscratch, MaxIntOp());
    const float u = philox_uniform(st[4], st[5], st[6], st[7]);
    const float target = u * total;
    if (threadIdx.x == 0) out[blockIdx.x] = fallback;   // target at the very end (rounding): the last kept
    __syncthreads();
    if (mine > 0.f && excl <= target && target < excl + mine) {
        float acc = excl;
        for (int i = lo; i < hi; i++) {
            if (order_key(row[i]) < cut) continue;
            acc += expf((row[i] - vmax) * inv_t);
            if (acc > target) { out[blockIdx.x] = i; break; }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {                          // the next chained step draws the next number
        const unsigned long long step = ((unsigned long long)st[7] << 32 | st[6]) + 1ull;
        st[6] = (unsigned int)step;
        st[7] = (unsigned int)(step >> 32);
    }
}
