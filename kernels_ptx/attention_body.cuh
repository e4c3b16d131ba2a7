// Split-key attention's shared body (attention.cu, attention_rope.cu): the lanes' K/V row loads
// and one block's keys of one (kv head, token), merged by the last split block.  Include after
// common.cuh and kv_cache.cuh.
#pragma once

#define ATTN_WARPS 4
#define ATTN_WIDE_WARPS 8       // attention_rope.cu's _w8 kernels (D <= 128: merge_acc stays in 48 KB)
#define ATTN_MAX_GROUP 8
#define ATTN_MAX_GROUP_D 2048   // group * head_dim (checked on the host)
#define ATTN_MAX_SPLITS 32

// Where block (kv head blockIdx.x, token blockIdx.y)'s q rows start in a [T, n_heads, D] q buffer.
__device__ __forceinline__ long long group_q_offset(int n_heads, int n_kv, int D) {
    return (long long)blockIdx.y * n_heads * D + (long long)blockIdx.x * (n_heads / n_kv) * D;
}

// The row element a lane's c-th value is: with D a multiple of 32, PER_LANE contiguous elements per
// lane, so a K or V row is one vector load per lane (8 B of f16 at D = 128); else (80) lane + 32 c,
// the top lanes of the last chunk idle.
template <int D, int PER_LANE>
__device__ __forceinline__ int lane_elem(int lane, int c) {
    return D % 32 == 0 ? lane * PER_LANE + c : lane + 32 * c;
}

template <int N> struct LaneVec;   // N contiguous f16 as one load
template <> struct LaneVec<2> { typedef unsigned int T; };
template <> struct LaneVec<4> { typedef uint2 T; };
template <> struct LaneVec<8> { typedef uint4 T; };

template <int D, int PER_LANE>
__device__ __forceinline__ void load_lane_elems(const half_bits* row, int lane, float (&out)[PER_LANE]) {
    if constexpr (D % 32 == 0 && (PER_LANE == 2 || PER_LANE == 4 || PER_LANE == 8)) {
        typedef typename LaneVec<PER_LANE>::T V;
        V v = *reinterpret_cast<const V*>(row + lane * PER_LANE);
        const half_bits* h = reinterpret_cast<const half_bits*>(&v);
#pragma unroll
        for (int c = 0; c < PER_LANE; c++) out[c] = half_to_float(h[c]);
    } else {
#pragma unroll
        for (int c = 0; c < PER_LANE; c++) {
            const int e = lane_elem<D, PER_LANE>(lane, c);
            out[c] = e < D ? load_kv(row + e) : 0.f;
        }
    }
}

template <int D, int PER_LANE>
__device__ __forceinline__ void load_lane_elems(const float* row, int lane, float (&out)[PER_LANE]) {
    if constexpr (D % 32 == 0 && (PER_LANE == 2 || PER_LANE == 4 || PER_LANE == 8)) {
#pragma unroll
        for (int c = 0; c < PER_LANE; c += 2) {   // 8 B loads: a session's cache offset need not be 16 B aligned
            float2 v = *reinterpret_cast<const float2*>(row + lane * PER_LANE + c);
            out[c] = v.x; out[c + 1] = v.y;
        }
    } else {
#pragma unroll
        for (int c = 0; c < PER_LANE; c++) {
            const int e = lane_elem<D, PER_LANE>(lane, c);
            out[c] = e < D ? row[e] : 0.f;
        }
    }
}

// Keys per split block of a (kv head, token) holding n_keys keys: at least min_keys, so short contexts
// use few splits; with every key in split 0 that block writes the output itself (no partials, no ticket).
__device__ __forceinline__ int keys_per_split(int n_keys, int splits, int min_keys) {
    return max((n_keys + splits - 1) / splits, min_keys);
}

