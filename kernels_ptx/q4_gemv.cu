// Matrix-vector products (1..8 tokens) over the 4/6-bit block formats of q4_formats.cuh,
// with q8_gemv.cu's contract (argument order, inv_rms_in prologue, SiLU·mul row pairs,
// residual, xn and last-block inv_rms epilogues) plus three arguments for a weight whose
// last rows are in a second format (a fused QKV with Q6_K v rows):
//   rows [0, rows_a) in format A at (qs, meta), rows [rows_a, N) in format B at (qs_b, meta_b)
// (one format: rows_a = N).  A block owns ROWS rows of one format: the first
// ceil(rows_a / ROWS) blocks format A, the rest format B.  Kernels exist for M = 1, 2, 4, 8
// tokens (ROWS 4, 4, 2, 2: the same code size per unit); a launch for fewer tokens than its M
// leaves the missing tokens out (ntok), so 3 tokens run the M = 4 kernel.
//
//   s[m, n] = sum over groups of 16: s_g * sum_i (level_i - BIAS) x[m, k_g + i]  (- o_g sum_i x[m, k_g + i])
//
// Threads of a block take the units of a row in turn (q4_formats.cuh), all ROWS rows' loads of a
// unit in flight at once (the layout the tiled kernels of q4_gemv_m1.cu / q4_gemv_mn.cu are measured
// against: block_kernels.py's variant ""); the weights of the first unit are loaded before pdl_wait (common.cuh).
// embed_<fmt>: the embedding gather of the embed kernel (elementwise.cu's embed_q8) for a table
// in a block format, the values of quant4.dequantize_blocks exactly (products not contracted).
#include "common.cuh"
#include "q4_formats.cuh"
#include "block_dots.cuh"
#include "q4_gemv_epilogue.cuh"

#define GEMV_THREADS 64

// rows per block of the M-token kernel (cuda/block_kernels.py: gemv_rows)
template <int M> struct GemvRows { static constexpr int value = M <= 2 ? 4 : 2; };

// rows [row0, row0 + ROWS) of one format part whose rows start at row_first (its qs/meta row 0) and
// end at row_end; y columns are the weight's global row numbers
template <class F, int M, bool SILU_PAIRS>
__device__ __forceinline__ void gemv_part(
        GemvSharedT<M, GemvRows<M>::value, GEMV_THREADS>& sh, const unsigned char* __restrict__ qs,
        const unsigned char* __restrict__ meta, int row0, int row_first, int row_end, const float* x, int ldx,
        const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out, float* xn_out,
        float* inv_rms_out, unsigned int* counter, float eps, int N, int K, int ntok) {
    constexpr int ROWS = GemvRows<M>::value, THREADS = GEMV_THREADS;
    const long long qs_row = F::qs_row(K), meta_row = F::meta_row(K);
    float acc[ROWS][M];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int m = 0; m < M; m++) acc[r][m] = 0.f;

    const int units = K / F::UNIT;
    for (int u = threadIdx.x; u < units; u += THREADS) {
        typename F::Raw raw[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            const long long row = min(row0 + r, row_end - 1) - row_first;   // a clamped row is never stored
            F::load(raw[r], qs + row * qs_row, meta + row * meta_row, u);
        }
        if (u == (int)threadIdx.x) pdl_wait();   // x (and y, res) belong to earlier kernels
#pragma unroll
        for (int r = 0; r < ROWS; r++) unit_dots<F, M>(raw[r], u, StridedRows{x, ldx}, ntok, acc[r]);
    }

    q4_gemv_epilogue<M, ROWS, THREADS, SILU_PAIRS>(sh, acc, row0, row_end, inv_rms_in, y, ldy, res, normw_out,
                                                 xn_out, inv_rms_out, counter, eps, N, ntok);
}

template <class FA, class FB, int M, bool SILU_PAIRS>
__device__ __forceinline__ void q4_gemv_body(
        const unsigned char* qs, const unsigned char* meta, const float* x, int ldx, const float* inv_rms_in,
        float* y, int ldy, const float* res, const float* normw_out, float* xn_out, float* inv_rms_out,
        unsigned int* counter, float eps, int N, int K, int ntok, const unsigned char* qs_b,
        const unsigned char* meta_b, int rows_a) {
    __shared__ GemvSharedT<M, GemvRows<M>::value, GEMV_THREADS> sh;
    pdl_launch_dependents();
    constexpr int ROWS = GemvRows<M>::value;
    const int head_blocks = (rows_a + ROWS - 1) / ROWS;
    if (same_format<FA, FB>::value || (int)blockIdx.x < head_blocks) {
        gemv_part<FA, M, SILU_PAIRS>(sh, qs, meta, blockIdx.x * ROWS, 0, rows_a, x, ldx, inv_rms_in, y, ldy,
                                     res, normw_out, xn_out, inv_rms_out, counter, eps, N, K, ntok);
    } else {
        gemv_part<FB, M, SILU_PAIRS>(sh, qs_b, meta_b, rows_a + (blockIdx.x - head_blocks) * ROWS, rows_a, N,
                                     x, ldx, inv_rms_in, y, ldy, res, normw_out, xn_out, inv_rms_out, counter, eps,
                                     N, K, ntok);
    }
}

