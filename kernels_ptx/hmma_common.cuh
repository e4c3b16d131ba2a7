// What the fp16 tensor-core GEMVs of few tokens share (q8_gemv_hmma.cu for Q8_0, q4k_ and q6k_gemv_hmma.cu for
// the K-quants): the weight loads, x as hi + lo fp16 pairs, the m16n8k16 mma, the epilogue of q8_gemv.cu over a
// block's C fragments (SiLU·mul of (gate, up) row pairs, residual, xn, per-token sums of squares and their
// last-block 1/rms: `counter` [0] the ticket, floats [8 .. 8 + ntok) the sums, GEMV_COUNTER_BYTES), and the
// K-quants' body over whole super-blocks (hmma_superblock_body, given a format's loads and step).
#pragma once
// (include common.cuh first: build.py splices includes one level deep)

__device__ __forceinline__ uint2 hmma_load8(const void* p) {
    // weights are read once per step: keep them out of L1, which holds x
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

__device__ __forceinline__ unsigned int hmma_f16x2(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));   // first source -> upper half
    return r;
}

// x = hi + lo in two fp16 pairs: hi is x with its low 13 mantissa bits cleared (exact in fp16), lo =
// fp16(x - hi) (x - hi exact in fp32): x to ~2^-22, where fp16 alone is 2^-11 (batches would then differ
// from one token's fp32 GEMV by ~4e-4 at the logits).
__device__ __forceinline__ void hmma_split(float a, float b, unsigned int& hi, unsigned int& lo) {
    const float ah = __uint_as_float(__float_as_uint(a) & 0xFFFFE000u), bh = __uint_as_float(__float_as_uint(b) & 0xFFFFE000u);
    hi = hmma_f16x2(ah, bh);
    lo = hmma_f16x2(a - ah, b - bh);
}

