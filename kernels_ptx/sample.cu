// Sampling after lm_head: temperature / top-k / top-p / min-p over one logits row, one block per
// row, the token id written to out[row] (4 bytes back per token, as a greedy step).  The numpy
// reference is kestrel_stream/text/sampling.py; both keep the logits at or above a cut (ties
// stay), so the cuts are found by radix selection on order-preserving keys, never by sorting:
//   top-k: the k-th largest key (four 8-bit digit passes counting elements);
//   top-p: among the top-k survivors, the key where the mass from the top first reaches p
//          (four passes summing softmax mass per digit);
//   min-p: logit >= max + log(min_p).
// The draw is an inverse CDF in token-id order at the temperature, with one uniform number
// from Philox4x32-10 (key = seed, counter = (step, 0, step >> 32, 0)), bit-identical to
// sampling.philox_uniform.  state[row]: 8 words {temperature, top_k, top_p, min_p (floats but
// top_k), seed lo, seed hi, step lo, step hi}; the kernel advances the step, so chained
// steps draw fresh numbers without a host upload.  Temperature 0 (with top_k 1: pack_state's greedy
// row) takes the first kept token in id order, the argmax, so greedy rows share a sampled step.
#include "common.cuh"

__device__ __forceinline__ unsigned int order_key(float x) {
    const unsigned int b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float philox_uniform(unsigned int k0, unsigned int k1, unsigned int c0, unsigned int c2) {
    unsigned int c1 = 0u, c3 = 0u;
#pragma unroll
    for (int r = 0; r < 10; r++) {
        const unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        const unsigned int n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    return (float)(c0 >> 8) * (1.0f / 16777216.0f);
}

template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, T* scratch, Op op) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = scratch[0];
    for (int w = 1; w < warps; w++) v = op(v, scratch[w]);
    return v;
}

struct MaxOp { __device__ float operator()(float a, float b) const { return fmaxf(a, b); } };
struct AddOp { __device__ float operator()(float a, float b) const { return a + b; } };
struct MaxIntOp { __device__ int operator()(int a, int b) const { return a > b ? a : b; } };

// Where the radix passes read: a whole logits row (ids = positions), or the candidates in shared
// memory (ids stored, in id order, so the draw's index order is still token-id order).
struct RowSource {
    const float* v; int n;
    __device__ float val(int i) const { return v[i]; }
    __device__ int id(int i) const { return i; }
};
struct CandSource {
    const float* v; const int* ids; int n;
    __device__ float val(int i) const { return v[i]; }
    __device__ int id(int i) const { return ids[i]; }
};

struct Scratch {
    float f[32];
    int i[32];
    unsigned int count_hist[256];
    float mass_hist[256];
    unsigned int digit;
    unsigned int need_u;
    float need_f;
};

// Warp 0 walks the 256 digits from the top, 8 per lane: the first digit where the count from the
// top reaches `remaining` (digit 0 when none: the rest is below).
__device__ void pick_count_digit(Scratch& s, unsigned int remaining) {
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    unsigned int sum = 0u;
    for (int j = 0; j < 8; j++) sum += s.count_hist[255 - 8 * lane - j];
    unsigned int incl = sum;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const unsigned int v = __shfl_up_sync(0xffffffffu, incl, offset);
        if (lane >= offset) incl += v;
    }
    const unsigned int total = __shfl_sync(0xffffffffu, incl, 31);
    unsigned int acc = incl - sum, above = 0u;
    int found = -1;
    for (int j = 0; j < 8; j++) {
        const int b = 255 - 8 * lane - j;
        if (found < 0 && acc + s.count_hist[b] >= remaining) { found = b; above = acc; }
        acc += s.count_hist[b];
    }
    const unsigned int hit = __ballot_sync(0xffffffffu, found >= 0);
    if (hit == 0u) {
        if (lane == 0) { s.digit = 0u; s.need_u = remaining - (total - s.count_hist[0]); }
    } else if (lane == __ffs(hit) - 1) {
        s.digit = (unsigned int)found; s.need_u = remaining - above;
    }
}

