// A routed layer of a mixture-of-experts model on the device (scheduler/ops.py's router and experts
// ops, kestrel_stream/cuda/moe_kernels.py builds the launches): four launches a layer for any number of
// tokens T, and no host round trip -- the chosen experts are found, grouped and read on the device.
//
//   moe_route     the router's float32 logits of xn (x * the norm weight, times 1/rms: the norm
//                 prologue), blocks over (8 experts, 8 tokens); the model's top-k, a warp a token --
//                 softmax over every expert, the top k, renormalized or not (Qwen3-MoE), or the top k
//                 logits, softmax over them (Mixtral) -- ties to the lowest expert id as the host's
//                 stable sort; "route" rows [T, 2k]: the ids as floats, then the weights (the host's
//                 layout); each choice counted in counts[E] (routing frequency, read by the host when
//                 it asks).  The last block to finish (a ticket) groups the T k choices by expert
//                 (flags & 4: not, for the one-token launches, which read the route row).
//   moe_experts_<fmt>_m<M>[_silu]
//                 grid (row blocks, experts): block (x, s) takes the s-th chosen expert that has a
//                 slot in the expert pool and rows [4x, 4x + 4) of its weight, over the tokens that
//                 chose it in tiles of M; gate_up (_silu): x rows gathered by token, times 1/rms,
//                 SiLU of (gate, up) row pairs -> act rows in grouped order; down: the act rows in
//                 order -> one output row per choice.  The dot products are the block-format GEMV's
//                 (block_dots.cuh over q4_formats.cuh, Q8_0 included), the reduction and SiLU its
//                 epilogue (q4_gemv_epilogue.cuh).
//   moe_experts_<fmt>_g4[_silu]
//                 the same over blocks of 8 chosen experts: block (x, s) takes rows [4x, 4x + 4) of the chosen
//                 experts 8s .. 8s + 7 with a slot, 16 threads each (a group's sums reduced by shuffles among
//                 its own lanes, no block barrier), their tokens in tiles of 4: a step of a few sessions
//                 (most experts one or two tokens) reads 8 experts' rows a block, not one's
//   moe_combine   one block per token: the weighted sum of its choices' down rows (those with a slot),
//                 plus the residual, into y; y * the next norm's weight into xn and 1/rms: what a dense
//                 down's epilogue writes.  Without a residual it writes the sum alone (mode offload:
//                 the resident experts' part, which the host adds to its own).
//
// A step of one token (decode at batch 1) takes two launches in place of the three after the route, with
// no grouping: block x takes rows [4x, 4x + 4) of every chosen expert at once, its threads in k groups
// (choice j: group j, 128 / k threads rounded down to a power of two), the token's route row read in place:
//   moe_token_<fmt>_silu     gate_up, times 1/rms, SiLU of (gate, up) row pairs -> act row j for choice j
//   moe_token_<fmt>_combine  down of act row j, each group's sums times its choice's weight, so that the
//                            block's reduction is the weighted sum: the dense GEMV epilogue then adds the
//                            residual and writes y, xn and the last block's 1/rms (or, without a residual,
//                            the sum alone, as moe_combine)
//
// The expert pool: every expert slot holds one expert's gate_up rows (gate j, up j interleaved) and
// down rows in the layer's formats; slot s's qs at qs + s * qs_slot, its meta at meta + s * meta_slot;
// slot_of[e] is expert e's slot in this layer, -1 where the expert is not on the device.
//
// groups (ints), for E experts and A = T k choices (choice a = t k + j: token t's j-th):
//   [0, E]           offsets: expert e's choices are sorted[offsets[e] .. offsets[e + 1])
//   [E + 1, 2E + 1]  active: the chosen experts with a slot, ascending; active[E] how many
//   sorted [A]       the choices grouped by expert, ascending within each expert
//   position [A]     where choice a is in sorted
//   logits [T, E]    (floats) the router's, for the choice
#include "common.cuh"
#include "q4_formats.cuh"
#include "block_dots.cuh"
#include "q4_gemv_epilogue.cuh"

