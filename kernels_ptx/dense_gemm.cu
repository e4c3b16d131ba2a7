// The kernels around a library GEMM (cuBLAS, fp16 x fp16 -> fp32) for steps of many tokens:
//
//   q8_dequant_f16     W [N, K] fp16 = fp16(qs[n, k] * scale[n, k/32])   (product in fp32, one rounding)
//   <fmt>[_<tail fmt>]_dequant_f16
//                      the same for the 4/6-bit block formats of q4_formats.cuh (q4_0, q4_k, q6_k, and
//                      q4_k_q6_k: a fused QKV whose last rows are Q6_K): fp16(s * (level - BIAS) - o), the
//                      fp32 value model/quant4.py's dequantize_blocks computes, one rounding
//   gemm_input_f16     A [T, K] fp16 = fp16(x[t, k] * inv_rms_in[t])     (no inv_rms_in: fp16(x))
//   gemm_epilogue      from C [T, ldc] fp32 (the GEMM's output, or y itself after an in-place GEMM):
//                        s = SILU_PAIRS ? silu(C[t, 2j]) * C[t, 2j + 1] : C[t, j]
//                        s += res[t, j]                  when res
//                        y[t, j] = s                     unless C is y (an in-place GEMM) and no res
//                        xn_out[t, j] = s * normw_out[j] when xn_out
//                        inv_rms_out[t] = 1/sqrt(mean_j s^2 + eps)
//                      one block per token, so the 1/rms needs no ticket
//
// The same results as q8_gemv.cu's prologue and epilogues (kestrel_stream/cuda/dense_gemm.py says
// which arrive how); weights stay in their blocks in memory and are expanded per step into one scratch buffer.
// Every kernel waits for its predecessor first (common.cuh's pdl_wait): the dequantised scratch is
// still being read by the previous GEMM when the next weight's expansion may start.
#include "common.cuh"
#include "q4_formats.cuh"

