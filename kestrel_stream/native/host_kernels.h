/* What host_program.c and host_moe.c call of host_kernels.c (a projection bound once, the float ops of a
   step, the thread pool), and host_moe.c's routed-layer ops. */
#ifndef KS_HOST_KERNELS_H
#define KS_HOST_KERNELS_H
#include <stddef.h>
#include <stdint.h>

/* A projection as the step program runs it: weight, prologue and epilogue fixed once (the caller keeps
   the struct), tokens per call.  norm: x's rows rmsnormed by it first (the numbers of ks_rmsnorm); glu:
   rows [0, N/2) are the gate and [N/2, N) the up projection, and out [T, N/2] is silu(gate) * up (the
   numbers of ks_silu_mul).  up_w, up_meta (glu, plain formats): where the up half's first row starts,
   from w and meta; 0: right after the gate half's rows.  So a layout with gate and up rows interleaved
   (the device's expert pool: w_stride two rows, up_w one row) is read where it lies. */
typedef struct {
    int fmt, isa, N, K, glu, threads;
    const uint8_t *w, *meta;
    ptrdiff_t w_stride, meta_stride;
    const float *norm;
    float eps;
    ptrdiff_t up_w, up_meta;
} ks_linear_t;

int ks_linear(const ks_linear_t *spec, const float *x, ptrdiff_t x_stride, int T, float *out, ptrdiff_t out_stride);
/* n projections as ks_linear on each (x[i] [T[i], K] -> out[i]), their rows spread over the threads as one
   job where their tokens are few (a routed layer's experts). */
int ks_linear_group(const ks_linear_t *const *specs, int n, const float *const *x, ptrdiff_t x_stride, const int *T,
                    float *const *out, ptrdiff_t out_stride);
/* A routed layer's experts at few tokens (host_moe.c): n experts' gate|up (glu) and down Linears, expert i
   over choices [first[i], first[i] + count[i]) of xn [T, H]'s rows token[c] -> act [choices, I] (SiLU·mul)
   and out [choices, H] (down), ks_linear_group's numbers; each token's row quantized once, every expert's
   gate|up and down row blocks one job of the pool.  Each expert must pass ks_routed_fits; returns 1
   (nothing done) where their formats or shapes differ. */
int ks_routed_fits(const ks_linear_t *spec, int tokens);
int ks_routed_few(const ks_linear_t *const *gate_up, const ks_linear_t *const *down, int n, const int *first,
                  const int *count, const int *token, const float *xn, int T, float *act, float *out);
void ks_silu_mul(const float *gate, ptrdiff_t g_stride, const float *up, ptrdiff_t u_stride, int rows, int n,
                 float *out, ptrdiff_t out_stride, int threads);
int ks_qkv_rope(const float *qkv, ptrdiff_t qkv_t, int T, int H, int n_kv, int D, const float *bias, const float *qk_norm,
                float eps, const float *cos_t, const float *sin_t, float *q_out, ptrdiff_t q_t, float *k_out,
                float *v_out, ptrdiff_t kv_t, int threads);
int ks_attention(const float *q, ptrdiff_t q_t, ptrdiff_t q_h, int n, int H, int D, const void *k, const void *v,
                 int kv_f16, ptrdiff_t kv_t, ptrdiff_t kv_h, int n_kv, int start, int window, float scale,
                 float *out, ptrdiff_t out_t, int threads);
int ks_attention_tiled(const float *q, ptrdiff_t q_t, ptrdiff_t q_h, int n, int H, int D, const void *k, const void *v,
                       int kv_f16, ptrdiff_t kv_t, ptrdiff_t kv_h, int n_kv, int start, int window, float scale,
                       float *out, ptrdiff_t out_t, int threads);
void ks_rmsnorm(const float *x, ptrdiff_t x_stride, int rows, int n, const float *w, int w_rows, float eps,
                float *out, ptrdiff_t out_stride, int threads);
/* fn(ctx, i, count) for i in 0..count-1 on the library's threads (index 0 on the caller's). */
void ks_pool_run(void (*fn)(void *ctx, int index, int count), void *ctx, int count);

/* A routed layer's router (host_moe.c), bound once: rmsnorm(x, norm) onto E experts by `router` [E, H]
   float32, top k (softmax_first: Qwen3-MoE's softmax, top k, renormalized when `normalize`; else
   Mixtral's top k, softmax), each choice counted in counts [E] (or NULL). */
#define KS_MAX_CHOICES 64
typedef struct {
    int E, H, k, softmax_first, normalize, threads;
    const float *router, *norm;
    float eps;
    int64_t *counts;
} ks_router_t;

/* A routed layer's link share (host_moe.c, run/device/expert_link.py): inside a step graph of up to
   max_tokens tokens, some of the experts this side would compute are the device's (one token: the last
   `count` of its host-side choices; T tokens: count / k of those experts, the most used), which reads them
   over PCIe from pinned images while the host computes the rest.  The host writes their grouping (moe.cu's
   layout: offsets, active, sorted, position) and slot table into pinned memory, stores `item` into `ready`,
   and before its sum's end waits for `done` to hold `item` and adds `out` (their weighted sum).  Armed
   only while such a graph runs (eager steps compute every host choice); `count` may be 0 (the device then
   finds no expert; the hand-off still happens, as the graph expects it). */
typedef struct {
    int count, armed;
    uint32_t item;
    int *groups, *table;            /* pinned: group_ints(E, max_tokens, k) ints; E ints (the image's slot, or -1) */
    const float *out;               /* pinned [max_tokens, H] */
    uint32_t *ready, *done;         /* pinned words (atomic) */
    int shared;                     /* written: the experts the last armed call gave the device */
    int calls;                      /* written: armed calls so far, and their ns (link_tuner.py) */
    long long ns;
    int max_tokens;                 /* the largest step it takes */
    int *scratch;                   /* 2 E ints */
    float *route;                   /* pinned [max_tokens, 2k]: the step's route rows, which the device's share
                                       combines by (copied up with the grouping: the router may be the host's) */
} ks_link_t;

/* A routed layer's experts (host_moe.c), bound once: each expert's gate|up (glu) and down Linear, NULL
   where it is another side's; `used` says how many experts the last call ran; `link`: NULL, or its link
   share (ks_link_t). */
typedef struct {
    int E, H, I, k;
    const ks_linear_t *const *gate_up, *const *down;
    const float *norm;
    float eps;
    int threads, used;
    ks_link_t *link;
} ks_experts_t;

/* route [T, 2k]: each token's k expert ids (as floats), then their weights */
int ks_route(const ks_router_t *spec, const float *x, ptrdiff_t x_stride, int T, float *route, ptrdiff_t route_stride);
/* x [T, H] += the chosen experts' weighted sum (+ moe_out [T, H], another side's sum, unless NULL) */
int ks_experts(ks_experts_t *spec, float *x, ptrdiff_t x_stride, int T, const float *route, ptrdiff_t route_stride,
               const float *moe_out, ptrdiff_t moe_stride);
/* since the last reset: one-token ks_experts calls, their ns, the armed ones' ns waiting for the link, how many
   were armed (process-wide) */
void ks_experts_times(long long out[4], int reset);
/* since the last reset: step lists served (host_serve.c), their items, the items' ns, the ns waited for the
   device's word before each (process-wide) */
void ks_serve_times(long long out[4], int reset);

/* a step graph's host items (host_program.c), which host_serve.c's thread runs */
void ks_program_node(void *arg);
void ks_norm_node(void *arg);
#endif