#define DEFINE_Q4_GEMV(FA, FB, M, SILU, NAME)                                                       \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) NAME(                               \
            const unsigned char* qs, const unsigned char* meta, const float* x, int ldx,           \
            const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out,  \
            float* xn_out, float* inv_rms_out, unsigned int* counter, float eps, int N, int K,     \
            int ntok, const unsigned char* qs_b, const unsigned char* meta_b, int rows_a) {        \
        q4_gemv_body<FA, FB, M, SILU>(qs, meta, x, ldx, inv_rms_in, y, ldy, res, normw_out, xn_out, \
                                      inv_rms_out, counter, eps, N, K, ntok, qs_b, meta_b, rows_a); \
    }
// one format: plain and SiLU pairs; Q4_K then Q6_K rows (QKV of Q4_K_M files): plain only
#define DEFINE_Q4_GEMV_M(M)                                                     \
    DEFINE_Q4_GEMV(FmtQ4_0, FmtQ4_0, M, false, q4_0_gemv_m##M)                 \
    DEFINE_Q4_GEMV(FmtQ4_0, FmtQ4_0, M, true, q4_0_gemv_m##M##_silu)           \
    DEFINE_Q4_GEMV(FmtQ4_K, FmtQ4_K, M, false, q4_k_gemv_m##M)                 \
    DEFINE_Q4_GEMV(FmtQ4_K, FmtQ4_K, M, true, q4_k_gemv_m##M##_silu)           \
    DEFINE_Q4_GEMV(FmtQ6_K, FmtQ6_K, M, false, q6_k_gemv_m##M)                 \
    DEFINE_Q4_GEMV(FmtQ6_K, FmtQ6_K, M, true, q6_k_gemv_m##M##_silu)           \
    DEFINE_Q4_GEMV(FmtQ4_K, FmtQ6_K, M, false, q4_k_q6_k_gemv_m##M)

DEFINE_Q4_GEMV_M(1)
DEFINE_Q4_GEMV_M(2)
DEFINE_Q4_GEMV_M(4)
DEFINE_Q4_GEMV_M(8)

template <class F>
__device__ __forceinline__ void q4_embed_body(const unsigned char* qs, const unsigned char* meta, const int* ids,
                                              float* out, float* xn, const float* normw, float* inv_rms, float eps,
                                              int H) {
    __shared__ float warp_sums[8];
    pdl_launch_dependents();
    pdl_wait();   // see common.cuh
    const int t = blockIdx.x;
    const long long row = ids[t];
    float sq = 0.f;
    for (int u = threadIdx.x; u < H / F::UNIT; u += blockDim.x) {
        typename F::Raw raw;
        F::load(raw, qs + row * F::qs_row(H), meta + row * F::meta_row(H), u);
        Group g[F::GROUPS];
        F::decode(raw, u, g);
#pragma unroll
        for (int gi = 0; gi < F::GROUPS; gi++)
#pragma unroll
            for (int i = 0; i < 16; i++) {
                const float v = __fsub_rn(__fmul_rn(g[gi].s, level_float(g[gi].lv[i >> 2], i & 3, (float)F::BIAS)),
                                          g[gi].o);
                const int k = g[gi].k + i;
                out[(long long)t * H + k] = v;
                xn[(long long)t * H + k] = v * normw[k];
                sq += v * v;
            }
    }
    sq = warp_sum(sq);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sq;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) total += warp_sums[w];
        inv_rms[t] = 1.0f / sqrtf(total / (float)H + eps);
    }
}

#define DEFINE_Q4_EMBED(F, NAME)                                                                    \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                         \
            const unsigned char* qs, const unsigned char* meta, const int* ids, float* out, float* xn, \
            const float* normw, float* inv_rms, float eps, int H) {                                 \
        q4_embed_body<F>(qs, meta, ids, out, xn, normw, inv_rms, eps, H);                           \
    }
DEFINE_Q4_EMBED(FmtQ4_0, embed_q4_0)
DEFINE_Q4_EMBED(FmtQ4_K, embed_q4_k)
DEFINE_Q4_EMBED(FmtQ6_K, embed_q6_k)
