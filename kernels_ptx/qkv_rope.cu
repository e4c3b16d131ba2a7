// After the fused QKV projection: Qwen2's q/k/v bias, Qwen3's per-head q/k
// RMSNorm, RoPE (HF rotate_half convention) and the KV-cache append, in one launch.
// grid (n_heads + 2 * n_kv, T), one warp per head (rope_head.cuh): blockIdx.x <
// n_heads is a q head, then k heads, then v heads (biased, otherwise copied as
// they are).  Every rope scaling type is the host's inverse-frequency table.
// The KV destination (kv_cache.cuh): a contiguous float32 cache
// (qkv_norm_rope_append) or gpu mode's paged pool in f16 or float32
// (qkv_rope_append_paged_f16 / _f32); one body serves all three.  One-token
// steps of gpu mode run this op as attention's prologue instead (attention_rope.cu).
#include "common.cuh"
#include "kv_cache.cuh"
#include "rope_head.cuh"

// The K or V row of token t at position p: contiguous, float32
struct ContiguousDst {
    typedef float Elem;
    float* kvpool; const long long* kvbase; int layer, n_layers, n_kv, D;
    __device__ __forceinline__ float* row(int t, int p, bool is_v, int kv_head) const {
        return kvpool + kvbase[t] + (((long long)p * n_layers + layer) * 2 + (is_v ? 1 : 0)) * n_kv * D
               + (long long)kv_head * D;
    }
};

template <typename Dst>
__device__ __forceinline__ void qkv_norm_rope_append_body(
        const float* __restrict__ qkv,        // [T, (n_heads + 2 n_kv) * D]
        float* __restrict__ q_out,            // [T, n_heads * D]
        const Dst cache,
        const int* __restrict__ pos,          // [T]
        const float* __restrict__ q_norm,     // [D] or null (Llama)
        const float* __restrict__ k_norm,     // [D] or null
        const float* __restrict__ inv_freq,   // [D/2], computed on the host as the reference does
        const float* __restrict__ bias,       // [(n_heads + 2 n_kv) * D] or null (all but Qwen2)
        float eps, int n_heads, int n_kv, int D,
        const int* __restrict__ tree = nullptr) {   // a token tree's rows: rotary position = pos - skip

    pdl_launch_dependents();
    pdl_wait();   // see common.cuh
    const int head = blockIdx.x, t = blockIdx.y, lane = threadIdx.x;
    const int per_lane = (D + 31) >> 5;
    __shared__ float staged[ROPE_MAX_D];
    const int width = (n_heads + 2 * n_kv) * D;
    const int p = pos[t];
    const bool is_q = head < n_heads, is_v = head >= n_heads + n_kv;

    float v[ROPE_MAX_PER_LANE];
    load_head(qkv + (long long)t * width + (long long)head * D, bias ? bias + head * D : nullptr, D, lane, v);
    float* q_dst = is_q ? q_out + (long long)t * n_heads * D + (long long)head * D : nullptr;
    typename Dst::Elem* kv_dst = is_q ? nullptr : cache.row(t, p, is_v, is_v ? head - n_heads - n_kv : head - n_heads);
    if (!is_v) norm_rope_head(v, is_q ? q_norm : k_norm, inv_freq, eps, tree_rope_pos(tree, t, p), D, staged, lane);
#pragma unroll
    for (int c = 0; c < ROPE_MAX_PER_LANE; c++) {
        if (c >= per_lane || lane + 32 * c >= D) continue;
        if (is_q) q_dst[lane + 32 * c] = v[c];
        else store_kv(kv_dst + lane + 32 * c, v[c]);
    }
}

extern "C" __global__ void __launch_bounds__(32) qkv_norm_rope_append(
        const float* qkv, float* q_out, float* kvpool, const long long* kvbase, const int* pos,
        const float* q_norm, const float* k_norm, const float* inv_freq, const float* bias, float eps,
        int layer, int n_layers, int n_heads, int n_kv, int D) {
    qkv_norm_rope_append_body(qkv, q_out, ContiguousDst{kvpool, kvbase, layer, n_layers, n_kv, D}, pos,
                              q_norm, k_norm, inv_freq, bias, eps, n_heads, n_kv, D);
}

// tables / table_row: see kv_cache.cuh; tree: a token tree's rows (TreeRow there), or null
#define DEFINE_PAGED_APPEND(SUFFIX, E)                                                              \
    extern "C" __global__ void __launch_bounds__(32) qkv_rope_append_paged_##SUFFIX(              \
            const float* qkv, float* q_out, const unsigned long long* tables, const long long* table_row,\
            const int* pos, const float* q_norm, const float* k_norm, const float* inv_freq,        \
            const float* bias, float eps, int layer, int n_layers, int n_heads, int n_kv, int D,    \
            int block_shift, const int* tree) {                                                     \
        qkv_norm_rope_append_body(qkv, q_out,                                                       \
                                  PagedDst<E>{tables, table_row, layer, n_layers, n_kv, D, block_shift},\
                                  pos, q_norm, k_norm, inv_freq, bias, eps, n_heads, n_kv, D, tree);\
    }
DEFINE_PAGED_APPEND(f16, half_bits)
DEFINE_PAGED_APPEND(f32, float)