// The same over softmax mass: the first digit holding mass where the mass from the top reaches
// `need`; when rounding leaves none, the smallest digit that holds mass.
__device__ void pick_mass_digit(Scratch& s, float need) {
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    float sum = 0.f;
    for (int j = 0; j < 8; j++) sum += s.mass_hist[255 - 8 * lane - j];
    float incl = sum;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const float v = __shfl_up_sync(0xffffffffu, incl, offset);
        if (lane >= offset) incl += v;
    }
    const float total = __shfl_sync(0xffffffffu, incl, 31);
    float acc = incl - sum, above = 0.f;
    int found = -1, lowest = -1;
    for (int j = 0; j < 8; j++) {
        const int b = 255 - 8 * lane - j;
        const float m = s.mass_hist[b];
        if (m > 0.f) lowest = b;
        if (found < 0 && m > 0.f && acc + m >= need) { found = b; above = acc; }
        acc += m;
    }
    const unsigned int hit = __ballot_sync(0xffffffffu, found >= 0);
    const unsigned int some = __ballot_sync(0xffffffffu, lowest >= 0);
    if (hit != 0u) {
        if (lane == __ffs(hit) - 1) { s.digit = (unsigned int)found; s.need_f = need - above; }
    } else if (some != 0u) {
        if (lane == 31 - __clz(some)) { s.digit = (unsigned int)lowest; s.need_f = need - total; }
    } else if (lane == 0) {
        s.digit = 0u; s.need_f = need;
    }
}

// The k-th largest key of the source, digit by digit (four 8-bit passes counting elements).
template <typename Src>
__device__ unsigned int kth_key(const Src& src, unsigned int k, Scratch& s) {
    unsigned int prefix = 0u, mask = 0u, remaining = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) s.count_hist[b] = 0u;
        __syncthreads();
        for (int i = threadIdx.x; i < src.n; i += blockDim.x) {
            const unsigned int key = order_key(src.val(i));
            if ((key & mask) == prefix) atomicAdd(&s.count_hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        pick_count_digit(s, remaining);
        __syncthreads();
        prefix |= s.digit << shift;
        mask |= 255u << shift;
        remaining = s.need_u;
        __syncthreads();
    }
    return prefix;
}

// top-p after top-k (keys >= cut): the key where the mass from the top first reaches p.
template <typename Src>
__device__ unsigned int top_p_key(const Src& src, unsigned int cut, float top_p, float vmax, Scratch& s) {
    float z = 0.f;
    for (int i = threadIdx.x; i < src.n; i += blockDim.x)
        if (order_key(src.val(i)) >= cut) z += expf(src.val(i) - vmax);
    z = block_reduce(z, s.f, AddOp());
    float need = top_p * z;
    unsigned int prefix = 0u, mask = 0u;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) s.mass_hist[b] = 0.f;
        __syncthreads();
        for (int i = threadIdx.x; i < src.n; i += blockDim.x) {
            const unsigned int key = order_key(src.val(i));
            if (key >= cut && (key & mask) == prefix) atomicAdd(&s.mass_hist[(key >> shift) & 255u], expf(src.val(i) - vmax));
        }
        __syncthreads();
        pick_mass_digit(s, need);
        __syncthreads();
        prefix |= s.digit << shift;
        mask |= 255u << shift;
        need = s.need_f;
        __syncthreads();
    }
    return max(cut, prefix);
}

// top-p and min-p on top of the top-k cut.
template <typename Src>
__device__ unsigned int final_cut(const Src& src, unsigned int cut, float top_p, float min_p, float vmax, Scratch& s) {
    if (top_p < 1.0f) cut = top_p_key(src, cut, top_p, vmax, s);
    if (min_p > 0.0f) cut = max(cut, order_key(vmax + logf(min_p)));
    return cut;
}

// The inverse CDF in index (= token-id) order: each thread owns a contiguous chunk; an exclusive scan
// of chunk sums.  Then the row's Philox step advances, so the next chained step draws a fresh number.
template <typename Src>
__device__ void draw_token(const Src& src, unsigned int cut, float vmax, float temperature, unsigned int* st,
                           int* out, Scratch& s) {
    const int chunk = (src.n + blockDim.x - 1) / blockDim.x;
    const int lo = threadIdx.x * chunk, hi = min(src.n, lo + chunk);
    const bool greedy = !(temperature > 0.f);       // every kept token weighs 1, the target is 0: the first
    const float inv_t = greedy ? 0.f : 1.0f / temperature;
    float mine = 0.f;
    int last_kept = -1;
    for (int i = lo; i < hi; i++)
        if (order_key(src.val(i)) >= cut) { mine += expf((src.val(i) - vmax) * inv_t); last_kept = src.id(i); }
    float incl = mine;                               // inclusive scan: warps, then warp totals
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const float v = __shfl_up_sync(0xffffffffu, incl, offset);
        if (lane >= offset) incl += v;
    }
    __syncthreads();
    if (lane == 31) s.f[warp] = incl;
    __syncthreads();
    float warp_base = 0.f, total = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) {
        if (w < warp) warp_base += s.f[w];
        total += s.f[w];
    }
    const float excl = warp_base + incl - mine;
    const int fallback = block_reduce(last_kept, s.i, MaxIntOp());
    const float u = philox_uniform(st[4], st[5], st[6], st[7]);
    const float target = greedy ? 0.f : u * total;
    if (threadIdx.x == 0) *out = fallback;          // target at the very end (rounding): the last kept
    __syncthreads();
    if (mine > 0.f && excl <= target && target < excl + mine) {
        float acc = excl;
        for (int i = lo; i < hi; i++) {
            if (order_key(src.val(i)) < cut) continue;
            acc += expf((src.val(i) - vmax) * inv_t);
            if (acc > target) { *out = src.id(i); break; }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned long long step = ((unsigned long long)st[7] << 32 | st[6]) + 1ull;
        st[6] = (unsigned int)step;
        st[7] = (unsigned int)(step >> 32);
    }
}

