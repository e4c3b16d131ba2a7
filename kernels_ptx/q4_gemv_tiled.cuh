// The tiled block-format GEMV (q4_gemv_m1.cu for one token, q4_gemv_mn.cu for 2..8): q4_gemv.cu's
// contract and image layout, with the work laid out as a named variant of THREADS x ROWS x UNROLL
// (kestrel_stream/cuda/q4_gemv_variants.py): a block of THREADS threads owns ROWS rows of one format,
// each thread keeps ROWS * UNROLL units' weight loads in flight (a unit: 16 B of nibbles, or Q6_K's
// 3 x 16 B, of which half the UNROLL, rounded up) and takes every THREADS-th unit of the row.
//
// What the old kernel spent per weight beyond the multiply-add, and where it goes here:
// - x shared by the rows (t layouts: one token; g: 2..8): each group's 16 x values per token are loaded
//   once and, for Q4_K's mins at one token, summed once, then serve all ROWS rows (q4_gemv.cu reloads
//   and re-sums them per row); at 2..8 tokens Q4_K's weights are dequantized once (s * level - o) and
//   need no x sums at all;
// - row-outer (o layouts, 2..8 tokens): one row's weights as floats at a time serve every token, x
//   re-read from L1 per row, so registers hold one row's 16 weights instead of ROWS' and more warps
//   stay resident (q8_gemv.cu's o layouts), at ROWS times the L1 traffic of the g layouts.
// - Q4_K's scale block: decoded four scales to a word instead of one at a time (TiledDecode).
// Arithmetic: fp32 x, weights exact in fp32 (levels and scales as quant4.group_form), fp32 sums
// (the numpy twin: x @ dequantize(W).T within 1e-5 of the largest output).
#pragma once
// (include common.cuh, q4_formats.cuh and q4_gemv_epilogue.cuh first: build.py splices one level deep)

// the first element (within the row) of group gi of unit u: what F::decode puts in Group::k
template <class F> struct UnitK;
template <> struct UnitK<FmtQ4_0> {
    static __device__ __forceinline__ int at(int u, int gi) { return 32 * u + 16 * gi; }
};
template <> struct UnitK<FmtQ4_K> {
    static __device__ __forceinline__ int at(int u, int gi) {
        const int c = u & 7;
        return 256 * (u >> 3) + 64 * (c >> 1) + 32 * gi + 16 * (c & 1);
    }
};
template <> struct UnitK<FmtQ6_K> {
    static __device__ __forceinline__ int at(int u, int gi) {
        return 256 * (u >> 2) + 128 * ((u >> 1) & 1) + 32 * gi + 16 * (u & 1);
    }
};

// F::decode, except for Q4_K: its 6-bit scales and mins decoded for all eight sub-blocks at once as
// bytes (four words, no branch on the sub-block), and the high nibbles left in place: level byte
// 16 q, scale s / 16 (exact: a power of two), so s * dot is the same number
template <class F> struct TiledDecode {
    static __device__ __forceinline__ void run(const typename F::Raw& r, int u, Group (&g)[F::GROUPS]) {
        F::decode(r, u, g);
    }
};
template <> struct TiledDecode<FmtQ4_K> {
    static __device__ __forceinline__ void run(const FmtQ4_K::Raw& r, int u, Group (&g)[2]) {
        const int c = u & 7, pair = c >> 1;   // sub-blocks 2 pair (low nibbles), 2 pair + 1 (high)
        const unsigned int w[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            g[0].lv[i] = w[i] & 0x0F0F0F0Fu;
            g[1].lv[i] = w[i] & 0xF0F0F0F0u;
        }
        // ggml's get_scale_min_k4 for j = 0..3 (bytes of *_lo) and 4..7 (*_hi)
        const unsigned int sc_lo = r.m.y & 0x3F3F3F3Fu, mn_lo = r.m.z & 0x3F3F3F3Fu;
        const unsigned int sc_hi = (r.m.w & 0x0F0F0F0Fu) | ((r.m.y >> 2) & 0x30303030u);
        const unsigned int mn_hi = ((r.m.w >> 4) & 0x0F0F0F0Fu) | ((r.m.z >> 2) & 0x30303030u);
        const unsigned int sc = pair < 2 ? sc_lo : sc_hi, mn = pair < 2 ? mn_lo : mn_hi;
        const int b = (2 * pair) & 3;
        const float d = half_to_float((half_bits)(r.m.x & 0xFFFFu)), dmin = half_to_float((half_bits)(r.m.x >> 16));
        g[0].s = __fmul_rn(d, level_float(sc, b, 0.f));
        g[0].o = __fmul_rn(dmin, level_float(mn, b, 0.f));
        g[1].s = __fmul_rn(d, level_float(sc, b + 1, 0.f)) * 0.0625f;
        g[1].o = __fmul_rn(dmin, level_float(mn, b + 1, 0.f));
        g[0].k = UnitK<FmtQ4_K>::at(u, 0);
        g[1].k = UnitK<FmtQ4_K>::at(u, 1);
    }
};

