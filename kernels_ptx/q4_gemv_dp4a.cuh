// The one-token block-format GEMV on integer dot products (the dTrRuU layouts of q4_gemv_m1d.cu):
// q4_gemv.cu's contract, the rows and threads of the tiled layouts (q4_gemv_tiled.cuh), but Q4_0, Q4_K
// and Q6_K levels meet x as int8 in dp4a instead of as floats in an FMA each.
//
// x, once per block, into dynamic shared memory (q4_dp4a_x.cuh; q4_gemv_variants.dp4a_shared_bytes): per 32-block
// d = amax / 127, hi = rn(x / d), lo = rn((x / d - hi) 128), q8_mma.cuh's two levels (so
// x = (128 hi + lo) d / 128 to ~2^-15 of the block's amax), d / 128 and the block's sum (of those x).
// Weights by D-unit: 32 bytes of a row's nibbles (units 2v, 2v + 1 of q4_formats.cuh), 64 weights,
// x elements [64 v, 64 v + 64), x blocks 2v and 2v + 1 (Q4_K: sub-blocks 2p, 2p + 1 of a super-block;
// Q4_0: two blocks).  Per block g of the two, exact in int32:
//   G = sum_i level_i (128 hi_i + lo_i)            (Q4_K's high nibbles in place, 16 q: its s / 16)
//   Q4_K: acc += s_g (d_g / 128) G - o_g sum_g      Q4_0: acc += d_w (d_g / 128 G - 8 sum_g)
// Shared x is stored in planes of 16 elements (plane p of D-unit v: elements 64 v + 16 p ..), so the
// threads of a warp, which take consecutive D-units, read consecutive 16 bytes: no bank conflicts.
// A block runs row tiles tile = blockIdx.x, + gridDim.x, ... (the host caps the grid at blocks_per_sm
// per SM), so one quantisation of x serves several tiles of a long weight; each tile's epilogue takes a
// ticket (q4_gemv_epilogue's `tickets`: the launch's tile count).  Q6_K rows (alone, or a Q4_K_M QKV's
// v rows) take their units as the float layouts do, four groups of 16 with a scale each (q6k_tile).
#pragma once
// (include common.cuh, q4_formats.cuh, q4_gemv_epilogue.cuh, q4_gemv_tiled.cuh and q4_dp4a_x.cuh first)

// a D-unit of each format: its loads, its nibble words (plane p, word i: the levels of x elements
// 64 v + 16 p + 4 i ..) and the float math of its two blocks' integer dots
template <class F> struct DUnit;

template <> struct DUnit<FmtQ4_K> {
    struct Raw { uint4 q0, q1, m; };
    static __device__ __forceinline__ void load(Raw& r, const unsigned char* qs, const unsigned char* meta, int v,
                                                int /*units*/) {
        r.q0 = load_weights16(qs + 32 * v);
        r.q1 = load_weights16(qs + 32 * v + 16);
        r.m = __ldg((const uint4*)(meta + 16 * (v >> 2)));
    }
    static __device__ __forceinline__ void prefetch(const unsigned char* qs, const unsigned char* meta, int v) {
        prefetch_l2(qs + 32 * v);
        prefetch_l2(meta + 16 * (v >> 2));
    }
    // planes 0, 1: sub-block 2p's elements 0..15, 16..31 (low nibbles); 2, 3: sub-block 2p + 1 (16 q)
    static __device__ __forceinline__ unsigned int nibbles(const Raw& r, int p, int i) {
        return word_of(p & 1 ? r.q1 : r.q0, i) & (p < 2 ? 0x0F0F0F0Fu : 0xF0F0F0F0u);
    }
    static __device__ __forceinline__ float apply(const Raw& r, int v, int dot0, int dot1, float4 xm, float acc) {
        Group g[2];
        TiledDecode<FmtQ4_K>::run(FmtQ4_K::Raw{r.q0, r.m}, 2 * v, g);   // s, o of sub-blocks 2p, 2p + 1 (s / 16)
        acc = fmaf(g[0].s * xm.x, (float)dot0, acc);
        acc = fmaf(-g[0].o, xm.y, acc);
        acc = fmaf(g[1].s * xm.z, (float)dot1, acc);
        return fmaf(-g[1].o, xm.w, acc);
    }
};