// The whole row, one block: max, the top-k cut, top-p, min-p, the draw.
__device__ void sample_full_row(const float* row, int V, unsigned int* st, int* out, Scratch& s) {
    const float temperature = __uint_as_float(st[0]);
    const int top_k = (int)st[1];
    const float top_p = __uint_as_float(st[2]), min_p = __uint_as_float(st[3]);
    const RowSource src{row, V};
    float vmax = -INFINITY;
    for (int i = threadIdx.x; i < V; i += blockDim.x) vmax = fmaxf(vmax, row[i]);
    vmax = block_reduce(vmax, s.f, MaxOp());
    unsigned int cut = (top_k > 0 && top_k < V) ? kth_key(src, (unsigned int)top_k, s) : 0u;
    cut = final_cut(src, cut, top_p, min_p, vmax, s);
    draw_token(src, cut, vmax, temperature, st, out, s);
}

// grid T (rows), block 1024: the whole row in one block (any top_k; the chi-square tests launch it)
extern "C" __global__ void __launch_bounds__(1024) sample_rows(
        const float* __restrict__ logits, int V, unsigned int* __restrict__ state, int* __restrict__ out) {
    __shared__ Scratch s;
    pdl_launch_dependents();
    pdl_wait();   // see common.cuh
    sample_full_row(logits + (long long)blockIdx.x * V, V, state + 8 * blockIdx.x, out + blockIdx.x, s);
}

// With 0 < top_k <= SAMPLE_CAP (< V), the row is cut in two launches: sample_candidates keeps each
// slice's top_k logits (ties at its k-th value taken in id order, the rest of them flagged), which
// together hold the row's top_k; sample_finish runs top-k, top-p, min-p and the draw over those few.
// The kept set is all logits >= the k-th largest, so a slice that left out ties AT the row's k-th
// key lacks kept tokens: then sample_finish samples the whole row instead (same result, slower).
// cand per row: values [S][CAP], ids [S][CAP], then per slice {count, ties left out, k-th key, 0}.
#define SAMPLE_CAP 64
#define SAMPLE_MAX_SPLITS 64
#define CAND_WORDS(S) ((S) * (2 * SAMPLE_CAP + 4))

__device__ __forceinline__ bool uses_candidates(int top_k, int V) {
    return top_k > 0 && top_k <= SAMPLE_CAP && top_k < V;
}