__device__ __forceinline__ half_bits float_to_half(float f) {
    half_bits h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ unsigned int pack_halves(float lo, float hi) {
    return (unsigned int)float_to_half(lo) | ((unsigned int)float_to_half(hi) << 16);
}

__device__ __forceinline__ float dense_silu_mul(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

// One thread per 16 weights (half a Q8_0 block): a 16-byte load of int8, 32 bytes of fp16 out.
extern "C" __global__ void __launch_bounds__(256) q8_dequant_f16(
        const int8* __restrict__ qs, const half_bits* __restrict__ scales, half_bits* __restrict__ out, int N,
        int K) {
    pdl_launch_dependents();
    pdl_wait();
    const long long chunks = (long long)N * (K >> 4);
    for (long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x; c < chunks;
         c += (long long)gridDim.x * blockDim.x) {
        const uint4 raw = __ldg((const uint4*)qs + c);
        const float scale = half_to_float(__ldg(scales + (c >> 1)));   // 2 chunks per 32-block, rows of K/32
        const unsigned int words[4] = {raw.x ^ 0x80808080u, raw.y ^ 0x80808080u, raw.z ^ 0x80808080u,
                                       raw.w ^ 0x80808080u};
        unsigned int packed[8];
#pragma unroll
        for (int w = 0; w < 4; w++) {
            packed[2 * w] = pack_halves(byte_to_float(words[w], 0) * scale, byte_to_float(words[w], 1) * scale);
            packed[2 * w + 1] = pack_halves(byte_to_float(words[w], 2) * scale, byte_to_float(words[w], 3) * scale);
        }
        uint4* dst = (uint4*)(out + 16 * c);
        dst[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        dst[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    }
}

// One unit of format F (q4_formats.cuh: 32 or 64 weights, 16 or 48 bytes of qs) of row `row`: each of its
// groups of 16 weights to fp16 in two 16-byte stores.  Separate roundings (no FMA), as numpy's
// (d * sc) * q - dmin * m does them, so the fp16 equals numpy's float16 of the reference bit for bit.
template <class F>
__device__ __forceinline__ void dequant_unit(const unsigned char* qs, const unsigned char* meta, half_bits* out,
                                             int K, long long row, int u) {
    typename F::Raw raw;
    F::load(raw, qs + row * F::qs_row(K), meta + row * F::meta_row(K), u);
    Group g[F::GROUPS];
    F::decode(raw, u, g);
#pragma unroll
    for (int i = 0; i < F::GROUPS; i++) {
        float v[16];
#pragma unroll
        for (int e = 0; e < 16; e++) {
            const float level = level_float(g[i].lv[e >> 2], e & 3, (float)F::BIAS);
            v[e] = F::MINS ? __fsub_rn(__fmul_rn(g[i].s, level), g[i].o) : __fmul_rn(g[i].s, level);
        }
        uint4* dst = (uint4*)(out + row * K + g[i].k);
        dst[0] = make_uint4(pack_halves(v[0], v[1]), pack_halves(v[2], v[3]), pack_halves(v[4], v[5]),
                            pack_halves(v[6], v[7]));
        dst[1] = make_uint4(pack_halves(v[8], v[9]), pack_halves(v[10], v[11]), pack_halves(v[12], v[13]),
                            pack_halves(v[14], v[15]));
    }
}

// W [N, K] fp16 of a block-format weight: rows [0, head_rows) in format A (qs, meta), the rest in format B
// (qs_b, meta_b; a one-format weight passes its own parts and head_rows = N), each row's qs and meta parts
// qs_row(K) and meta_row(K) bytes apart (model/quant4.image_layout).  One thread per unit, grid-stride.
template <class A, class B>
__device__ __forceinline__ void block_dequant_body(const unsigned char* qs, const unsigned char* meta,
                                                   half_bits* out, int N, int K, const unsigned char* qs_b,
                                                   const unsigned char* meta_b, int head_rows) {
    pdl_launch_dependents();
    pdl_wait();
    const int units_a = K / A::UNIT, units_b = K / B::UNIT;
    const long long head_units = (long long)head_rows * units_a;
    const long long all_units = head_units + (long long)(N - head_rows) * units_b;
    for (long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x; c < all_units;
         c += (long long)gridDim.x * blockDim.x) {
        if (c < head_units) {
            dequant_unit<A>(qs, meta, out, K, c / units_a, (int)(c % units_a));
        } else {
            const long long t = c - head_units;
            dequant_unit<B>(qs_b, meta_b, out + (long long)head_rows * K, K, t / units_b, (int)(t % units_b));
        }
    }
}

#define DEFINE_BLOCK_DEQUANT(A, B, NAME)                                                                 \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                              \
            const unsigned char* __restrict__ qs, const unsigned char* __restrict__ meta,                \
            half_bits* __restrict__ out, int N, int K, const unsigned char* __restrict__ qs_b,           \
            const unsigned char* __restrict__ meta_b, int head_rows) {                                   \
        block_dequant_body<A, B>(qs, meta, out, N, K, qs_b, meta_b, head_rows);                          \
    }
DEFINE_BLOCK_DEQUANT(FmtQ4_0, FmtQ4_0, q4_0_dequant_f16)
DEFINE_BLOCK_DEQUANT(FmtQ4_K, FmtQ4_K, q4_k_dequant_f16)
DEFINE_BLOCK_DEQUANT(FmtQ6_K, FmtQ6_K, q6_k_dequant_f16)
DEFINE_BLOCK_DEQUANT(FmtQ4_K, FmtQ6_K, q4_k_q6_k_dequant_f16)

// grid (ceil(K / 1024), T), 256 threads, four consecutive k per thread (K a multiple of 32).
extern "C" __global__ void __launch_bounds__(256) gemm_input_f16(
        const float* __restrict__ x, int ldx, const float* __restrict__ inv_rms_in, half_bits* __restrict__ a,
        int K) {
    pdl_launch_dependents();
    pdl_wait();
    const int t = blockIdx.y, k = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (k >= K) return;
    const float scale = inv_rms_in ? inv_rms_in[t] : 1.0f;
    const float4 v = *(const float4*)(x + (long long)t * ldx + k);
    *(uint2*)(a + (long long)t * K + k) = make_uint2(pack_halves(v.x * scale, v.y * scale),
                                                     pack_halves(v.z * scale, v.w * scale));
}

// grid (T), 256 threads; N output columns.
template <bool SILU_PAIRS>
__device__ __forceinline__ void gemm_epilogue_body(
        const float* c, int ldc, float* y, int ldy, const float* res, const float* normw_out, float* xn_out,
        float* inv_rms_out, float eps, int N) {
    __shared__ float partial[8];
    pdl_launch_dependents();
    pdl_wait();
    const int t = blockIdx.x;
    const float* c_row = c + (long long)t * ldc;
    const long long row = (long long)t * ldy;
    const bool store = (const float*)y != c || res != nullptr;   // an in-place GEMM already wrote y
    float sq = 0.f;
    for (int j = threadIdx.x; j < N; j += blockDim.x) {
        float s = SILU_PAIRS ? dense_silu_mul(c_row[2 * j], c_row[2 * j + 1]) : c_row[j];
        if (res) s += res[row + j];
        if (store) y[row + j] = s;
        if (xn_out) xn_out[row + j] = s * normw_out[j];
        sq += s * s;
    }
    if (inv_rms_out == nullptr) return;
    sq = warp_sum(sq);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = sq;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) total += partial[w];
        inv_rms_out[t] = 1.0f / sqrtf(total / (float)N + eps);
    }
}

#define DEFINE_EPILOGUE(SILU, NAME)                                                                      \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                              \
            const float* c, int ldc, float* y, int ldy, const float* res, const float* normw_out,         \
            float* xn_out, float* inv_rms_out, float eps, int N) {                                       \
        gemm_epilogue_body<SILU>(c, ldc, y, ldy, res, normw_out, xn_out, inv_rms_out, eps, N);           \
    }
DEFINE_EPILOGUE(false, gemm_epilogue)
DEFINE_EPILOGUE(true, gemm_epilogue_silu)