__device__ __forceinline__ float4 load_x4_l1(const float* p) {
    // an L1-cached load of x the compiler may not merge with the same load for another row
    float4 v;
    asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

// Q4_K's levels as subnormal floats (the p layouts): the level byte L zero-extended is the float
// L * 2^-149, so with x scaled by X_SCALE = 2^96 the fma takes L * x * 2^-53 exactly, and the scale,
// times S_SCALE = 2^53 (exact), undoes it: the same sums as L * x, one PRMT and one FFMA a weight
// instead of PRMT, FADD and FFMA.  Only where the result of a product or sum falls below 2^-126
// (|sum| < 2^-73 unscaled) does it round differently, by at most 2^-97; x must stay below 2^32.
struct Subnormal { static constexpr float X_SCALE = 0x1p96f, S_SCALE = 0x1p53f; };

__device__ __forceinline__ float level_subnormal(unsigned int word, int which) {
    return __int_as_float(__byte_perm(word, 0u, 0x4440 + which));
}

// one token: a group's 16 x values in registers (and their sum, for the mins) against every row's
// group, one group at a time, levels made floats as the fmas take them (registers: 16 x values)
template <class F, int ROWS, bool SUB = false>
__device__ __forceinline__ void unit_rows_m1(const typename F::Raw (&raw)[ROWS], int u, const float* x,
                                             float (&acc)[ROWS][1]) {
    static_assert(!SUB || (F::BIAS == 0 && F::MINS), "subnormal levels: unbiased levels (Q4_K) only");
#pragma unroll
    for (int gi = 0; gi < F::GROUPS; gi++) {
        const float4* xp = (const float4*)(x + UnitK<F>::at(u, gi));
        float xv[16], xsum = 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float4 v = xp[i];
            xv[4 * i] = v.x;
            xv[4 * i + 1] = v.y;
            xv[4 * i + 2] = v.z;
            xv[4 * i + 3] = v.w;
            if (F::MINS) xsum += (v.x + v.y) + (v.z + v.w);
        }
        if (SUB) {
#pragma unroll
            for (int i = 0; i < 16; i++) xv[i] *= Subnormal::X_SCALE;
        }
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            Group g[F::GROUPS];
            TiledDecode<F>::run(raw[r], u, g);   // only group gi is used: the rest is dead code here
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < 16; i++) {
                const float level = SUB ? level_subnormal(g[gi].lv[i >> 2], i & 3)
                                        : level_float(g[gi].lv[i >> 2], i & 3, (float)F::BIAS);
                dot = fmaf(level, xv[i], dot);
            }
            acc[r][0] = fmaf(SUB ? g[gi].s * Subnormal::S_SCALE : g[gi].s, dot, acc[r][0]);
            if (F::MINS) acc[r][0] = fmaf(-g[gi].o, xsum, acc[r][0]);
        }
    }
}

