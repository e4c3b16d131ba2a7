// The store of one accumulator pair of the tensor-core GEMMs (q8_mma.cu, q8_mma_pipe.cu,
// q8_mma_f16_ws.cu, q4_mma.cu; N: the end of the rows the launch writes):
// a thread's C pair (v0, v1) is two adjacent weight rows of one token, so a (gate, up) row pair of
// gate_up stays in one thread for SiLU·mul.  Then the residual (y may be res itself: o and down write the
// residual stream in place) and the next norm's input xn = y * normw_out.
#pragma once

__device__ __forceinline__ float epilogue_silu_mul(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

template <bool SILU_PAIRS>
__device__ __forceinline__ void mma_store_pair(int tok, int row, float v0, float v1, int N, int ldy, float* y,
                                               const float* res, const float* normw_out, float* xn_out) {
    if (SILU_PAIRS) {
        if (row >= N) return;
        const int col = row >> 1;
        const long long at = (long long)tok * ldy + col;
        float s = epilogue_silu_mul(v0, v1);
        if (res) s += res[at];
        y[at] = s;
        if (xn_out) xn_out[at] = s * normw_out[col];
    } else {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int col = row + e;
            if (col >= N) continue;
            const long long at = (long long)tok * ldy + col;
            float s = e ? v1 : v0;
            if (res) s += res[at];
            y[at] = s;
            if (xn_out) xn_out[at] = s * normw_out[col];
        }
    }
}
