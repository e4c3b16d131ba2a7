// After the fused QKV projection: Qwen3's per-head q/k RMSNorm, RoPE (HF
// rotate_half convention) and the KV-cache append, in one launch.
// grid (n_heads + 2 * n_kv, T), one warp per head: blockIdx.x < n_heads is a q
// head, then k heads, then v heads (copied as they are).  Lane holds elements
// lane + 32c, so with D % 64 == 0 the rotate_half partner (i +- D/2) is in the
// same lane: no shuffles for RoPE.
#include "common.cuh"

#define ROPE_MAX_PER_LANE 8   // head_dim <= 256

extern "C" __global__ void __launch_bounds__(32) qkv_norm_rope_append(
        const float* __restrict__ qkv,        // [T, (n_heads + 2 n_kv) * D]
        float* __restrict__ q_out,            // [T, n_heads * D]
        float* __restrict__ kvpool,
        const long long* __restrict__ kvbase, // [T]
        const int* __restrict__ pos,          // [T]
        const float* __restrict__ q_norm,     // [D] or null (Llama)
        const float* __restrict__ k_norm,     // [D] or null
        const float* __restrict__ inv_freq,   // [D/2], computed on the host as the reference does
        float eps, int layer, int n_layers, int n_heads, int n_kv, int D) {
    pdl_launch_dependents();
    pdl_wait();   // see common.cuh
    const int head = blockIdx.x, t = blockIdx.y, lane = threadIdx.x;
    const int per_lane = D >> 5, half_lanes = per_lane >> 1;
    const int width = (n_heads + 2 * n_kv) * D;
    const float* src = qkv + (long long)t * width + (long long)head * D;
    const int p = pos[t];
    const bool is_q = head < n_heads, is_v = head >= n_heads + n_kv;

    float v[ROPE_MAX_PER_LANE];
#pragma unroll
    for (int c = 0; c < ROPE_MAX_PER_LANE; c++) v[c] = c < per_lane ? src[lane + 32 * c] : 0.f;

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
                if (c < per_lane) v[c] = v[c] * inv * norm_w[lane + 32 * c];
        }
        float rotated[ROPE_MAX_PER_LANE];
#pragma unroll
        for (int c = 0; c < ROPE_MAX_PER_LANE; c++) {
            if (c >= per_lane) { rotated[c] = 0.f; continue; }
            int i = lane + 32 * c, freq_index = i % (D >> 1);
            float angle = (float)p * inv_freq[freq_index];
            float partner = c < half_lanes ? -v[c + half_lanes] : v[c - half_lanes];
            rotated[c] = v[c] * cosf(angle) + partner * sinf(angle);
        }
#pragma unroll
        for (int c = 0; c < ROPE_MAX_PER_LANE; c++) v[c] = rotated[c];
    }
#pragma unroll
    for (int c = 0; c < ROPE_MAX_PER_LANE; c++)
        if (c < per_lane) dst[lane + 32 * c] = v[c];
}
