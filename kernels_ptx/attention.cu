// Attention over a session's KV cache, for decode and prefill alike: one block per
// (kv head, query token); the block's warps split the keys 0..pos[t] and keep an
// online softmax each, then merge through shared memory.  The GQA group's q heads
// share every k/v load.
//
// KV pool layout (float32, element offsets from the pool base):
//   kvbase[t] + ((p * n_layers + layer) * 2 + {0: k, 1: v}) * n_kv * D + head * D
// so the layout needs no per-session capacity and one base per token finds it.
#include "common.cuh"

#define ATTN_WARPS 4
#define ATTN_MAX_GROUP_D 2048   // group * head_dim (checked on the host)
#define ATTN_MAX_GROUP 8

// PER_LANE = head_dim / 32, a template constant so q, acc stay in registers
template <int ATTN_MAX_PER_LANE>
__device__ __forceinline__ void attention_body(
        const float* __restrict__ q,          // [T, n_heads * D]
        const float* __restrict__ kvpool,
        const long long* __restrict__ kvbase, // [T]
        const int* __restrict__ pos,          // [T]
        float* __restrict__ out,              // [T, n_heads * D]
        int layer, int n_layers, int n_heads, int n_kv, int D, float softmax_scale) {
    __shared__ float merge_acc[ATTN_WARPS][ATTN_MAX_GROUP_D];
    __shared__ float merge_max[ATTN_WARPS][32], merge_sum[ATTN_WARPS][32];
    const int head_kv = blockIdx.x, t = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = n_heads / n_kv, per_lane = ATTN_MAX_PER_LANE;
    const int last = pos[t];
    const long long stride_pos = (long long)n_layers * 2 * n_kv * D;
    const float* kbase = kvpool + kvbase[t] + (long long)layer * 2 * n_kv * D + (long long)head_kv * D;
    const float* vbase = kbase + (long long)n_kv * D;

    // q of the group's heads, pre-scaled so the dot product is the score
    float qr[ATTN_MAX_GROUP][ATTN_MAX_PER_LANE], acc[ATTN_MAX_GROUP][ATTN_MAX_PER_LANE];
    float run_max[ATTN_MAX_GROUP], run_sum[ATTN_MAX_GROUP];
    const float* qt = q + (long long)t * n_heads * D + (long long)head_kv * group * D;
#pragma unroll
    for (int g = 0; g < ATTN_MAX_GROUP; g++) {
        run_max[g] = -INFINITY; run_sum[g] = 0.f;
#pragma unroll
        for (int c = 0; c < ATTN_MAX_PER_LANE; c++) {
            acc[g][c] = 0.f;
            qr[g][c] = (g < group && c < per_lane) ? qt[g * D + lane + 32 * c] * softmax_scale : 0.f;
        }
    }

    for (int p = warp; p <= last; p += ATTN_WARPS) {
        const float* kp = kbase + p * stride_pos;
        const float* vp = vbase + p * stride_pos;
        float kr[ATTN_MAX_PER_LANE], vr[ATTN_MAX_PER_LANE];
#pragma unroll
        for (int c = 0; c < ATTN_MAX_PER_LANE; c++) {
            kr[c] = c < per_lane ? kp[lane + 32 * c] : 0.f;
            vr[c] = c < per_lane ? vp[lane + 32 * c] : 0.f;
        }
#pragma unroll
        for (int g = 0; g < ATTN_MAX_GROUP; g++) {
            if (g >= group) break;
            float s = 0.f;
#pragma unroll
            for (int c = 0; c < ATTN_MAX_PER_LANE; c++) s = fmaf(qr[g][c], kr[c], s);
            s = warp_sum(s);
            float new_max = fmaxf(run_max[g], s);
            float correction = expf(run_max[g] - new_max);
            float weight = expf(s - new_max);
            run_sum[g] = run_sum[g] * correction + weight;
#pragma unroll
            for (int c = 0; c < ATTN_MAX_PER_LANE; c++) acc[g][c] = fmaf(acc[g][c], correction, weight * vr[c]);
            run_max[g] = new_max;
        }
    }

#pragma unroll
    for (int g = 0; g < ATTN_MAX_GROUP; g++) {
        if (g >= group) break;
        if (lane == 0) { merge_max[warp][g] = run_max[g]; merge_sum[warp][g] = run_sum[g]; }
#pragma unroll
        for (int c = 0; c < ATTN_MAX_PER_LANE; c++)
            if (c < per_lane) merge_acc[warp][g * D + lane + 32 * c] = acc[g][c];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < group * D; i += ATTN_WARPS * 32) {
        int g = i / D;
        float total_max = -INFINITY;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; w++) total_max = fmaxf(total_max, merge_max[w][g]);
        float num = 0.f, den = 0.f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; w++) {
            // a warp that saw no key has max -inf and contributes nothing
            float f = merge_max[w][g] == -INFINITY ? 0.f : expf(merge_max[w][g] - total_max);
            num += merge_acc[w][i] * f;
            den += merge_sum[w][g] * f;
        }
        out[(long long)t * n_heads * D + (long long)head_kv * group * D + i] = num / den;
    }
}

#define DEFINE_ATTENTION(D)                                                                     \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) attention_gqa_d##D(           \
            const float* q, const float* kvpool, const long long* kvbase, const int* pos,       \
            float* out, int layer, int n_layers, int n_heads, int n_kv, int head_dim,           \
            float softmax_scale) {                                                              \
        attention_body<D / 32>(q, kvpool, kvbase, pos, out, layer, n_layers, n_heads, n_kv,     \
                               head_dim, softmax_scale);                                        \
    }
DEFINE_ATTENTION(64)
DEFINE_ATTENTION(128)
DEFINE_ATTENTION(256)
