// After the fused QKV projection: Qwen2's q/k/v bias, Qwen3's per-head q/k
// RMSNorm, RoPE (HF rotate_half convention) and the KV-cache append, in one launch.
// grid (n_heads + 2 * n_kv, T), one warp per head: blockIdx.x < n_heads is a q
// head, then k heads, then v heads (biased, otherwise copied as they are).  Lane
// holds elements lane + 32c (i < D), for any even D <= 256; the rotate_half
// partner (i +- D/2) is read back through shared memory, since it lies in
// another lane unless D % 64 == 0.  Every rope scaling type is the host's
// inverse-frequency table.
#include "common.cuh"

#define ROPE_MAX_PER_LANE 8   // head_dim <= 256
#define ROPE_MAX_D 256

extern "C" __global__ void __launch_bounds__(32) qkv_norm_rope_append(
        const float* __restrict__ qkv,        // [T, (n_heads + 2 n_kv) * D]
        float* __restrict__ q_out,            // [T, n_heads * D]
        float* __restrict__ kvpool,
        const long long* __restrict__ kvbase, // [T]
        const int* __restrict__ pos,          // [T]
        const float* __restrict__ q_norm,     // [D] or null (Llama)
        const float* __restrict__ k_norm,     // [D] or null
        const float* __restrict__ inv_freq,   // [D/2], computed on the host as the reference does
        const float* __restrict__ bias,       // [(n_heads + 2 n_kv) * D] or null (all but Qwen2)
        float eps, int layer, int n_layers, int n_heads, int n_kv, int D) {
    pdl_launch_dependents();
    pdl_wait();   // see common.cuh
    const int head = blockIdx.x, t = blockIdx.y, lane = threadIdx.x;
    const int per_lane = (D + 31) >> 5, half = D >> 1;
    __shared__ float staged[ROPE_MAX_D];
    const int width = (n_heads + 2 * n_kv) * D;
    const float* src = qkv + (long long)t * width + (long long)head * D;
    const int p = pos[t];
    const bool is_q = head < n_heads, is_v = head >= n_heads + n_kv;

    float v[ROPE_MAX_PER_LANE];
#pragma unroll
    for (int c = 0; c < ROPE_MAX_PER_LANE; c++) {
        int i = lane + 32 * c;
        v[c] = c < per_lane && i < D ? src[i] + (bias ? bias[head * D + i] : 0.f) : 0.f;
    }

    float* dst;
    if (is_q) {
        dst = q_out + (long long)t * n_heads * D + (long long)head * D;
    } else {
        int kv_head = is_v ? head - n_heads - n_kv : head - n_heads;
        dst = kvpool + kvbase[t] + (((long long)p * n_layers + layer) * 2 + (is_v ? 1 : 0)) * n_kv * D
              + (long long)kv_head * D;
    }
    if (!is_v) {
        const float* norm_w = is_q ? q_norm : k_norm;
        if (norm_w) {
            float sq = 0.f;
#pragma unroll
            for (int c = 0; c < ROPE_MAX_PER_LANE; c++) sq += v[c] * v[c];
            float inv = 1.0f / sqrtf(warp_sum(sq) / (float)D + eps);
#pragma unroll
            for (int c = 0; c < ROPE_MAX_PER_LANE; c++)
                if (c < per_lane && lane + 32 * c < D) v[c] = v[c] * inv * norm_w[lane + 32 * c];
        }
#pragma unroll
        for (int c = 0; c < ROPE_MAX_PER_LANE; c++)
            if (c < per_lane && lane + 32 * c < D) staged[lane + 32 * c] = v[c];
        __syncwarp();
#pragma unroll
        for (int c = 0; c < ROPE_MAX_PER_LANE; c++) {
            int i = lane + 32 * c;
            if (c >= per_lane || i >= D) continue;
            int freq_index = i < half ? i : i - half;
            float angle = (float)p * inv_freq[freq_index];
            float partner = i < half ? -staged[i + half] : staged[i - half];
            v[c] = v[c] * cosf(angle) + partner * sinf(angle);
        }
    }
#pragma unroll
    for (int c = 0; c < ROPE_MAX_PER_LANE; c++)
        if (c < per_lane && lane + 32 * c < D) dst[lane + 32 * c] = v[c];
}
