/* What host_program.c calls of host_kernels.c: a projection bound once and the float ops of a step. */
#ifndef KS_HOST_KERNELS_H
#define KS_HOST_KERNELS_H
#include <stddef.h>
#include <stdint.h>

/* A projection as the step program runs it: weight, prologue and epilogue fixed once (the caller keeps
   the struct), tokens per call.  norm: x's rows rmsnormed by it first (the numbers of ks_rmsnorm); glu:
   rows [0, N/2) are the gate and [N/2, N) the up projection, and out [T, N/2] is silu(gate) * up (the
   numbers of ks_silu_mul). */
typedef struct {
    int fmt, isa, N, K, glu, threads;
    const uint8_t *w, *meta;
    ptrdiff_t w_stride, meta_stride;
    const float *norm;
    float eps;
} ks_linear_t;

int ks_linear(const ks_linear_t *spec, const float *x, ptrdiff_t x_stride, int T, float *out, ptrdiff_t out_stride);
void ks_silu_mul(const float *gate, ptrdiff_t g_stride, const float *up, ptrdiff_t u_stride, int rows, int n,
                 float *out, ptrdiff_t out_stride, int threads);
int ks_qkv_rope(const float *qkv, ptrdiff_t qkv_t, int T, int H, int n_kv, int D, const float *bias, const float *qk_norm,
                float eps, const float *cos_t, const float *sin_t, float *q_out, ptrdiff_t q_t, float *k_out,
                float *v_out, ptrdiff_t kv_t, int threads);
int ks_attention(const float *q, ptrdiff_t q_t, ptrdiff_t q_h, int n, int H, int D, const void *k, const void *v,
                 int kv_f16, ptrdiff_t kv_t, ptrdiff_t kv_h, int n_kv, int start, int window, float scale,
                 float *out, ptrdiff_t out_t, int threads);
#endif
