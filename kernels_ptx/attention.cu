// Attention over a session's KV cache, for decode and prefill alike, split over
// the keys (flash-decoding): decode has only n_kv * T (kv head, token) pairs, far
// too few blocks for the GPU, so each pair's keys 0..pos[t] are cut into
// `splits` contiguous ranges, one block each.  A block's 4 warps take keys in
// turn (several per iteration, so their loads overlap), keep an online softmax per q head
// of the GQA group (which shares every k/v load), merge through shared memory
// and write an unnormalised partial.  Only the first ceil(keys / keys per split)
// blocks hold keys; the others exit at launch.  The last of those to finish (atomic
// ticket, reset by that block for the next launch or graph replay) merges their
// partials in a fixed order: no second launch.
//
// A sliding window (window > 0) starts each query's keys at pos - window + 1.
// Head dims that are not a multiple of 32 (80) leave the top lanes of the last
// chunk idle (zeros in q and k, nothing stored).
//
// Where the keys are (kv_cache.cuh): the split modes' contiguous float32 caches
// (attention_split_d*), or gpu mode's paged pool in f16 or float32
// (attention_paged_d*_f16 / _f32); one body serves both.
#include "common.cuh"
#include "kv_cache.cuh"
#include "attention_body.cuh"

#define DEFINE_ATTENTION(D)                                                                     \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) attention_split_d##D(         \
            const float* q, const float* kvpool, const long long* kvbase, const int* pos,       \
            float* part_acc, float* part_max, float* part_sum, float* out, unsigned int* counters,\
            int layer, int n_layers, int n_heads, int n_kv, int window, float softmax_scale,    \
            int min_keys) {                                                                     \
        pdl_launch_dependents();                                                                \
        pdl_wait();   /* see common.cuh */                                                      \
        const long long stride = (long long)n_layers * 2 * n_kv * D;                            \
        ContiguousRows rows{kvpool + kvbase[blockIdx.y] + (long long)layer * 2 * n_kv * D       \
                            + (long long)blockIdx.x * D, stride};                               \
        attention_split_body<D, ATTN_MAX_GROUP>(q + group_q_offset(n_heads, n_kv, D), rows, pos,     \
                                                part_acc, part_max, part_sum, out, counters,    \
                                                n_heads, n_kv, window, softmax_scale, min_keys);\
    }
// every head dim of kestrel_stream.cuda.kernels.ATTENTION_HEAD_DIMS: the common models' (each one
// more costs NVRTC ~3 s per architecture; the template serves any D <= 256 that is a multiple of 16)
DEFINE_ATTENTION(32)
DEFINE_ATTENTION(64)
DEFINE_ATTENTION(80)
DEFINE_ATTENTION(96)
DEFINE_ATTENTION(128)
DEFINE_ATTENTION(256)

// tables: every session's block-address row; table_row[t]: where token t's session's row starts;
// tree: a token tree's masks per row, or null (kv_cache.cuh TreeRow)
#define DEFINE_PAGED_ATTENTION(D, SUFFIX, E) DEFINE_PAGED_ATTENTION_G(D, SUFFIX, E, ATTN_MAX_GROUP, )
// G: the most q heads per kv head the kernel serves (its registers hold q and the sums of G heads)
#define DEFINE_PAGED_ATTENTION_G(D, SUFFIX, E, G, NAME_TAIL)                                     \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) attention_paged_d##D##_##SUFFIX##NAME_TAIL(\
            const float* q, const unsigned long long* tables, const long long* table_row,       \
            const int* pos, float* part_acc, float* part_max, float* part_sum, float* out,      \
            unsigned int* counters, int layer, int n_layers, int n_heads, int n_kv, int window, \
            float softmax_scale, int block_shift, int min_keys, const int* tree) {              \
        pdl_launch_dependents();                                                                \
        pdl_wait();   /* see common.cuh */                                                      \
        PagedRows<E> rows{tables + table_row[blockIdx.y],                                       \
                          (long long)layer * 2 * n_kv * D + (long long)blockIdx.x * D,          \
                          (long long)n_layers * 2 * n_kv * D, block_shift};                     \
        attention_split_body<D, G>(q + group_q_offset(n_heads, n_kv, D), rows, pos, part_acc,    \
                                   part_max, part_sum, out, counters, n_heads, n_kv, window,    \
                                   softmax_scale, min_keys, tree);                              \
    }
// the same head dims as attention_split_d*, for each KV dtype
#define DEFINE_PAGED_ATTENTION_DTYPE(SUFFIX, E)                                                 \
    DEFINE_PAGED_ATTENTION(32, SUFFIX, E)                                                       \
    DEFINE_PAGED_ATTENTION(64, SUFFIX, E)                                                       \
    DEFINE_PAGED_ATTENTION(80, SUFFIX, E)                                                       \
    DEFINE_PAGED_ATTENTION(96, SUFFIX, E)                                                       \
    DEFINE_PAGED_ATTENTION(128, SUFFIX, E)                                                      \
    DEFINE_PAGED_ATTENTION(256, SUFFIX, E)
DEFINE_PAGED_ATTENTION_DTYPE(f16, half_bits)
DEFINE_PAGED_ATTENTION_DTYPE(f32, float)
// Groups of at most 2 q heads per kv head (Qwen3-1.7B: 16 / 8) in gpu mode's f16 pool: a quarter of
// the registers for q and the sums, so more blocks per SM and 8 keys in flight per warp
// (kestrel_stream.cuda.kernels.SMALL_GROUP_ATTENTION lists these)
DEFINE_PAGED_ATTENTION_G(64, f16, half_bits, 2, _g2)   // one line per SMALL_GROUP_ATTENTION entry
DEFINE_PAGED_ATTENTION_G(128, f16, half_bits, 2, _g2)