template <> struct DUnit<FmtQ4_0> {
    struct Raw { uint4 q0, q1; half_bits d0, d1; };
    // K a multiple of 32 only: the last D-unit may hold one block (the second reads as zeros)
    static __device__ __forceinline__ void load(Raw& r, const unsigned char* qs, const unsigned char* meta, int v,
                                                int units) {
        r.q0 = load_weights16(qs + 32 * v);
        r.d0 = __ldg((const half_bits*)meta + 2 * v);
        const bool second = 2 * v + 1 < units;
        r.q1 = second ? load_weights16(qs + 32 * v + 16) : make_uint4(0u, 0u, 0u, 0u);
        r.d1 = second ? __ldg((const half_bits*)meta + 2 * v + 1) : (half_bits)0;
    }
    static __device__ __forceinline__ void prefetch(const unsigned char* qs, const unsigned char* meta, int v) {
        prefetch_l2(qs + 32 * v);
        prefetch_l2((const half_bits*)meta + 2 * v);
    }
    // planes 0, 1: block 2v's elements 0..15 (low nibbles), 16..31 (high); 2, 3: block 2v + 1
    static __device__ __forceinline__ unsigned int nibbles(const Raw& r, int p, int i) {
        const unsigned int w = word_of(p < 2 ? r.q0 : r.q1, i);
        return (p & 1 ? w >> 4 : w) & 0x0F0F0F0Fu;
    }
    static __device__ __forceinline__ float apply(const Raw& r, int /*v*/, int dot0, int dot1, float4 xm, float acc) {
        acc = fmaf(half_to_float(r.d0), fmaf(xm.x, (float)dot0, -8.0f * xm.y), acc);   // levels q - 8
        return fmaf(half_to_float(r.d1), fmaf(xm.z, (float)dot1, -8.0f * xm.w), acc);
    }
};

// Row groups: a tile of GROUPS * ROWS rows, thread group gi (TG threads, whole warps) taking rows
// gi ROWS .. gi ROWS + ROWS - 1 of it, so the block's one quantisation of x serves GROUPS times the rows one
// thread holds.  For the shared epilogue each thread's sums sit at its group's rows, zeros elsewhere.
template <int ROWS, int GROUPS>
__device__ __forceinline__ void group_sums(const float (&acc)[ROWS][1], int group, float (&all)[GROUPS * ROWS][1]) {
#pragma unroll
    for (int gi = 0; gi < GROUPS; gi++)
#pragma unroll
        for (int r = 0; r < ROWS; r++) all[gi * ROWS + r][0] = group == gi ? acc[r][0] : 0.f;
}

// the tile of rows [row0, row0 + GROUPS ROWS) of a dp4a format (its rows from row_first to row_end) against
// the quantised x; `next_row0` >= 0: the block's next tile, same format, whose first pass is prefetched
// during the last pass of this one.  `quantise`: the block's first dp4a tile quantises x once its first
// pass is on its way into L2.
template <class F, int ROWS, int TG, int GROUPS, int UNROLL, bool SILU_PAIRS>
__device__ __forceinline__ void dp4a_tile(
        GemvSharedT<1, GROUPS * ROWS, TG * GROUPS>& sh, uint4* planes, float4* xmeta, bool quantise, int next_row0,
        const unsigned char* __restrict__ qs, const unsigned char* __restrict__ meta, int row0, int row_first,
        int row_end, const float* x, const float* inv_rms_in, float* y, int ldy, const float* res,
        const float* normw_out, float* xn_out, float* inv_rms_out, unsigned int* counter, float eps, int N, int K,
        int ntok, unsigned int tickets) {
    using D = DUnit<F>;
    const int group = threadIdx.x / TG, tt = threadIdx.x % TG;
    const long long qs_row = F::qs_row(K), meta_row = F::meta_row(K);
    auto row_pointers = [&](int first, const unsigned char* (&q)[ROWS], const unsigned char* (&m)[ROWS]) {
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            const long long row = min(first + group * ROWS + r, row_end - 1) - row_first;   // clamped: never stored
            q[r] = qs + row * qs_row;
            m[r] = meta + row * meta_row;
        }
    };
    const unsigned char* qs_r[ROWS];
    const unsigned char* meta_r[ROWS];
    row_pointers(row0, qs_r, meta_r);
    float acc[ROWS][1];
