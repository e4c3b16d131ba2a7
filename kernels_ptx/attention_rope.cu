// Attention of a one-token step with the rope op as its prologue: the q/k norm, RoPE
// (+ Qwen2's qkv bias) and KV append of qkv_rope.cu run inside split-key attention
// (attention.cu), so a decode layer has no rope launch and no q round trip.
//
// grid (n_kv, T, splits) as attention_paged_d*: every split block of a (kv head,
// token) rotates its group's q heads (one warp per head, rope_head.cuh) into shared
// memory; the one block whose keys include the new position also rotates k and
// writes k and v into the cache, then reads keys as any other block, its own new
// row among them (a block's global writes are visible to its threads after
// __syncthreads; no other block reads that position).  Each token must be its
// session's only row in the step: a second row would attend to a key another
// block writes at the same time.  The host uses it for one-token steps
// (scheduler/ops.py fuse_rope).
#include "common.cuh"
#include "kv_cache.cuh"
#include "rope_head.cuh"
#include "attention_body.cuh"

template <int D, int G, typename E, int W>
__device__ __forceinline__ void attention_rope_body(
        const float* __restrict__ qkv, const unsigned long long* tables, const long long* table_row,
        const int* pos, const float* q_norm, const float* k_norm, const float* inv_freq, const float* bias,
        float eps, float* part_acc, float* part_max, float* part_sum, float* out, unsigned int* counters,
        int layer, int n_layers, int n_heads, int n_kv, int window, float softmax_scale, int block_shift,
        int min_keys) {
    __shared__ float q_rows[G * D];
    __shared__ float staged[W][D];
    const int head_kv = blockIdx.x, t = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = n_heads / n_kv, p = pos[t], per_lane = (D + 31) >> 5;
    const float* row = qkv + (long long)t * (n_heads + 2 * n_kv) * D;
    // the split whose keys hold position p, as attention_split_body cuts them
    const int first_key = window > 0 ? max(p - window + 1, 0) : 0;
    const int n_keys = p + 1 - first_key, per_split = keys_per_split(n_keys, splits, min_keys);
    if (split >= active_splits(n_keys, per_split)) return;   // a block without keys (attention_body.cuh)
    const int jobs = group + ((n_keys - 1) / per_split == split ? 2 : 0);   // q heads, then k and v
    const PagedDst<E> cache{tables, table_row, layer, n_layers, n_kv, D, block_shift};
    for (int j = warp; j < jobs; j += W) {
        const int head = j < group ? head_kv * group + j : n_heads + (j - group) * n_kv + head_kv;
        float v[ROPE_MAX_PER_LANE];
        load_head(row + (long long)head * D, bias ? bias + (long long)head * D : nullptr, D, lane, v);
        if (j <= group) norm_rope_head(v, j < group ? q_norm : k_norm, inv_freq, eps, p, D, staged[warp], lane);
        E* dst = j < group ? nullptr : cache.row(t, p, j > group, head_kv);
#pragma unroll
        for (int c = 0; c < ROPE_MAX_PER_LANE; c++) {
            if (c >= per_lane || lane + 32 * c >= D) continue;
            if (j < group) q_rows[j * D + lane + 32 * c] = v[c];
            else store_kv(dst + lane + 32 * c, v[c]);
        }
    }
    __syncthreads();   // q_rows complete; the appended K/V rows visible to this block's loads
    PagedRows<E> rows{tables + table_row[t], (long long)layer * 2 * n_kv * D + (long long)head_kv * D,
                      (long long)n_layers * 2 * n_kv * D, block_shift};
    attention_split_body<D, G, PagedRows<E>, W>(q_rows, rows, pos, part_acc, part_max, part_sum, out, counters,
                                                n_heads, n_kv, window, softmax_scale, min_keys);
}

#define DEFINE_ATTENTION_ROPE(D, SUFFIX, E, G, NAME_TAIL) DEFINE_ATTENTION_ROPE_W(D, SUFFIX, E, G, ATTN_WARPS, NAME_TAIL)
// W warps a block: ATTN_WIDE_WARPS for the _w8 kernels
#define DEFINE_ATTENTION_ROPE_W(D, SUFFIX, E, G, W, NAME_TAIL)                                  \
    extern "C" __global__ void __launch_bounds__(W * 32)                                       \
    attention_rope_paged_d##D##_##SUFFIX##NAME_TAIL(                                            \
            const float* qkv, const unsigned long long* tables, const long long* table_row,     \
            const int* pos, const float* q_norm, const float* k_norm, const float* inv_freq,    \
            const float* bias, float eps, float* part_acc, float* part_max, float* part_sum,    \
            float* out, unsigned int* counters, int layer, int n_layers, int n_heads, int n_kv, \
            int window, float softmax_scale, int block_shift, int min_keys) {                   \
        pdl_launch_dependents();                                                                \
        pdl_wait();   /* see common.cuh */                                                      \
        attention_rope_body<D, G, E, W>(qkv, tables, table_row, pos, q_norm, k_norm, inv_freq, bias,\
                                     eps, part_acc, part_max, part_sum, out, counters, layer,   \
                                     n_layers, n_heads, n_kv, window, softmax_scale, block_shift,\
                                     min_keys);                                                 \
    }
// kestrel_stream.cuda.kernels.ROPE_ATTENTION lists these: gpu mode's f16 pool, the common head dims,
// the _g2 ones for at most 2 q heads per kv head as attention.cu's
DEFINE_ATTENTION_ROPE(64, f16, half_bits, ATTN_MAX_GROUP, )
DEFINE_ATTENTION_ROPE(128, f16, half_bits, ATTN_MAX_GROUP, )
DEFINE_ATTENTION_ROPE(64, f16, half_bits, 2, _g2)
DEFINE_ATTENTION_ROPE(128, f16, half_bits, 2, _g2)
// the same with ATTN_WIDE_WARPS warps a block (kestrel_stream.cuda.kernels.ATTENTION_WARPS): a block takes
// twice the keys in one pass, so a short context needs fewer split blocks and merges
DEFINE_ATTENTION_ROPE_W(64, f16, half_bits, ATTN_MAX_GROUP, ATTN_WIDE_WARPS, _w8)
DEFINE_ATTENTION_ROPE_W(128, f16, half_bits, ATTN_MAX_GROUP, ATTN_WIDE_WARPS, _w8)
DEFINE_ATTENTION_ROPE_W(64, f16, half_bits, 2, ATTN_WIDE_WARPS, _g2_w8)
DEFINE_ATTENTION_ROPE_W(128, f16, half_bits, 2, ATTN_WIDE_WARPS, _g2_w8)