// 2..8 tokens, x shared by the rows: one group at a time, every row's 16 weights of the group as floats
// (Q4_K: dequantized, s * level - o, so no x sums), then each token's 16 x values, loaded once for all
// ROWS rows, against them
template <class F, int M, int ROWS>
__device__ __forceinline__ void unit_rows_shared(const typename F::Raw (&raw)[ROWS], int u, const float* x,
                                                 int ldx, int ntok, float (&acc)[ROWS][M]) {
    static_assert(M > 1, "one token: unit_rows_m1");
#pragma unroll
    for (int gi = 0; gi < F::GROUPS; gi++) {
        float wf[ROWS][16], s[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            Group g[F::GROUPS];
            TiledDecode<F>::run(raw[r], u, g);   // only group gi is used: the rest is dead code here
            s[r] = g[gi].s;
#pragma unroll
            for (int i = 0; i < 16; i++) {
                const float level = level_float(g[gi].lv[i >> 2], i & 3, (float)F::BIAS);
                wf[r][i] = F::MINS ? fmaf(g[gi].s, level, -g[gi].o) : level;
            }
        }
#pragma unroll
        for (int m = 0; m < M; m++) {
            if (m >= ntok) break;   // uniform: the kernel of the next M up runs ntok < M tokens
            const float4* xp = (const float4*)(x + (long long)m * ldx + UnitK<F>::at(u, gi));
            float xv[16];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float4 v = xp[i];
                xv[4 * i] = v.x;
                xv[4 * i + 1] = v.y;
                xv[4 * i + 2] = v.z;
                xv[4 * i + 3] = v.w;
            }
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < 16; i++) dot = fmaf(wf[r][i], xv[i], dot);
                acc[r][m] = F::MINS ? acc[r][m] + dot : fmaf(s[r], dot, acc[r][m]);
            }
        }
    }
}

// 2..8 tokens: one row's weights as floats at a time, each token's x read from L1 against them
template <class F, int M, int ROWS>
__device__ __forceinline__ void unit_rows_outer(const typename F::Raw (&raw)[ROWS], int u, const float* x,
                                                int ldx, int ntok, float (&acc)[ROWS][M]) {
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        Group g[F::GROUPS];
        TiledDecode<F>::run(raw[r], u, g);
#pragma unroll
        for (int gi = 0; gi < F::GROUPS; gi++) {
            float wf[16];   // Q4_K: s * level - o (the weight); else the level, s applied to the dot
#pragma unroll
            for (int i = 0; i < 16; i++) {
                const float level = level_float(g[gi].lv[i >> 2], i & 3, (float)F::BIAS);
                wf[i] = F::MINS ? fmaf(g[gi].s, level, -g[gi].o) : level;
            }
#pragma unroll
            for (int m = 0; m < M; m++) {
                if (m >= ntok) break;   // uniform: the kernel of the next M up runs ntok < M tokens
                const float* xp = x + (long long)m * ldx + g[gi].k;
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const float4 v = load_x4_l1(xp + 4 * i);
                    dot = fmaf(wf[4 * i], v.x, dot);
                    dot = fmaf(wf[4 * i + 1], v.y, dot);
                    dot = fmaf(wf[4 * i + 2], v.z, dot);
                    dot = fmaf(wf[4 * i + 3], v.w, dot);
                }
                acc[r][m] = F::MINS ? acc[r][m] + dot : fmaf(g[gi].s, dot, acc[r][m]);
            }
        }
    }
}

// the weight loads of one pass: units u0 + j THREADS (j < U) of each row, those past the row skipped
template <class F, int ROWS, int THREADS, int U>
__device__ __forceinline__ void load_pass(typename F::Raw (&raw)[U][ROWS], const unsigned char* const (&qs_r)[ROWS],
                                          const unsigned char* const (&meta_r)[ROWS], int u0, int units) {
#pragma unroll
    for (int j = 0; j < U; j++) {
        const int u = u0 + j * THREADS;
        if (u < units) {
#pragma unroll
            for (int r = 0; r < ROWS; r++) F::load(raw[j][r], qs_r[r], meta_r[r], u);
        }
    }
}

// the p layouts: the next pass's units requested into L2 as this pass's loads go out, so that pass's
// loads wait for an L2 hit, not for HBM (the compiler issues a load only a short way ahead of its
// math; a prefetch holds no register).  Units past the row: the row's last unit again (no branch).
template <class F, int ROWS, int THREADS, int U>
__device__ __forceinline__ void prefetch_pass(const unsigned char* const (&qs_r)[ROWS],
                                              const unsigned char* const (&meta_r)[ROWS], int u0, int units) {
#pragma unroll
    for (int j = 0; j < U; j++) {
        const int u = min(u0 + j * THREADS, units - 1);
#pragma unroll
        for (int r = 0; r < ROWS; r++) F::prefetch(qs_r[r], meta_r[r], u);
    }
}