__device__ __forceinline__ void hmma_mma(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float hmma_silu_mul(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

// acc = 0
template <int RT, int NT>
__device__ __forceinline__ void hmma_zero(float (&acc)[RT][NT][4]) {
#pragma unroll
    for (int i = 0; i < RT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;
}

// the thread's x rows (tokens 8 j + g, offset by `lane_offset` elements) and their inv_rms_in; 0 past ntok
// (their B columns are zero).  After pdl_wait: x and inv_rms_in belong to earlier kernels.
template <int NT>
__device__ __forceinline__ void hmma_x_rows(const float* x, int ldx, const float* inv_rms_in, int ntok, int g,
                                            int lane_offset, const float* (&xrow)[NT], float (&xscale)[NT]) {
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const int m = 8 * j + g;
        xscale[j] = m < ntok ? (inv_rms_in ? inv_rms_in[m] : 1.0f) : 0.f;
        xrow[j] = x + (long long)min(m, ntok - 1) * ldx + lane_offset;
    }
}

// The block's C fragments acc[i][j] (row tile i: rows row0 + 16 i + g (+ 8), token group j: tokens 8 j + 2 t,
// + 1), summed over its WK warps in a fixed order (the result does not depend on timing), then written with the
// epilogues; returns early in every block but the last when inv_rms_out is set.
template <int NT, int RT, int WK, bool SILU_PAIRS>
__device__ __forceinline__ void hmma_epilogue(const float (&acc)[RT][NT][4], int row0, float* y, int ldy,
                                              const float* res, const float* normw_out, float* xn_out,
                                              float* inv_rms_out, unsigned int* counter, float eps, int N, int ntok) {
    constexpr int THREADS = 32 * WK, TOK = 8 * NT, ROWS = 16 * RT, OUTS = SILU_PAIRS ? ROWS / 2 : ROWS;
    __shared__ float4 part[WK][RT][NT][32];   // each warp's C fragments
    __shared__ float sums[ROWS][TOK];         // the block's rows x tokens, over the warps
    __shared__ float squares[OUTS][TOK];
    __shared__ bool is_last_block;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // C fragment (i, j): (row 16 i + g, tokens 8j + 2t, 8j + 2t + 1) in [0], [1]; row 16 i + g + 8 in [2], [3]
#pragma unroll
    for (int i = 0; i < RT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
            part[warp][i][j][lane] = make_float4(acc[i][j][0], acc[i][j][1], acc[i][j][2], acc[i][j][3]);
    __syncthreads();
    for (int q = threadIdx.x; q < ROWS * TOK; q += THREADS) {
        const int r = q / TOK, n = q % TOK, i = r >> 4, rr = r & 15, j = n >> 3, nn = n & 7;
        const int src = (rr & 7) * 4 + (nn >> 1), e = (rr >> 3) * 2 + (nn & 1);
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < WK; w++) s += ((const float*)&part[w][i][j][src])[e];
        sums[r][n] = s;
    }
    __syncthreads();
    for (int q = threadIdx.x; q < OUTS * TOK; q += THREADS) {
        const int r = q / TOK, n = q % TOK;
        const int col = SILU_PAIRS ? row0 / 2 + r : row0 + r;
        float s = 0.f;
        if (n < ntok && col < (SILU_PAIRS ? N / 2 : N)) {
            s = SILU_PAIRS ? hmma_silu_mul(sums[2 * r][n], sums[2 * r + 1][n]) : sums[r][n];
            const long long at = (long long)n * ldy + col;
            if (res) s += res[at];
            y[at] = s;
            if (xn_out) xn_out[at] = s * normw_out[col];
        }
        squares[r][n] = s * s;   // rows past N and tokens past ntok add 0
    }
    if (inv_rms_out == nullptr) return;

    float* totals = (float*)(counter + 8);
    __syncthreads();
    if (threadIdx.x < ntok) {   // the block's squares of a token, in row order
        float sq = 0.f;
#pragma unroll
        for (int r = 0; r < OUTS; r++) sq += squares[r][threadIdx.x];
        atomicAdd(totals + threadIdx.x, sq);
    }
    __threadfence();   // the sums land before the ticket is taken
    __syncthreads();
    if (threadIdx.x == 0) is_last_block = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!is_last_block) return;
    __threadfence();
    if (threadIdx.x < ntok) {
        const float total = atomicExch(totals + threadIdx.x, 0.f);   // read at L2, and zeroed for the next launch
        inv_rms_out[threadIdx.x] = 1.0f / sqrtf(total / (float)N + eps);   // as q8_gemv.cu
    }
    if (threadIdx.x == 0) *counter = 0u;
}

// The K-quant GEMVs' body: a block owns 16 RT rows and WK warps; warp w takes a contiguous run of the rows'
// super-blocks (256 elements), one a step, the next step's loads after this step's mma (the first step's before
// pdl_wait); PIPE: two super-blocks' loads in flight, the next one's issued before this one's mma.  F: a format of q4k_gemv_hmma.cu / q6k_gemv_hmma.cu with
//   Raw<RT>: one step's registers;  qs_row(K), meta_row(K): bytes a row;  Q_LANE, X_LANE: qs bytes and x elements
//   between threads t (qs rows and x rows come offset by them);
//   load<RT>(qs rows, meta rows, sb, Raw&);  step<NT, RT>(Raw, sb, x rows (+ X_LANE t), scales, acc).
template <class F, int NT, int RT, int WK, bool SILU_PAIRS, bool PIPE>
__device__ __forceinline__ void hmma_superblock_body(
        const unsigned char* __restrict__ qs, const unsigned char* __restrict__ meta, const float* x, int ldx,
        const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out, float* xn_out,
        float* inv_rms_out, unsigned int* counter, float eps, int N, int K, int ntok) {
    constexpr int ROWS = 16 * RT;
    pdl_launch_dependents();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * ROWS;
    const int supers = K >> 8;
    // tile i's rows row0 + 16 i + g (h 0) and + 8 (h 1); a clamped row computes garbage that is never stored
    const unsigned char* qp[RT][2];
    const unsigned char* mp[RT][2];
#pragma unroll
    for (int i = 0; i < RT; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const long long row = min(row0 + 16 * i + 8 * h + g, N - 1);
            qp[i][h] = qs + row * F::qs_row(K) + F::Q_LANE * t;
            mp[i][h] = meta + row * F::meta_row(K);
        }

    float acc[RT][NT][4];
    hmma_zero(acc);

    const int per = (supers + WK - 1) / WK, first = warp * per, last = min(supers, first + per);
    typename F::template Raw<RT> raw;
    if (first < last) F::template load<RT>(qp, mp, first, raw);   // weights: before pdl_wait
    if constexpr (PIPE) {
        typename F::template Raw<RT> raw2;   // the second buffer: super-block sb + 1 in flight while sb computes
        if (first + 1 < last) F::template load<RT>(qp, mp, first + 1, raw2);
        pdl_wait();   // x and inv_rms_in belong to earlier kernels
        float xscale[NT];
        const float* xrow[NT];
        hmma_x_rows(x, ldx, inv_rms_in, ntok, g, F::X_LANE * t, xrow, xscale);
        for (int sb = first; sb < last; sb += 2) {   // the same super-blocks in the same order as below
            F::template step<NT, RT>(raw, sb, xrow, xscale, acc);
            if (sb + 2 < last) F::template load<RT>(qp, mp, sb + 2, raw);
            if (sb + 1 >= last) break;
            F::template step<NT, RT>(raw2, sb + 1, xrow, xscale, acc);
            if (sb + 3 < last) F::template load<RT>(qp, mp, sb + 3, raw2);
        }
    } else {
        pdl_wait();   // x and inv_rms_in belong to earlier kernels
        float xscale[NT];
        const float* xrow[NT];
        hmma_x_rows(x, ldx, inv_rms_in, ntok, g, F::X_LANE * t, xrow, xscale);
        for (int sb = first; sb < last; sb++) {
            F::template step<NT, RT>(raw, sb, xrow, xscale, acc);
            if (sb + 1 < last) F::template load<RT>(qp, mp, sb + 1, raw);
        }
    }
    hmma_epilogue<NT, RT, WK, SILU_PAIRS>(acc, row0, y, ldy, res, normw_out, xn_out, inv_rms_out, counter, eps, N,
                                          ntok);
}

// the kernels of a K-quant layout: <prefix>_t8_<suffix>, <prefix>_t16_<suffix>, each plain and _silu; PIPE (the
// suffix ends in p): two super-blocks' loads in flight, the same sums in the same order
#define DEFINE_SUPERBLOCK_HMMA(F, NT, RT, WK, SILU, PIPE, NAME)                                    \
    extern "C" __global__ void __launch_bounds__(32 * WK) NAME(                                   \
            const unsigned char* qs, const unsigned char* meta, const float* x, int ldx,          \
            const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out,\
            float* xn_out, float* inv_rms_out, unsigned int* counter, float eps, int N, int K,   \
            int ntok) {                                                                          \
        hmma_superblock_body<F, NT, RT, WK, SILU, PIPE>(qs, meta, x, ldx, inv_rms_in, y, ldy, res, \
                                                        normw_out, xn_out, inv_rms_out, counter, eps, N, K, ntok); \
    }
#define DEFINE_SUPERBLOCK_HMMA_LAYOUT(F, PREFIX, RT, WK, PIPE, SUFFIX)                             \
    DEFINE_SUPERBLOCK_HMMA(F, 1, RT, WK, false, PIPE, PREFIX##_t8_##SUFFIX)                       \
    DEFINE_SUPERBLOCK_HMMA(F, 1, RT, WK, true, PIPE, PREFIX##_t8_##SUFFIX##_silu)                 \
    DEFINE_SUPERBLOCK_HMMA(F, 2, RT, WK, false, PIPE, PREFIX##_t16_##SUFFIX)                      \
    DEFINE_SUPERBLOCK_HMMA(F, 2, RT, WK, true, PIPE, PREFIX##_t16_##SUFFIX##_silu)