#define MOE_MAX_EXPERTS 256
#define MOE_MAX_CHOSEN 16
#define MOE_MAX_CHOICES 8192
#define MOE_ROUTE_WARPS 8     // a route block: 8 experts (a warp each) ...
#define MOE_ROUTE_TOKENS 8    // ... over a tile of 8 tokens
#define MOE_ROWS 4
#define MOE_THREADS 128
#define MOE_COMBINE_THREADS 1024   // a token's row in two columns a thread (one block a token: latency)

// one warp: token t's choice from its logits (lane l holds experts l, l + 32, ...): softmax over every
// expert first (SOFTMAX_FIRST, Qwen3-MoE), the top k -- each round the largest score, ties to the lowest id
// (the host's stable sort) -- and their weights: renormalized (NORMALIZE) or not, or (Mixtral) a softmax
// over the top k logits; lane 0 writes the route row and counts the choices
__device__ __forceinline__ void choose_experts(const volatile float* logits, int E, int k, int flags, float* route_row,
                                               unsigned int* counts) {
    constexpr int PER_LANE = MOE_MAX_EXPERTS / 32;
    const bool softmax_first = flags & 1, normalize = flags & 2;
    const int lane = threadIdx.x & 31;
    float v[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) v[i] = lane + 32 * i < E ? logits[lane + 32 * i] : -INFINITY;
    if (softmax_first) {
        float top = -INFINITY, sum = 0.f;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) top = fmaxf(top, v[i]);
        top = warp_max(top);
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) {
            v[i] = lane + 32 * i < E ? expf(v[i] - top) : 0.f;
            sum += v[i];
        }
        sum = warp_sum(sum);
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) v[i] = lane + 32 * i < E ? v[i] / sum : -INFINITY;
    }
    float top[MOE_MAX_CHOSEN];
    int pick[MOE_MAX_CHOSEN];
    for (int j = 0; j < k; j++) {
        float best = -INFINITY;
        int at = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++)   // ascending ids within the lane: strictly greater keeps the lowest
            if (lane + 32 * i < E && (v[i] > best || at == 0x7fffffff)) {
                best = v[i];
                at = lane + 32 * i;
            }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other = __shfl_xor_sync(0xffffffffu, best, offset);
            const int other_at = __shfl_xor_sync(0xffffffffu, at, offset);
            if (other > best || (other == best && other_at < at)) {
                best = other;
                at = other_at;
            }
        }
        pick[j] = at;
        top[j] = best;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++)
            if (lane + 32 * i == at) v[i] = -INFINITY;   // taken (scores are finite)
    }
    if (lane != 0) return;
    const float largest = top[0];
    float sum = 0.f;
    for (int j = 0; j < k; j++) {
        if (!softmax_first) top[j] = expf(top[j] - largest);   // Mixtral: softmax over the chosen logits
        sum += top[j];
    }
    for (int j = 0; j < k; j++) {
        route_row[j] = (float)pick[j];
        route_row[k + j] = softmax_first && !normalize ? top[j] : top[j] / sum;
        if (counts) atomicAdd(counts + pick[j], 1u);
    }
}