// the math of one pass (SUB: Q4_K's levels as subnormals, at one token)
template <class F, int M, int ROWS, int THREADS, int U, bool ROW_OUTER, bool SUB>
__device__ __forceinline__ void math_pass(const typename F::Raw (&raw)[U][ROWS], int u0, int units, const float* x,
                                          int ldx, int ntok, float (&acc)[ROWS][M]) {
#pragma unroll
    for (int j = 0; j < U; j++) {
        const int u = u0 + j * THREADS;
        if (u >= units) break;
        if constexpr (ROW_OUTER) unit_rows_outer<F, M, ROWS>(raw[j], u, x, ldx, ntok, acc);
        else if constexpr (M == 1) unit_rows_m1<F, ROWS, SUB>(raw[j], u, x, acc);
        else unit_rows_shared<F, M, ROWS>(raw[j], u, x, ldx, ntok, acc);
    }
}

// rows [row0, row0 + ROWS) of one format part whose rows start at row_first and end at row_end
template <class F, int M, int ROWS, int THREADS, int UNROLL, bool ROW_OUTER, bool SILU_PAIRS, bool PREFETCH>
__device__ __forceinline__ void tiled_part(
        GemvSharedT<M, ROWS, THREADS>& sh, const unsigned char* __restrict__ qs,
        const unsigned char* __restrict__ meta, int row0, int row_first, int row_end, const float* x, int ldx,
        const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out, float* xn_out,
        float* inv_rms_out, unsigned int* counter, float eps, int N, int K, int ntok) {
    const long long qs_row = F::qs_row(K), meta_row = F::meta_row(K);
    const unsigned char* qs_r[ROWS];
    const unsigned char* meta_r[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const long long row = min(row0 + r, row_end - 1) - row_first;   // a clamped row is never stored
        qs_r[r] = qs + row * qs_row;
        meta_r[r] = meta + row * meta_row;
    }
    float acc[ROWS][M];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int m = 0; m < M; m++) acc[r][m] = 0.f;

    // a Q6_K unit is three 16-byte loads and 17 registers: half the units in flight (rounded up)
    constexpr int U = F::UNIT == 64 ? (UNROLL + 1) / 2 : UNROLL;
    constexpr int STEP = THREADS * U;   // units of a row one pass of the block covers
    const int units = K / F::UNIT;
    static_assert(!PREFETCH || (M == 1 && !ROW_OUTER), "the p layouts are one-token ones");
    for (int u0 = threadIdx.x; u0 < units; u0 += STEP) {
        typename F::Raw raw[U][ROWS];
        load_pass<F, ROWS, THREADS, U>(raw, qs_r, meta_r, u0, units);
        if (PREFETCH && u0 + STEP < units) prefetch_pass<F, ROWS, THREADS, U>(qs_r, meta_r, u0 + STEP, units);
        if (u0 == (int)threadIdx.x) pdl_wait();   // x (and y, res) belong to earlier kernels
        math_pass<F, M, ROWS, THREADS, U, ROW_OUTER, PREFETCH && F::MINS>(raw, u0, units, x, ldx, ntok, acc);
    }
    q4_gemv_epilogue<M, ROWS, THREADS, SILU_PAIRS>(sh, acc, row0, row_end, inv_rms_in, y, ldy, res, normw_out,
                                                 xn_out, inv_rms_out, counter, eps, N, ntok);
}

template <class FA, class FB, int M, int ROWS, int THREADS, int UNROLL, bool ROW_OUTER, bool SILU_PAIRS,
          bool PREFETCH>