// grid (S slices, T rows), block 256
extern "C" __global__ void __launch_bounds__(256) sample_candidates(
        const float* __restrict__ logits, int V, const unsigned int* __restrict__ state, unsigned int* __restrict__ cand) {
    __shared__ Scratch s;
    pdl_launch_dependents();
    pdl_wait();
    const int top_k = (int)state[8 * blockIdx.y + 1];
    if (!uses_candidates(top_k, V)) return;          // sample_finish samples the whole row
    const int S = gridDim.x, slice = (V + S - 1) / S;
    const int begin = min(V, blockIdx.x * slice), n = min(V, begin + slice) - begin;
    unsigned int* base = cand + (long long)blockIdx.y * CAND_WORDS(S);
    float* vals = (float*)base + blockIdx.x * SAMPLE_CAP;
    int* ids = (int*)(base + S * SAMPLE_CAP) + blockIdx.x * SAMPLE_CAP;
    unsigned int* meta = base + 2 * S * SAMPLE_CAP + 4 * blockIdx.x;
    const float* row = logits + (long long)blockIdx.y * V + begin;
    const unsigned int cut = n > top_k ? kth_key(RowSource{row, n}, (unsigned int)top_k, s) : 0u;
    // keys above the cut, then ties at it in id order until top_k: positions by exclusive scans
    const int chunk = (n + blockDim.x - 1) / blockDim.x;
    const int lo = threadIdx.x * chunk, hi = min(n, lo + chunk);
    int greater = 0, ties = 0;
    for (int i = lo; i < hi; i++) {
        const unsigned int key = order_key(row[i]);
        greater += key > cut;
        ties += key == cut;
    }
    int g_incl = greater, t_incl = ties;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const int g = __shfl_up_sync(0xffffffffu, g_incl, offset), t = __shfl_up_sync(0xffffffffu, t_incl, offset);
        if (lane >= offset) { g_incl += g; t_incl += t; }
    }
    if (lane == 31) { s.i[warp] = g_incl; s.count_hist[warp] = (unsigned int)t_incl; }
    __syncthreads();
    int g_before = g_incl - greater, t_before = t_incl - ties, g_total = 0, t_total = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) {
        if (w < warp) { g_before += s.i[w]; t_before += (int)s.count_hist[w]; }
        g_total += s.i[w];
        t_total += (int)s.count_hist[w];
    }
    const int tie_room = max(0, top_k - g_total);
    for (int i = lo; i < hi; i++) {
        const unsigned int key = order_key(row[i]);
        const bool keep = key > cut || (key == cut && t_before < tie_room);
        if (keep) {
            const int at = g_before + min(t_before, tie_room);
            vals[at] = row[i];
            ids[at] = begin + i;
        }
        g_before += key > cut;
        t_before += key == cut;
    }
    if (threadIdx.x == 0) {
        meta[0] = (unsigned int)(g_total + min(t_total, tie_room));
        meta[1] = t_total > tie_room ? 1u : 0u;
        meta[2] = cut;
    }
}

// grid T (rows), block 1024; S = sample_candidates' slices (<= SAMPLE_MAX_SPLITS)
extern "C" __global__ void __launch_bounds__(1024) sample_finish(
        const float* __restrict__ logits, int V, unsigned int* __restrict__ state,
        const unsigned int* __restrict__ cand, int S, int* __restrict__ out) {
    __shared__ Scratch s;
    __shared__ float cv[SAMPLE_MAX_SPLITS * SAMPLE_CAP];
    __shared__ int ci[SAMPLE_MAX_SPLITS * SAMPLE_CAP];
    __shared__ int offsets[SAMPLE_MAX_SPLITS + 1];
    pdl_launch_dependents();
    pdl_wait();
    const float* row = logits + (long long)blockIdx.x * V;
    unsigned int* st = state + 8 * blockIdx.x;
    const int top_k = (int)st[1];
    if (uses_candidates(top_k, V)) {
        const unsigned int* base = cand + (long long)blockIdx.x * CAND_WORDS(S);
        const unsigned int* meta = base + 2 * S * SAMPLE_CAP;
        if (threadIdx.x == 0) {                      // slices in order: the candidates stay in id order
            int total = 0;
            for (int b = 0; b < S; b++) { offsets[b] = total; total += (int)meta[4 * b]; }
            offsets[S] = total;
        }
        __syncthreads();
        for (int j = threadIdx.x; j < S * SAMPLE_CAP; j += blockDim.x) {
            const int b = j / SAMPLE_CAP, r = j % SAMPLE_CAP;
            if (r < (int)meta[4 * b]) {
                cv[offsets[b] + r] = __uint_as_float(base[j]);
                ci[offsets[b] + r] = (int)base[S * SAMPLE_CAP + j];
            }
        }
        __syncthreads();
        const CandSource src{cv, ci, offsets[S]};
        float vmax = -INFINITY;
        for (int i = threadIdx.x; i < src.n; i += blockDim.x) vmax = fmaxf(vmax, cv[i]);
        vmax = block_reduce(vmax, s.f, MaxOp());
        const unsigned int kcut = kth_key(src, (unsigned int)top_k, s);
        const bool missing = threadIdx.x < S && meta[4 * threadIdx.x + 1] != 0u && meta[4 * threadIdx.x + 2] == kcut;
        if (!__syncthreads_or(missing)) {
            const unsigned int cut = final_cut(src, kcut, __uint_as_float(st[2]), __uint_as_float(st[3]), vmax, s);
            draw_token(src, cut, vmax, __uint_as_float(st[0]), st, out + blockIdx.x, s);
            return;
        }
    }
    sample_full_row(row, V, st, out + blockIdx.x, s);
}
