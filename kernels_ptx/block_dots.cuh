// One unit of a block-format weight row (q4_formats.cuh) against up to M token rows of x: the dot
// product every block-format GEMV of q4_gemv.cu and the expert GEMVs of moe.cu share.
//
//   acc[m] += sum over the unit's groups g: s_g * sum_i (level_i - BIAS) x[m][k_g + i]  (- o_g sum_i x[m][k_g + i])
//
// X is where token m's row starts: StridedRows (rows ldx floats apart: a step's tokens) or GatheredRows
// (a pointer per token: the tokens one expert serves, scattered over the step).
#pragma once
// (include common.cuh and q4_formats.cuh first: build.py splices includes one level deep)

struct StridedRows {
    const float* x;
    int ldx;
    __device__ __forceinline__ const float* row(int m) const { return x + (long long)m * ldx; }
};

template <int M> struct GatheredRows {
    const float* rows[M];
    __device__ __forceinline__ const float* row(int m) const { return rows[m]; }
};

template <class F, int M, class X>
__device__ __forceinline__ void unit_dots(const typename F::Raw& raw, int u, const X& x, int ntok, float (&acc)[M]) {
    Group g[F::GROUPS];
    F::decode(raw, u, g);
#pragma unroll
    for (int gi = 0; gi < F::GROUPS; gi++) {
        float wl[16];
#pragma unroll
        for (int i = 0; i < 16; i++) wl[i] = level_float(g[gi].lv[i >> 2], i & 3, (float)F::BIAS);
#pragma unroll
        for (int m = 0; m < M; m++) {
            if (m >= ntok) break;   // uniform: the kernel of the next M up runs ntok < M tokens
            const float4* xp = (const float4*)(x.row(m) + g[gi].k);
            float dot = 0.f, sum = 0.f;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float4 v = xp[i];
                dot = fmaf(wl[4 * i], v.x, dot);
                dot = fmaf(wl[4 * i + 1], v.y, dot);
                dot = fmaf(wl[4 * i + 2], v.z, dot);
                dot = fmaf(wl[4 * i + 3], v.w, dot);
                if (F::MINS) sum += (v.x + v.y) + (v.z + v.w);
            }
            acc[m] = fmaf(g[gi].s, dot, acc[m]);
            if (F::MINS) acc[m] = fmaf(-g[gi].o, sum, acc[m]);
        }
    }
}