__device__ __forceinline__ void q4_tiled_body(
        const unsigned char* qs, const unsigned char* meta, const float* x, int ldx, const float* inv_rms_in,
        float* y, int ldy, const float* res, const float* normw_out, float* xn_out, float* inv_rms_out,
        unsigned int* counter, float eps, int N, int K, int ntok, const unsigned char* qs_b,
        const unsigned char* meta_b, int rows_a) {
    __shared__ GemvSharedT<M, ROWS, THREADS> sh;
    pdl_launch_dependents();
    const int head_blocks = (rows_a + ROWS - 1) / ROWS;
    if (same_format<FA, FB>::value || (int)blockIdx.x < head_blocks) {
        tiled_part<FA, M, ROWS, THREADS, UNROLL, ROW_OUTER, SILU_PAIRS, PREFETCH>(
                sh, qs, meta, blockIdx.x * ROWS, 0, rows_a, x, ldx, inv_rms_in, y, ldy, res, normw_out, xn_out,
                inv_rms_out, counter, eps, N, K, ntok);
    } else {
        tiled_part<FB, M, ROWS, THREADS, UNROLL, ROW_OUTER, SILU_PAIRS, PREFETCH>(
                sh, qs_b, meta_b, rows_a + (blockIdx.x - head_blocks) * ROWS, rows_a, N, x, ldx, inv_rms_in, y,
                ldy, res, normw_out, xn_out, inv_rms_out, counter, eps, N, K, ntok);
    }
}

#define DEFINE_Q4_TILED(FA, FB, M, THREADS, ROWS, UNROLL, ROW_OUTER, SILU, PREFETCH, NAME)                  \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(                                             \
            const unsigned char* qs, const unsigned char* meta, const float* x, int ldx,                    \
            const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out,           \
            float* xn_out, float* inv_rms_out, unsigned int* counter, float eps, int N, int K,              \
            int ntok, const unsigned char* qs_b, const unsigned char* meta_b, int rows_a) {                 \
        q4_tiled_body<FA, FB, M, ROWS, THREADS, UNROLL, ROW_OUTER, SILU, PREFETCH>(                         \
                qs, meta, x, ldx, inv_rms_in, y, ldy, res, normw_out, xn_out, inv_rms_out, counter, eps,    \
                N, K, ntok, qs_b, meta_b, rows_a);                                                          \
    }

// the (format, tail format, SiLU) kernels of one layout (q4_gemv_variants.TILED_CODES): Q4_0 and Q4_K
// plain and SiLU pairs, Q6_K plain, Q4_K then Q6_K rows (a Q4_K_M file's QKV)
#define DEFINE_Q4_TILED_SET_AS(M, THREADS, ROWS, UNROLL, ROW_OUTER, PREFETCH, SUFFIX)                       \
    DEFINE_Q4_TILED(FmtQ4_0, FmtQ4_0, M, THREADS, ROWS, UNROLL, ROW_OUTER, false, PREFETCH,                 \
                    q4_0_gemv_m##M##_##SUFFIX)                                                              \
    DEFINE_Q4_TILED(FmtQ4_0, FmtQ4_0, M, THREADS, ROWS, UNROLL, ROW_OUTER, true, PREFETCH,                  \
                    q4_0_gemv_m##M##_##SUFFIX##_silu)                                                       \
    DEFINE_Q4_TILED(FmtQ4_K, FmtQ4_K, M, THREADS, ROWS, UNROLL, ROW_OUTER, false, PREFETCH,                 \
                    q4_k_gemv_m##M##_##SUFFIX)                                                              \
    DEFINE_Q4_TILED(FmtQ4_K, FmtQ4_K, M, THREADS, ROWS, UNROLL, ROW_OUTER, true, PREFETCH,                  \
                    q4_k_gemv_m##M##_##SUFFIX##_silu)                                                       \
    DEFINE_Q4_TILED(FmtQ6_K, FmtQ6_K, M, THREADS, ROWS, UNROLL, ROW_OUTER, false, PREFETCH,                 \
                    q6_k_gemv_m##M##_##SUFFIX)                                                              \
    DEFINE_Q4_TILED(FmtQ4_K, FmtQ6_K, M, THREADS, ROWS, UNROLL, ROW_OUTER, false, PREFETCH,                 \
                    q4_k_q6_k_gemv_m##M##_##SUFFIX)
#define DEFINE_Q4_TILED_SET(M, THREADS, ROWS, UNROLL, ROW_OUTER, SUFFIX)                                    \
    DEFINE_Q4_TILED_SET_AS(M, THREADS, ROWS, UNROLL, ROW_OUTER, false, SUFFIX)
// the p layouts (one token): the next pass's units prefetched into L2, Q4_K's levels as subnormals
#define DEFINE_Q4_PREFETCH_SET(M, THREADS, ROWS, UNROLL, SUFFIX) \
    DEFINE_Q4_TILED_SET_AS(M, THREADS, ROWS, UNROLL, false, true, SUFFIX)