// the last block of the launch: every token's choices grouped by expert (a counting sort, stable by choice)
__device__ __forceinline__ void group_by_expert(const float* route, const int* slot_of, int* groups, int E, int k,
                                                int T) {
    constexpr int WARPS = MOE_ROUTE_WARPS;
    __shared__ int start[MOE_MAX_EXPERTS];
    __shared__ int first[MOE_MAX_EXPERTS + 1];   // the offsets, read back from here (not from global memory)
    __shared__ int chosen[MOE_MAX_CHOICES];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, A = T * k;
    int* offsets = groups;
    int* active = groups + E + 1;
    int* sorted = groups + 2 * (E + 1);
    int* position = sorted + A;
    const volatile float* rows = route;   // written by other blocks: read at L2
    for (int e = threadIdx.x; e < E; e += blockDim.x) start[e] = 0;
    __syncthreads();
    for (int a = threadIdx.x; a < A; a += blockDim.x) {
        const int e = (int)rows[(long long)(a / k) * 2 * k + a % k];
        chosen[a] = e;
        atomicAdd(&start[e], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0, n = 0;
        for (int e = 0; e < E; e++) {
            const int c = start[e];
            first[e] = run;
            if (c && (slot_of == nullptr || slot_of[e] >= 0)) active[n++] = e;
            run += c;
        }
        first[E] = run;
        active[E] = n;
    }
    __syncthreads();
    for (int e = threadIdx.x; e <= E; e += blockDim.x) offsets[e] = first[e];
    for (int e = warp; e < E; e += WARPS) {   // a warp per expert: its choices in order, 32 at a time
        int at = first[e];
        if (at == first[e + 1]) continue;
        for (int a0 = 0; a0 < A; a0 += 32) {
            const int a = a0 + lane;
            const bool mine = a < A && chosen[a] == e;
            const unsigned int ballot = __ballot_sync(0xffffffffu, mine);
            if (mine) {
                const int p = at + __popc(ballot & ((1u << lane) - 1u));
                sorted[p] = a;
                position[a] = p;
            }
            at += __popc(ballot);
        }
    }
}

// grid (experts / 8, tokens / 8): block (g, s) the logits of experts 8g.. for tokens 8s.. (a warp an expert,
// its router row read once for the tile) into the groups' logits; the tile's last block (tickets[s]) the
// tile's choices, a warp a token; the launch's last block (tickets[tiles]) the grouping.  Each last block
// resets its ticket.
extern "C" __global__ void __launch_bounds__(32 * MOE_ROUTE_WARPS) moe_route(
        const float* xn, const float* inv_rms, const float* router, float* route, unsigned int* counts,
        const int* slot_of, int* groups, unsigned int* tickets, int H, int E, int k, int flags, int T) {
    __shared__ bool is_last_block;
    pdl_launch_dependents();
    pdl_wait();   // xn and 1/rms belong to earlier kernels
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = blockIdx.x * MOE_ROUTE_WARPS + warp, t0 = blockIdx.y * MOE_ROUTE_TOKENS;
    const int ntok = min(MOE_ROUTE_TOKENS, T - t0);
    float* logits = (float*)groups + 2 * (E + 1) + 2 * T * k;   // [T, E]
    if (e < E) {
        float acc[MOE_ROUTE_TOKENS];
#pragma unroll
        for (int m = 0; m < MOE_ROUTE_TOKENS; m++) acc[m] = 0.f;
        const float* w = router + (long long)e * H;
        // 4 strides' loads in flight a warp (each lane's sums keep their order): at one token the launch is
        // 16 blocks of 8 warps, each walking its 8 KB router row, latency-bound one load pair at a time --
        // so a tile of one token (decode) keeps 8 strides in flight, its sums in the same order
        if (ntok == 1) {
            const float* x = xn + (long long)t0 * H;
#pragma unroll 8
            for (int i = 4 * lane; i < H; i += 128) {
                const float4 a = *(const float4*)(w + i), b = *(const float4*)(x + i);
                acc[0] = fmaf(a.x, b.x, fmaf(a.y, b.y, fmaf(a.z, b.z, fmaf(a.w, b.w, acc[0]))));
            }
        } else {
#pragma unroll 4
            for (int i = 4 * lane; i < H; i += 128) {
                const float4 a = *(const float4*)(w + i);
#pragma unroll
                for (int m = 0; m < MOE_ROUTE_TOKENS; m++) {
                    if (m >= ntok) break;
                    const float4 b = *(const float4*)(xn + (long long)(t0 + m) * H + i);
                    acc[m] = fmaf(a.x, b.x, fmaf(a.y, b.y, fmaf(a.z, b.z, fmaf(a.w, b.w, acc[m]))));
                }
            }
        }
#pragma unroll
        for (int m = 0; m < MOE_ROUTE_TOKENS; m++) {
            if (m >= ntok) break;
            const float s = warp_sum(acc[m]);
            if (lane == 0) logits[(long long)(t0 + m) * E + e] = inv_rms ? s * inv_rms[t0 + m] : s;
        }
    }
    __threadfence();   // the logits land before the tile's ticket is taken
    __syncthreads();
    if (threadIdx.x == 0) is_last_block = atomicAdd(tickets + blockIdx.y, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!is_last_block) return;
    __threadfence();
    if (warp < ntok)
        choose_experts(logits + (long long)(t0 + warp) * E, E, k, flags, route + (long long)(t0 + warp) * 2 * k,
                       counts);
    __threadfence();   // the route rows land before the launch's ticket is taken
    __syncthreads();
    if (threadIdx.x == 0) {
        tickets[blockIdx.y] = 0u;
        is_last_block = !(flags & 4) && atomicAdd(tickets + gridDim.y, 1u) == gridDim.y - 1;   // 4: no grouping
    }
    __syncthreads();
    if (!is_last_block) return;
    __threadfence();
    group_by_expert(route, slot_of, groups, E, k, T);
    if (threadIdx.x == 0) tickets[gridDim.y] = 0u;
}

// this thread's share of rows [row0, row0 + MOE_ROWS) of one expert against ntok token rows xr: units first,
// first + stride, ... (the order of each thread's sums fixed); PAIRS: two units' loads in flight (one token's
// kernels), else the loop as the compiler unrolls it
template <class F, int M, bool PAIRS, class X>
__device__ __forceinline__ void expert_dots(float (&acc)[MOE_ROWS][M], const unsigned char* wq, const unsigned char* wm,
                                            const X& xr, int ntok, int row0, int N, int K, int first, int stride) {
    const long long qs_row = F::qs_row(K), meta_row = F::meta_row(K);
    const int units = K / F::UNIT;
    auto unit = [&](int u) {
        typename F::Raw raw[MOE_ROWS];
#pragma unroll
        for (int r = 0; r < MOE_ROWS; r++) {
            const long long row = min(row0 + r, N - 1);   // a clamped row is never stored
            F::load(raw[r], wq + row * qs_row, wm + row * meta_row, u);
        }
#pragma unroll
        for (int r = 0; r < MOE_ROWS; r++) unit_dots<F, M>(raw[r], u, xr, ntok, acc[r]);
    };
    if constexpr (PAIRS) {
#pragma unroll 2
        for (int u = first; u < units; u += stride) unit(u);
    } else {
        for (int u = first; u < units; u += stride) unit(u);
    }
}

// chosen expert e of the grouping: its slot's weights and its choices first .. end of `sorted`
struct ChosenExpert {
    const unsigned char *wq, *wm;
    const int* sorted;
    int first, end;
};

__device__ __forceinline__ ChosenExpert chosen_expert(const unsigned char* qs, const unsigned char* meta,
                                                      long long qs_slot, long long meta_slot, const int* slot_of,
                                                      const int* groups, int E, int e) {
    const long long slot = slot_of[e];
    return {qs + slot * qs_slot, meta + slot * meta_slot, groups + 2 * (E + 1), groups[e], groups[e + 1]};
}

// one tile of an expert's tokens, choices p0 .. p0 + ntok of the grouping (x rows gathered by token, or in
// grouped order): this thread's sums (expert_dots, units first, first + stride, ...) and the tokens' 1/rms
template <class F, int M>
__device__ __forceinline__ void tile_dots(float (&acc)[MOE_ROWS][M], float (&scale)[M], const unsigned char* wq,
                                          const unsigned char* wm, const float* x, int ldx, int gather,
                                          const float* inv_rms, const int* sorted, int k, int p0, int ntok, int row0,
                                          int N, int K, int first, int stride) {
    GatheredRows<M> xr;
#pragma unroll
    for (int m = 0; m < M; m++) {
        const int row = m < ntok ? (gather ? sorted[p0 + m] / k : p0 + m) : 0;
        xr.rows[m] = x + (long long)row * ldx;
        scale[m] = inv_rms && m < ntok ? inv_rms[row] : 1.f;
    }
#pragma unroll
    for (int r = 0; r < MOE_ROWS; r++)
#pragma unroll
        for (int m = 0; m < M; m++) acc[r][m] = 0.f;
    expert_dots<F, M, false>(acc, wq, wm, xr, ntok, row0, N, K, first, stride);
}

template <class F, int M, bool SILU>
__device__ __forceinline__ void moe_experts_body(
        const unsigned char* qs, const unsigned char* meta, long long qs_slot, long long meta_slot,
        const int* slot_of, const int* groups, const float* x, int ldx, int gather, const float* inv_rms,
        float* y, int ldy, int N, int K, int E, int k) {
    __shared__ GemvSharedT<M, MOE_ROWS, MOE_THREADS> sh;
    pdl_launch_dependents();
    pdl_wait();   // the route kernel's groups, x and 1/rms
    const int* active = groups + E + 1;
    if ((int)blockIdx.y >= active[E]) return;
    const ChosenExpert c = chosen_expert(qs, meta, qs_slot, meta_slot, slot_of, groups, E, active[blockIdx.y]);
    const int row0 = blockIdx.x * MOE_ROWS;
    for (int p0 = c.first; p0 < c.end; p0 += M) {
        const int ntok = min(M, c.end - p0);
        float acc[MOE_ROWS][M], scale[M];
        tile_dots<F, M>(acc, scale, c.wq, c.wm, x, ldx, gather, inv_rms, c.sorted, k, p0, ntok, row0, N, K,
                        threadIdx.x, MOE_THREADS);
#pragma unroll
        for (int r = 0; r < MOE_ROWS; r++)
#pragma unroll
            for (int m = 0; m < M; m++) acc[r][m] *= scale[m];   // the norm's 1/rms per token (gate_up)
        q4_gemv_epilogue<M, MOE_ROWS, MOE_THREADS, SILU>(sh, acc, row0, N, nullptr, y + (long long)p0 * ldy, ldy,
                                                         nullptr, nullptr, nullptr, nullptr, nullptr, 0.f, N, ntok);
        __syncthreads();   // the shared sums are the next tile's
    }
}

// 8 chosen experts a block, 16 threads each (the block's 8 groups; group j expert active[8 blockIdx.y + j])
#define MOE_GROUP_THREADS 16
#define MOE_GROUP_TOKENS 4

template <class F, bool SILU>
__device__ __forceinline__ void moe_experts_grouped_body(
        const unsigned char* qs, const unsigned char* meta, long long qs_slot, long long meta_slot,
        const int* slot_of, const int* groups, const float* x, int ldx, int gather, const float* inv_rms,
        float* y, int ldy, int N, int K, int E, int k) {
    constexpr int M = MOE_GROUP_TOKENS, G = MOE_THREADS / MOE_GROUP_THREADS;
    pdl_launch_dependents();
    pdl_wait();   // the route kernel's groups, x and 1/rms
    const int* active = groups + E + 1;
    const int j = threadIdx.x / MOE_GROUP_THREADS, lane = threadIdx.x % MOE_GROUP_THREADS;
    const int a = blockIdx.y * G + j;
    if (a >= active[E]) return;   // the whole group: its shuffles name its own lanes only
    const unsigned int mask = 0xffffu << (threadIdx.x & 16);
    const ChosenExpert c = chosen_expert(qs, meta, qs_slot, meta_slot, slot_of, groups, E, active[a]);
    const int row0 = blockIdx.x * MOE_ROWS;
    for (int p0 = c.first; p0 < c.end; p0 += M) {
        const int ntok = min(M, c.end - p0);
        float acc[MOE_ROWS][M], scale[M];
        tile_dots<F, M>(acc, scale, c.wq, c.wm, x, ldx, gather, inv_rms, c.sorted, k, p0, ntok, row0, N, K, lane,
                        MOE_GROUP_THREADS);
#pragma unroll
        for (int r = 0; r < MOE_ROWS; r++)
#pragma unroll
            for (int m = 0; m < M; m++) {
                if (m >= ntok) break;   // uniform over the group
#pragma unroll
                for (int offset = MOE_GROUP_THREADS / 2; offset > 0; offset >>= 1)
                    acc[r][m] += __shfl_xor_sync(mask, acc[r][m], offset);
                acc[r][m] *= scale[m];   // the norm's 1/rms per token (gate_up)
            }
        if (lane == 0) {
#pragma unroll
            for (int m = 0; m < M; m++) {
                if (m >= ntok) break;
                float* out = y + (long long)(p0 + m) * ldy;
#pragma unroll
                for (int r = 0; r < MOE_ROWS; r += SILU ? 2 : 1) {
                    const int row = row0 + r;
                    if (row >= N) break;
                    if (SILU) out[row / 2] = q4_silu_mul(acc[r][m], acc[r + 1][m]);
                    else out[row] = acc[r][m];
                }
            }
        }
    }
}

#define DEFINE_MOE_EXPERTS_GROUPED(F, SILU, NAME)                                                     \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS) NAME(                                   \
            const unsigned char* qs, const unsigned char* meta, long long qs_slot, long long meta_slot,  \
            const int* slot_of, const int* groups, const float* x, int ldx, int gather,               \
            const float* inv_rms, float* y, int ldy, int N, int K, int E, int k) {                    \
        moe_experts_grouped_body<F, SILU>(qs, meta, qs_slot, meta_slot, slot_of, groups, x, ldx, gather, \
                                          inv_rms, y, ldy, N, K, E, k);                                \
    }