#pragma unroll
    for (int r = 0; r < ROWS; r++) acc[r][0] = 0.f;
    const int units = K / 32, dunits = (K + 63) / 64;
    constexpr int STEP = TG * UNROLL;
    auto prefetch = [&](const unsigned char* const (&q)[ROWS], const unsigned char* const (&m)[ROWS], int v0) {
#pragma unroll
        for (int j = 0; j < UNROLL; j++) {
            const int v = min(v0 + j * TG, dunits - 1);   // past the row: its last D-unit again
#pragma unroll
            for (int r = 0; r < ROWS; r++) D::prefetch(q[r], m[r], v);
        }
    };
    if (quantise) {   // block-uniform: every thread gets here
        prefetch(qs_r, meta_r, tt);   // the first pass on its way into L2, holding no register
        pdl_wait();                   // x (and y, res) belong to earlier kernels
        quantise_x<TG * GROUPS>(x, K, dunits, planes, (float2*)xmeta, (float*)(xmeta + dunits));
        __syncthreads();
    }
    for (int v0 = tt; v0 < dunits; v0 += STEP) {
        typename D::Raw raw[UNROLL][ROWS];
#pragma unroll
        for (int j = 0; j < UNROLL; j++) {
            const int v = v0 + j * TG;
            if (v < dunits) {
#pragma unroll
                for (int r = 0; r < ROWS; r++) D::load(raw[j][r], qs_r[r], meta_r[r], v, units);
            }
        }
        if (v0 + STEP < dunits) {
            prefetch(qs_r, meta_r, v0 + STEP);
        } else if (next_row0 >= 0) {   // the next tile's first pass, its rows clamped as that tile clamps them
            const unsigned char* qs_n[ROWS];
            const unsigned char* meta_n[ROWS];
            row_pointers(next_row0, qs_n, meta_n);
            prefetch(qs_n, meta_n, tt);
        }
#pragma unroll
        for (int j = 0; j < UNROLL; j++) {
            const int v = v0 + j * TG;
            if (v >= dunits) break;
            const float4 xm = xmeta[v];
            int dots[ROWS][2];
#pragma unroll
            for (int g = 0; g < 2; g++) {
                const uint4 h0 = planes[(2 * g) * dunits + v], h1 = planes[(2 * g + 1) * dunits + v];
                const uint4 l0 = planes[(4 + 2 * g) * dunits + v], l1 = planes[(5 + 2 * g) * dunits + v];
#pragma unroll
                for (int r = 0; r < ROWS; r++) {
                    int c = 0;
#pragma unroll
                    for (int i = 0; i < 4; i++) c = dp4a_us(D::nibbles(raw[j][r], 2 * g, i), word_of(h0, i), c);
#pragma unroll
                    for (int i = 0; i < 4; i++) c = dp4a_us(D::nibbles(raw[j][r], 2 * g + 1, i), word_of(h1, i), c);
                    c *= 128;   // 128 hi + lo, exact: |c| < 2^27
#pragma unroll
                    for (int i = 0; i < 4; i++) c = dp4a_us(D::nibbles(raw[j][r], 2 * g, i), word_of(l0, i), c);
#pragma unroll
                    for (int i = 0; i < 4; i++) c = dp4a_us(D::nibbles(raw[j][r], 2 * g + 1, i), word_of(l1, i), c);
                    dots[r][g] = c;
                }
            }
#pragma unroll
            for (int r = 0; r < ROWS; r++) acc[r][0] = D::apply(raw[j][r], v, dots[r][0], dots[r][1], xm, acc[r][0]);
        }
    }
    float all[GROUPS * ROWS][1];
    group_sums<ROWS, GROUPS>(acc, group, all);
    q4_gemv_epilogue<1, GROUPS * ROWS, TG * GROUPS, SILU_PAIRS>(sh, all, row0, row_end, inv_rms_in, y, ldy, res,
                                                              normw_out, xn_out, inv_rms_out, counter, eps, N, ntok,
                                                              tickets);
}

