// Where a session's K and V rows live, for the KV append (qkv_rope.cu) and attention.cu.
// Include after common.cuh (half_bits, half_to_float).
//
// Contiguous (the split modes' caches): float32, position-major from one base per token,
//   kvbase[t] + ((p * n_layers + layer) * 2 + {0: k, 1: v}) * n_kv * D + head * D.
// Paged (gpu mode's pool): the session's block table is a row of device addresses,
//   tables[table_row[t] + p / block_size] = the block holding position p, laid out as
//   [block_size][n_layers][2][n_kv][D] of `E` (float, or half_bits for f16 KV), so inside a
//   block a position's row sits where the contiguous layout puts it.  The kernels read the
//   table from device memory: a captured graph keeps its addresses while the host rewrites
//   table contents between replays.
#pragma once

__device__ __forceinline__ float load_kv(const float* p) { return *p; }
__device__ __forceinline__ float load_kv(const half_bits* p) { return half_to_float(*p); }
__device__ __forceinline__ void store_kv(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_kv(half_bits* p, float v) {
    half_bits h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));   // round to nearest even, as numpy's astype
    *p = h;
}

// The K row of one (token, kv head) at position p; its V row is n_kv * D elements further.
struct ContiguousRows {
    typedef float Elem;
    const float* base;       // position 0's K row of this layer and head
    long long stride;        // elements between positions
    __device__ __forceinline__ const float* row(int p) const { return base + p * stride; }
};

template <typename E>
struct PagedRows {
    typedef E Elem;
    const unsigned long long* table;   // this session's block addresses
    long long offset;                  // layer and head within a position's row
    long long stride;                  // elements between positions
    int block_shift;                   // log2(block_size)
    __device__ __forceinline__ const E* row(int p) const {
        const E* block = reinterpret_cast<const E*>(table[p >> block_shift]);
        return block + (long long)(p & ((1 << block_shift) - 1)) * stride + offset;
    }
};

// The K (is_v false) or V row an append writes: token t's at position p, through its block-table row.
template <typename E>
struct PagedDst {
    typedef E Elem;
    const unsigned long long* tables; const long long* table_row; int layer, n_layers, n_kv, D, block_shift;
    __device__ __forceinline__ E* row(int t, int p, bool is_v, int kv_head) const {
        E* block = reinterpret_cast<E*>(tables[table_row[t] + (p >> block_shift)]);
        long long within = p & ((1 << block_shift) - 1);
        return block + ((within * n_layers + layer) * 2 + (is_v ? 1 : 0)) * n_kv * D + (long long)kv_head * D;
    }
};

// A token tree's mask for one query row (kestrel_stream/run/token_tree.py).  `tree` is null (no tree in
// the step) or int[4] per row: skip (slot - rotary position), span (slots ending at the row's own that the
// mask covers), bits lo, bits hi (bit j: slot lo + j is visible).  A plain row is (0, 0, 0, 0).  The
// row's slot is pos[t]: its KV is written there and it reads keys 0..pos[t], less the masked ones.
struct TreeRow {
    int lo;                        // the first slot the bits cover (pos + 1: none)
    unsigned long long bits;
    __device__ __forceinline__ bool sees(int key) const {
        return key < lo || ((bits >> (key - lo)) & 1ull);   // key - lo < span <= 64 for keys <= pos
    }
};

__device__ __forceinline__ TreeRow tree_row(const int* tree, int t, int p) {
    if (tree == nullptr) return TreeRow{p + 1, 0ull};
    const int4 f = reinterpret_cast<const int4*>(tree)[t];
    return TreeRow{p - f.y + 1, ((unsigned long long)(unsigned int)f.w << 32) | (unsigned int)f.z};
}

// The rotary position of row t at slot p
__device__ __forceinline__ int tree_rope_pos(const int* tree, int t, int p) {
    return tree == nullptr ? p : p - tree[4 * t];
}