// The split blocks of a (kv head, token) that hold keys: the first ceil(n_keys / per_split).  The rest
// exit at launch, before any prologue, partial or ticket; the ticket and the merge count these alone.
__device__ __forceinline__ int active_splits(int n_keys, int per_split) {
    return (n_keys + per_split - 1) / per_split;
}

// D: head_dim, a constant so q and acc stay in registers; W: the block's warps (ATTN_WARPS, or
// ATTN_WIDE_WARPS for attention_rope.cu's _w8 kernels: more keys per block, merged in shared
// memory).  The caller ran pdl_wait (rows were built from per-token params) and passes this
// block's token's K rows and its group's q rows, qt[g * D + i] (global memory, or shared after
// attention_rope.cu's prologue).  tree: a token tree's masks per row (kv_cache.cuh TreeRow), or null.
template <int D, int G, typename Rows, int W = ATTN_WARPS>
__device__ __forceinline__ void attention_split_body(
        const float* __restrict__ qt, const Rows rows, const int* __restrict__ pos, float* part_acc,
        float* part_max, float* part_sum, float* __restrict__ out, unsigned int* counters, int n_heads,
        int n_kv, int window, float softmax_scale, int min_keys, const int* __restrict__ tree = nullptr) {
    constexpr int PER_LANE = (D + 31) / 32;
    constexpr int KEYS_PER_ITER = G <= 2 && PER_LANE <= 4 ? 8 : PER_LANE <= 4 ? 4 : 2;   // keys whose loads are in flight together
    __shared__ float merge_acc[W][(G * D < ATTN_MAX_GROUP_D ? G * D : ATTN_MAX_GROUP_D)];
    __shared__ float merge_max[W][G], merge_sum[W][G];
    __shared__ bool is_last_split;
    __shared__ float split_weight[G][ATTN_MAX_SPLITS], split_den[G];
    const int head_kv = blockIdx.x, t = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = n_heads / n_kv;
    const int first_key = window > 0 ? max(pos[t] - window + 1, 0) : 0;
    const int n_keys = pos[t] + 1 - first_key, per_split = keys_per_split(n_keys, splits, min_keys);
    const int active = active_splits(n_keys, per_split);
    if (split >= active) return;              // no keys here: the ticket and the merge count active blocks
    const bool alone = active == 1;           // split 0 holds every key: it writes out itself
    const int begin = first_key + split * per_split, end = first_key + min(split * per_split + per_split, n_keys);
    const long long v_offset = (long long)n_kv * D;   // a position's V row follows its K row
    const TreeRow mask = tree_row(tree, t, pos[t]);   // a token tree's row: the slots it does not see

    float qr[G][PER_LANE], acc[G][PER_LANE];
    float run_max[G], run_sum[G];
#pragma unroll
    for (int g = 0; g < G; g++) {
        run_max[g] = -INFINITY; run_sum[g] = 0.f;
#pragma unroll
        for (int c = 0; c < PER_LANE; c++) {
            acc[g][c] = 0.f;
            const int e = lane_elem<D, PER_LANE>(lane, c);
            qr[g][c] = g < group && e < D ? qt[g * D + e] * softmax_scale : 0.f;
        }
    }

    for (int p0 = begin + warp; p0 < end; p0 += KEYS_PER_ITER * W) {
        float kr[KEYS_PER_ITER][PER_LANE], vr[KEYS_PER_ITER][PER_LANE];
#pragma unroll
        for (int u = 0; u < KEYS_PER_ITER; u++) {
            int p = min(p0 + u * W, end - 1);   // a duplicate key is loaded, then skipped
            const typename Rows::Elem* krow = rows.row(p);
            load_lane_elems<D, PER_LANE>(krow, lane, kr[u]);
            load_lane_elems<D, PER_LANE>(krow + v_offset, lane, vr[u]);
        }
#pragma unroll
        for (int u = 0; u < KEYS_PER_ITER; u++) {
            if (u > 0 && p0 + u * W >= end) break;
            if (tree != nullptr && !mask.sees(p0 + u * W)) continue;   // another branch of the tree
#pragma unroll
            for (int g = 0; g < G; g++) {
                if (g >= group) break;
                float s = 0.f;
#pragma unroll
                for (int c = 0; c < PER_LANE; c++) s = fmaf(qr[g][c], kr[u][c], s);
                s = warp_sum(s);
                float new_max = fmaxf(run_max[g], s);
                float correction = expf(run_max[g] - new_max);
                float weight = expf(s - new_max);
                run_sum[g] = run_sum[g] * correction + weight;
#pragma unroll
                for (int c = 0; c < PER_LANE; c++) acc[g][c] = fmaf(acc[g][c], correction, weight * vr[u][c]);
                run_max[g] = new_max;
            }
        }
    }

#pragma unroll
    for (int g = 0; g < G; g++) {
        if (g >= group) break;
        if (lane == 0) { merge_max[warp][g] = run_max[g]; merge_sum[warp][g] = run_sum[g]; }
#pragma unroll
        for (int c = 0; c < PER_LANE; c++)
            if (lane_elem<D, PER_LANE>(lane, c) < D) merge_acc[warp][g * D + lane_elem<D, PER_LANE>(lane, c)] = acc[g][c];
    }
    __syncthreads();
    const long long part_row = ((long long)t * n_heads + (long long)head_kv * group) * splits + split;
    for (int i = threadIdx.x; i < group * D; i += W * 32) {
        int g = i / D, d = i % D;
        float block_max = -INFINITY;
#pragma unroll
        for (int w = 0; w < W; w++) block_max = fmaxf(block_max, merge_max[w][g]);
        float num = 0.f, den = 0.f;
#pragma unroll
        for (int w = 0; w < W; w++) {
            // a warp that saw no key has max -inf and contributes nothing
            float f = merge_max[w][g] == -INFINITY ? 0.f : expf(merge_max[w][g] - block_max);
            num += merge_acc[w][i] * f;
            den += merge_sum[w][g] * f;
        }
        if (alone) {          // the merge below would give num * 1 / (den * 1): the same bits
            out[(long long)t * n_heads * D + (long long)head_kv * group * D + i] = num / den;
            continue;
        }
        long long row = part_row + (long long)g * splits;
        part_acc[row * D + d] = num;
        if (d == 0) { part_max[row] = block_max; part_sum[row] = den; }
    }
    if (alone) return;

    __threadfence();   // partials visible device-wide before the ticket
    __syncthreads();
    unsigned int* counter = counters + (long long)t * n_kv + head_kv;
    if (threadIdx.x == 0) is_last_split = atomicAdd(counter, 1u) == (unsigned int)(active - 1);
    __syncthreads();
    if (!is_last_split) return;
    __threadfence();
    const long long first = ((long long)t * n_heads + (long long)head_kv * group) * splits;
    // per q head: the weight of each split, e^(max_s - max), staged once (one warp per head)
    for (int g = warp; g < group; g += W) {
        float m = lane < active ? __ldcg(part_max + first + (long long)g * splits + lane) : -INFINITY;
        float total_max = warp_max(m);
        float f = m == -INFINITY ? 0.f : expf(m - total_max);   // lanes past the active splits: nothing
        float den = warp_sum(lane < active ? f * __ldcg(part_sum + first + (long long)g * splits + lane) : 0.f);
        if (lane < active) split_weight[g][lane] = f;
        if (lane == 0) split_den[g] = den;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < group * D; i += W * 32) {
        int g = i / D, d = i % D;
        const float* acc_g = part_acc + (first + (long long)g * splits) * D + d;
        float num = 0.f;
#pragma unroll 4
        for (int s = 0; s < active; s++) {
            float f = split_weight[g][s];
            if (f != 0.f) num += __ldcg(acc_g + (long long)s * D) * f;
        }
        out[(long long)t * n_heads * D + (long long)head_kv * group * D + i] = num / split_den[g];
    }
    if (threadIdx.x == 0) *counter = 0u;
}