// a tile of Q6_K rows: q4_formats.cuh's units (64 weights, four groups of 16 with a scale each, levels
// 0..63 unsigned) as the float layouts take them, TG threads of a group on every TG-th unit; per group
// G = sum level (128 hi + lo) over its 16 x values, acc += s (d / 128 G - 32 sum16)
template <int ROWS, int TG, int GROUPS, int UNROLL>
__device__ __forceinline__ void q6k_tile(
        GemvSharedT<1, GROUPS * ROWS, TG * GROUPS>& sh, uint4* planes, float4* xmeta, bool quantise, int next_row0,
        const unsigned char* __restrict__ qs, const unsigned char* __restrict__ meta, int row0, int row_first,
        int row_end, const float* x, const float* inv_rms_in, float* y, int ldy, const float* res,
        const float* normw_out, float* xn_out, float* inv_rms_out, unsigned int* counter, float eps, int N, int K,
        int ntok, unsigned int tickets) {
    using F = FmtQ6_K;
    const int group = threadIdx.x / TG, tt = threadIdx.x % TG;
    const long long qs_row = F::qs_row(K), meta_row = F::meta_row(K);
    auto row_pointers = [&](int first, const unsigned char* (&q)[ROWS], const unsigned char* (&m)[ROWS]) {
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            const long long row = min(first + group * ROWS + r, row_end - 1) - row_first;   // clamped: never stored
            q[r] = qs + row * qs_row;
            m[r] = meta + row * meta_row;
        }
    };
    const unsigned char* qs_r[ROWS];
    const unsigned char* meta_r[ROWS];
    row_pointers(row0, qs_r, meta_r);
    float acc[ROWS][1];
#pragma unroll
    for (int r = 0; r < ROWS; r++) acc[r][0] = 0.f;
    const int units = K / F::UNIT, dunits = (K + 63) / 64;
    constexpr int U = (UNROLL + 1) / 2;   // three 16-byte loads a unit: half the units in flight, as tiled_part
    constexpr int STEP = TG * U;
    const float* xmeta_f = (const float*)xmeta;
    const float* sums16 = (const float*)(xmeta + dunits);
    if (quantise) {
        prefetch_pass<F, ROWS, TG, U>(qs_r, meta_r, tt, units);
        pdl_wait();
        quantise_x<TG * GROUPS>(x, K, dunits, planes, (float2*)xmeta, (float*)(xmeta + dunits));
        __syncthreads();
    }
    for (int u0 = tt; u0 < units; u0 += STEP) {
        typename F::Raw raw[U][ROWS];
        load_pass<F, ROWS, TG, U>(raw, qs_r, meta_r, u0, units);
        if (u0 + STEP < units) {
            prefetch_pass<F, ROWS, TG, U>(qs_r, meta_r, u0 + STEP, units);
        } else if (next_row0 >= 0) {
            const unsigned char* qs_n[ROWS];
            const unsigned char* meta_n[ROWS];
            row_pointers(next_row0, qs_n, meta_n);
            prefetch_pass<F, ROWS, TG, U>(qs_n, meta_n, tt, units);
        }
#pragma unroll
        for (int j = 0; j < U; j++) {
            const int u = u0 + j * TG;
            if (u >= units) break;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int e = UnitK<FmtQ6_K>::at(u, k), v = e >> 6, p = (e >> 4) & 3;   // plane p of D-unit v
                const uint4 h = planes[p * dunits + v], l = planes[(4 + p) * dunits + v];
                const float unit = xmeta_f[4 * v + 2 * (p >> 1)], bias = -32.0f * sums16[4 * v + p];
#pragma unroll
                for (int r = 0; r < ROWS; r++) {
                    Group g[4];
                    F::decode(raw[j][r], u, g);   // only group k is used: the rest is dead code here
                    int c = 0;
#pragma unroll
                    for (int i = 0; i < 4; i++) c = dp4a_us(g[k].lv[i], word_of(h, i), c);
                    c *= 128;
#pragma unroll
                    for (int i = 0; i < 4; i++) c = dp4a_us(g[k].lv[i], word_of(l, i), c);
                    acc[r][0] = fmaf(g[k].s, fmaf(unit, (float)c, bias), acc[r][0]);
                }
            }
        }
    }
    float all[GROUPS * ROWS][1];
    group_sums<ROWS, GROUPS>(acc, group, all);
    q4_gemv_epilogue<1, GROUPS * ROWS, TG * GROUPS, false>(sh, all, row0, row_end, inv_rms_in, y, ldy, res, normw_out,
                                                         xn_out, inv_rms_out, counter, eps, N, ntok, tickets);
}