#define DEFINE_MOE_EXPERTS(F, M, SILU, NAME)                                                          \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS) NAME(                                   \
            const unsigned char* qs, const unsigned char* meta, long long qs_slot, long long meta_slot,  \
            const int* slot_of, const int* groups, const float* x, int ldx, int gather,               \
            const float* inv_rms, float* y, int ldy, int N, int K, int E, int k) {                    \
        moe_experts_body<F, M, SILU>(qs, meta, qs_slot, meta_slot, slot_of, groups, x, ldx, gather,    \
                                     inv_rms, y, ldy, N, K, E, k);                                     \
    }
#define DEFINE_MOE_EXPERTS_FMT(F, CODE)                                  \
    DEFINE_MOE_EXPERTS(F, 1, false, moe_experts_##CODE##_m1)            \
    DEFINE_MOE_EXPERTS(F, 1, true, moe_experts_##CODE##_m1_silu)        \
    DEFINE_MOE_EXPERTS(F, 8, false, moe_experts_##CODE##_m8)            \
    DEFINE_MOE_EXPERTS(F, 8, true, moe_experts_##CODE##_m8_silu)        \
    DEFINE_MOE_EXPERTS_GROUPED(F, false, moe_experts_##CODE##_g4)       \
    DEFINE_MOE_EXPERTS_GROUPED(F, true, moe_experts_##CODE##_g4_silu)

DEFINE_MOE_EXPERTS_FMT(FmtQ8_0, q8_0)
DEFINE_MOE_EXPERTS_FMT(FmtQ4_0, q4_0)
DEFINE_MOE_EXPERTS_FMT(FmtQ4_K, q4_k)
DEFINE_MOE_EXPERTS_FMT(FmtQ6_K, q6_k)

extern "C" __global__ void __launch_bounds__(MOE_COMBINE_THREADS) moe_combine(
        const float* route, const int* groups, const int* slot_of, const float* expert_out, const float* res,
        float* y, const float* normw_out, float* xn_out, float* inv_rms_out, float eps, int H, int E, int k,
        int T) {
    __shared__ float warp_sums[MOE_COMBINE_THREADS / 32];
    __shared__ float weight[MOE_MAX_CHOSEN];
    __shared__ long long row_at[MOE_MAX_CHOSEN];   // the choice's row of expert_out, -1: its expert is on the host
    pdl_launch_dependents();
    pdl_wait();
    const int t = blockIdx.x;
    const int* position = groups + 2 * (E + 1) + T * k;
    const float* chosen = route + (long long)t * 2 * k;
    // the token's choices read once (y may alias res, not route: without this every column would read them
    // again after its store, a chain of dependent loads per choice)
    if (threadIdx.x < k) {
        const int j = threadIdx.x;
        weight[j] = chosen[k + j];
        row_at[j] = slot_of[(int)chosen[j]] < 0 ? -1 : (long long)position[t * k + j] * H;
    }
    __syncthreads();
    float sq = 0.f;
    for (int c = threadIdx.x; c < H; c += blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < k; j++) {
            if (row_at[j] < 0) continue;   // on the host
            acc = fmaf(weight[j], expert_out[row_at[j] + c], acc);
        }
        const long long at = (long long)t * H + c;
        const float s = res ? res[at] + acc : acc;   // y may alias res: each element read, then written
        y[at] = s;
        if (xn_out) xn_out[at] = s * normw_out[c];
        sq += s * s;
    }
    if (inv_rms_out == nullptr) return;
    sq = warp_sum(sq);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sq;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int w = 0; w < MOE_COMBINE_THREADS / 32; w++) total += warp_sums[w];
        inv_rms_out[t] = 1.0f / sqrtf(total / (float)H + eps);
    }
}

// ---- one token: every chosen expert's rows in one block ----

// threads a choice has (choice j: threads [j tpc, j tpc + tpc)): MOE_THREADS / k rounded down to a power of two
__device__ __forceinline__ int choice_threads(int k) {
    int kp = 1;
    while (kp < k) kp <<= 1;
    return MOE_THREADS / kp;
}

// the slot of the token's choice j (-1: not on the device, or no such choice)
__device__ __forceinline__ int choice_slot(const int* slot_of, const float* route, int j, int k) {
    return j < k ? slot_of[(int)route[j]] : -1;
}

// this thread's share of rows [row0, row0 + MOE_ROWS) of its choice's expert (choice j: threads [j tpc, j tpc + tpc))
// against x + j ldx (ldx 0: the token's one row); false, and zeros, where the choice has no slot
template <class F>
__device__ __forceinline__ bool choice_dots(float (&acc)[MOE_ROWS][1], const unsigned char* qs,
                                            const unsigned char* meta, long long qs_slot, long long meta_slot,
                                            const int* slot_of, const float* route, const float* x, int ldx, int row0,
                                            int N, int K, int k) {
    const int tpc = choice_threads(k), j = threadIdx.x / tpc;
#pragma unroll
    for (int r = 0; r < MOE_ROWS; r++) acc[r][0] = 0.f;
    const int slot = choice_slot(slot_of, route, j, k);
    if (slot < 0) return false;
    const StridedRows xr{x + (long long)j * ldx, 0};
    const int lane = threadIdx.x % tpc;
    expert_dots<F, 1, true>(acc, qs + slot * qs_slot, meta + slot * meta_slot, xr, 1, row0, N, K, lane, tpc);
    return true;
}

template <class F>
__device__ __forceinline__ void moe_token_silu_body(
        const unsigned char* qs, const unsigned char* meta, long long qs_slot, long long meta_slot,
        const int* slot_of, const float* route, const float* x, const float* inv_rms, float* act, int lda, int N,
        int K, int k) {
    __shared__ float part[MOE_ROWS][MOE_THREADS];
    pdl_launch_dependents();
    pdl_wait();   // the route, x and 1/rms
    const int tpc = choice_threads(k), row0 = blockIdx.x * MOE_ROWS;
    float acc[MOE_ROWS][1];
    choice_dots<F>(acc, qs, meta, qs_slot, meta_slot, slot_of, route, x, 0, row0, N, K, k);
#pragma unroll
    for (int r = 0; r < MOE_ROWS; r++) part[r][threadIdx.x] = acc[r][0];
    __syncthreads();
    constexpr int PAIRS = MOE_ROWS / 2;
    if (threadIdx.x >= k * PAIRS) return;
    const int c = threadIdx.x / PAIRS, p = threadIdx.x % PAIRS, row = row0 + 2 * p;
    if (row >= N || choice_slot(slot_of, route, c, k) < 0) return;
    float gate = 0.f, up = 0.f;
    for (int t = c * tpc; t < (c + 1) * tpc; t++) {   // the group's threads in order
        gate += part[2 * p][t];
        up += part[2 * p + 1][t];
    }
    const float s = inv_rms ? inv_rms[0] : 1.f;
    act[(long long)c * lda + row / 2] = q4_silu_mul(gate * s, up * s);
}

template <class F>
__device__ __forceinline__ void moe_token_combine_body(
        const unsigned char* qs, const unsigned char* meta, long long qs_slot, long long meta_slot,
        const int* slot_of, const float* route, const float* act, const float* res, float* y, const float* normw_out,
        float* xn_out, float* inv_rms_out, unsigned int* counter, float eps, int lda, int N, int K, int k) {
    __shared__ GemvSharedT<1, MOE_ROWS, MOE_THREADS> sh;
    pdl_launch_dependents();
    pdl_wait();   // the route and the act rows
    const int j = threadIdx.x / choice_threads(k), row0 = blockIdx.x * MOE_ROWS;
    float acc[MOE_ROWS][1];
    const float w = choice_dots<F>(acc, qs, meta, qs_slot, meta_slot, slot_of, route, act, lda, row0, N, K, k)
                    ? route[k + j] : 0.f;
#pragma unroll
    for (int r = 0; r < MOE_ROWS; r++) acc[r][0] *= w;   // the block's reduction: the choices' weighted sum
    q4_gemv_epilogue<1, MOE_ROWS, MOE_THREADS, false>(sh, acc, row0, N, nullptr, y, N, res, normw_out, xn_out,
                                                      inv_rms_out, counter, eps, N, 1);
}

#define DEFINE_MOE_TOKEN_FMT(F, CODE)                                                                        \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS) moe_token_##CODE##_silu(                       \
            const unsigned char* qs, const unsigned char* meta, long long qs_slot, long long meta_slot,         \
            const int* slot_of, const float* route, const float* x, const float* inv_rms, float* act, int lda, \
            int N, int K, int k) {                                                                           \
        moe_token_silu_body<F>(qs, meta, qs_slot, meta_slot, slot_of, route, x, inv_rms, act, lda, N, K, k);  \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS) moe_token_##CODE##_combine(                    \
            const unsigned char* qs, const unsigned char* meta, long long qs_slot, long long meta_slot,         \
            const int* slot_of, const float* route, const float* act, const float* res, float* y,             \
            const float* normw_out, float* xn_out, float* inv_rms_out, unsigned int* counter, float eps,       \
            int lda, int N, int K, int k) {                                                                  \
        moe_token_combine_body<F>(qs, meta, qs_slot, meta_slot, slot_of, route, act, res, y, normw_out,       \
                                  xn_out, inv_rms_out, counter, eps, lda, N, K, k);                          \
    }

DEFINE_MOE_TOKEN_FMT(FmtQ8_0, q8_0)
DEFINE_MOE_TOKEN_FMT(FmtQ4_0, q4_0)
DEFINE_MOE_TOKEN_FMT(FmtQ4_K, q4_k)
DEFINE_MOE_TOKEN_FMT(FmtQ6_K, q6_k)
