// One head of the rope op, on one warp (qkv_rope.cu, attention_rope.cu): lane holds elements
// lane + 32c (i < D) of the head, for any even D <= 256; the rotate_half partner (i +- D/2) is
// read back through shared memory, since it lies in another lane unless D % 64 == 0.  Include
// after common.cuh.
#pragma once

#define ROPE_MAX_PER_LANE 8   // head_dim <= 256
#define ROPE_MAX_D 256

// The head's elements from its qkv row (+ its bias, or none), zeros past D.
__device__ __forceinline__ void load_head(const float* src, const float* bias, int D, int lane,
                                          float (&v)[ROPE_MAX_PER_LANE]) {
    const int per_lane = (D + 31) >> 5;
#pragma unroll
    for (int c = 0; c < ROPE_MAX_PER_LANE; c++) {
        int i = lane + 32 * c;
        v[c] = c < per_lane && i < D ? src[i] + (bias ? bias[i] : 0.f) : 0.f;
    }
}

// Qwen3's per-head RMSNorm (norm_w null: none, Llama) and RoPE (HF rotate_half) at position p, in
// place; inv_freq [D/2] is the host's table (every rope scaling type); staged: D (<= ROPE_MAX_D) floats
// of this warp's shared memory.
__device__ __forceinline__ void norm_rope_head(float (&v)[ROPE_MAX_PER_LANE], const float* norm_w,
                                               const float* inv_freq, float eps, int p, int D,
                                               float* staged, int lane) {
    const int per_lane = (D + 31) >> 5, half = D >> 1;
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
    __syncwarp();   // staged may be written again by this warp's next head
}