template <class F, int ROWS, int TG, int GROUPS, int UNROLL, bool SILU_PAIRS>
__device__ __forceinline__ void any_tile(
        GemvSharedT<1, GROUPS * ROWS, TG * GROUPS>& sh, uint4* planes, float4* xmeta, bool quantise, int next_row0,
        const unsigned char* qs, const unsigned char* meta, int row0, int row_first, int row_end, const float* x,
        const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out, float* xn_out,
        float* inv_rms_out, unsigned int* counter, float eps, int N, int K, int ntok, unsigned int tickets) {
    if constexpr (same_format<F, FmtQ6_K>::value) {
        static_assert(!SILU_PAIRS, "no Q6_K gate/up pairs");
        q6k_tile<ROWS, TG, GROUPS, UNROLL>(sh, planes, xmeta, quantise, next_row0, qs, meta, row0, row_first,
                                           row_end, x, inv_rms_in, y, ldy, res, normw_out, xn_out, inv_rms_out,
                                           counter, eps, N, K, ntok, tickets);
    } else {
        dp4a_tile<F, ROWS, TG, GROUPS, UNROLL, SILU_PAIRS>(sh, planes, xmeta, quantise, next_row0, qs, meta, row0,
                                                           row_first, row_end, x, inv_rms_in, y, ldy, res, normw_out,
                                                           xn_out, inv_rms_out, counter, eps, N, K, ntok, tickets);
    }
}

// rows [0, rows_a) in format FA, [rows_a, N) in FB (q4_gemv.cu's contract), in tiles of TILE = GROUPS ROWS
// rows: FA's tiles first, every gridDim.x-th tile to a block
template <class FA, class FB, int ROWS, int TG, int GROUPS, int UNROLL, bool SILU_PAIRS>
__device__ __forceinline__ void q4_dp4a_body(
        const unsigned char* qs, const unsigned char* meta, const float* x, const float* inv_rms_in, float* y,
        int ldy, const float* res, const float* normw_out, float* xn_out, float* inv_rms_out, unsigned int* counter,
        float eps, int N, int K, int ntok, const unsigned char* qs_b, const unsigned char* meta_b, int rows_a) {
    constexpr int TILE = GROUPS * ROWS;
    __shared__ GemvSharedT<1, TILE, TG * GROUPS> sh;
    extern __shared__ uint4 dp4a_shared[];   // planes [8][dunits], then meta [dunits], sums16 [dunits]
    pdl_launch_dependents();
    const int dunits = (K + 63) / 64;
    uint4* planes = dp4a_shared;
    float4* xmeta = (float4*)(dp4a_shared + 8 * dunits);
    const int head_tiles = (rows_a + TILE - 1) / TILE, tiles = head_tiles + (N - rows_a + TILE - 1) / TILE;
    bool quantised = false;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        if (tile != (int)blockIdx.x) __syncthreads();   // the last tile's epilogue is done with `sh`
        const int next = tile + gridDim.x;
        if (same_format<FA, FB>::value || tile < head_tiles) {
            const int next_row0 = next < tiles && (same_format<FA, FB>::value || next < head_tiles) ? next * TILE : -1;
            any_tile<FA, ROWS, TG, GROUPS, UNROLL, SILU_PAIRS>(
                    sh, planes, xmeta, !quantised, next_row0, qs, meta, tile * TILE, 0, rows_a, x, inv_rms_in, y, ldy,
                    res, normw_out, xn_out, inv_rms_out, counter, eps, N, K, ntok, tiles);
        } else {
            const int row0 = rows_a + (tile - head_tiles) * TILE;
            const int next_row0 = next < tiles ? row0 + (int)gridDim.x * TILE : -1;
            any_tile<FB, ROWS, TG, GROUPS, UNROLL, false>(
                    sh, planes, xmeta, !quantised, next_row0, qs_b, meta_b, row0, rows_a, N, x, inv_rms_in, y, ldy,
                    res, normw_out, xn_out, inv_rms_out, counter, eps, N, K, ntok, tiles);
        }
        quantised = true;
    }
}

