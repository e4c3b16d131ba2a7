// The epilogue every block-format GEMV shares (q4_gemv.cu, q4_gemv_m1.cu, q4_gemv_mn.cu): a block's
// per-thread sums acc[ROWS][M] of rows [row0, row0 + ROWS) reduced over its THREADS threads, then
// q8_gemv.cu's contract: inv_rms_in, SiLU·mul of (gate, up) row pairs, residual, y, xn_out and the
// last block's inv_rms_out (per-token sums of squares in counter[8..15], ticket in counter[0]).
// Rows at or past row_end compute garbage from clamped loads and are never stored.  `tickets`: the
// epilogue calls of the launch the last one waits for (0: one per block; q4_gemv_dp4a.cuh's blocks
// run several row tiles each).
#pragma once
// (include common.cuh first: build.py splices includes one level deep)

template <int M, int ROWS, int THREADS> struct GemvSharedT {
    float partial[THREADS / 32][ROWS * M];
    float squares[ROWS * M];
    bool is_last_block;
};

__device__ __forceinline__ float q4_silu_mul(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

template <int M, int ROWS, int THREADS, bool SILU_PAIRS>
__device__ __forceinline__ void q4_gemv_epilogue(
        GemvSharedT<M, ROWS, THREADS>& sh, float (&acc)[ROWS][M], int row0, int row_end,
        const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out, float* xn_out,
        float* inv_rms_out, unsigned int* counter, float eps, int N, int ntok, unsigned int tickets = 0) {
    constexpr int WARPS = THREADS / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    pdl_wait();   // threads with no unit wait here
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int m = 0; m < M; m++) {
            if (m >= ntok) break;   // uniform: a part-filled tile (an expert's 1-2 tokens on M = 8) reduces its own
            float s = warp_sum(acc[r][m]);
            if (lane == 0) sh.partial[warp][r * M + m] = s;
        }
    __syncthreads();
    for (int i = threadIdx.x; i < ROWS * M; i += THREADS) {
        const int m = i % M;
        if (m >= ntok) continue;   // never read: the tokens past ntok are neither stored nor squared
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) s += sh.partial[w][i];
        if (inv_rms_in && m < ntok) s *= inv_rms_in[m];
        sh.partial[0][i] = s;   // each entry is rewritten only by the thread that read it
    }
    __syncthreads();
    const int outputs = SILU_PAIRS ? ROWS / 2 : ROWS;
    for (int i = threadIdx.x; i < outputs * M; i += THREADS) {
        const int r = i / M, m = i % M;
        const int row = SILU_PAIRS ? row0 + 2 * r : row0 + r;
        const int col = SILU_PAIRS ? row / 2 : row;
        float s = 0.f;
        if (row < row_end && m < ntok) {
            s = SILU_PAIRS ? q4_silu_mul(sh.partial[0][(2 * r) * M + m], sh.partial[0][(2 * r + 1) * M + m])
                           : sh.partial[0][r * M + m];
            const long long at = (long long)m * ldy + col;
            if (res) s += res[at];
            y[at] = s;
            if (xn_out) xn_out[at] = s * normw_out[col];
        }
        sh.squares[i] = s * s;   // [r][m]; rows past the end add 0
    }
    if (inv_rms_out == nullptr) return;

    float* sums = (float*)(counter + 8);
    __syncthreads();
    if (threadIdx.x == 0) {   // one thread adds the block's squares and takes the ticket
        for (int m = 0; m < ntok; m++) {
            float sq = 0.f;
            for (int r = 0; r < outputs; r++) sq += sh.squares[r * M + m];
            atomicAdd(sums + m, sq);
        }
        __threadfence();   // the sums land before the ticket is taken
        sh.is_last_block = atomicAdd(counter, 1u) == (tickets ? tickets : gridDim.x) - 1;
    }
    __syncthreads();
    if (!sh.is_last_block) return;
    __threadfence();
    if (threadIdx.x < ntok) {
        float total = atomicExch(sums + threadIdx.x, 0.f);   // read at L2, and zeroed for the next launch
        inv_rms_out[threadIdx.x] = 1.0f / sqrtf(total / (float)N + eps);
    }
    if (threadIdx.x == 0) *counter = 0u;
}