// THREADS threads in GROUPS groups, TILE rows a tile (TILE / GROUPS a thread), MIN_BLOCKS: the blocks per
// SM the registers must allow (ptxas's budget: 65536 / (THREADS MIN_BLOCKS) a thread)
#define DEFINE_Q4_DP4A(FA, FB, THREADS, TILE, UNROLL, GROUPS, MIN_BLOCKS, SILU, NAME)                          \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) NAME(                                 \
            const unsigned char* qs, const unsigned char* meta, const float* x, int ldx,                    \
            const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out,           \
            float* xn_out, float* inv_rms_out, unsigned int* counter, float eps, int N, int K,              \
            int ntok, const unsigned char* qs_b, const unsigned char* meta_b, int rows_a) {                 \
        q4_dp4a_body<FA, FB, (TILE) / (GROUPS), (THREADS) / (GROUPS), GROUPS, UNROLL, SILU>(                \
                qs, meta, x, inv_rms_in, y, ldy, res, normw_out, xn_out, inv_rms_out, counter, eps, N, K,   \
                ntok, qs_b, meta_b, rows_a);                                                                \
    }

// Q6_K's units hold 17 registers a row (and its four groups' levels): 3/4 of the blocks per SM, so it
// keeps them in registers (fewer blocks than the grid's cap reside; the rest follow)
#define Q6K_MIN_BLOCKS(MIN_BLOCKS) ((MIN_BLOCKS) * 3 / 4 > 0 ? (MIN_BLOCKS) * 3 / 4 : 1)

// the kernels of one layout (q4_gemv_variants.TILED_CODES): Q4_0 and Q4_K plain and SiLU pairs, Q6_K
// plain, Q4_K then Q6_K rows
#define DEFINE_Q4_DP4A_SET(THREADS, TILE, UNROLL, GROUPS, MIN_BLOCKS, SUFFIX)                                       \
    DEFINE_Q4_DP4A(FmtQ4_0, FmtQ4_0, THREADS, TILE, UNROLL, GROUPS, MIN_BLOCKS, false, q4_0_gemv_m1_##SUFFIX)       \
    DEFINE_Q4_DP4A(FmtQ4_0, FmtQ4_0, THREADS, TILE, UNROLL, GROUPS, MIN_BLOCKS, true, q4_0_gemv_m1_##SUFFIX##_silu) \
    DEFINE_Q4_DP4A(FmtQ4_K, FmtQ4_K, THREADS, TILE, UNROLL, GROUPS, MIN_BLOCKS, false, q4_k_gemv_m1_##SUFFIX)       \
    DEFINE_Q4_DP4A(FmtQ4_K, FmtQ4_K, THREADS, TILE, UNROLL, GROUPS, MIN_BLOCKS, true, q4_k_gemv_m1_##SUFFIX##_silu) \
    DEFINE_Q4_DP4A(FmtQ6_K, FmtQ6_K, THREADS, TILE, UNROLL, GROUPS, Q6K_MIN_BLOCKS(MIN_BLOCKS), false,              \
                   q6_k_gemv_m1_##SUFFIX)                                                                          \
    DEFINE_Q4_DP4A(FmtQ4_K, FmtQ6_K, THREADS, TILE, UNROLL, GROUPS, Q6K_MIN_BLOCKS(MIN_BLOCKS), false,              \
                   q4_k_q6_k_gemv_m1_##SUFFIX)
