/* A host segment of the step program as one call: its ops in the plan's order, each bound once by
 * run/host/native_program.py, walked over one step's buffers and its sessions' caches.  Every op is a
 * call of host_kernels.c (the same numbers as calling it from Python); this file only walks the list,
 * so a step pays the Python side once instead of once per op. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "host_kernels.h"

enum { OP_LINEAR = 0, OP_ADD = 1, OP_SILU_MUL = 2, OP_QKV_ROPE = 3, OP_ATTENTION = 4, OP_ROUTER = 5, OP_EXPERTS = 6 };

typedef struct {
    int kind, in, out;              /* buffer ids (ks_step_t.buf) */
    int col;                        /* LINEAR: the first column of out it writes */
    int gather;                     /* LINEAR: a buffer for the step's lm rows of in (lm_head), or -1;
                                       EXPERTS: the buffer of the device part's sum (moe_out), or -1 */
    int n;                          /* ADD, SILU_MUL: columns */
    int layer, H, n_kv, D, window;  /* QKV_ROPE, ATTENTION: the layer's index in the sessions' caches */
    float eps, scale;
    const ks_linear_t *linear;
    const float *bias, *qk_norm;
    const ks_router_t *router;      /* ROUTER (in: x, out: route) */
    ks_experts_t *experts;          /* EXPERTS (in: route, out: x) */
} ks_op_t;

/* One session's rows of the step: rows lo..hi-1 at positions start.. over its float32 cache
   [layers, capacity, n_kv, D] (k, v: its first layer, row 0), which holds layers first.. of the model. */
typedef struct {
    int lo, hi, start, first;
    ptrdiff_t layer_stride;
    float *k, *v;
} ks_run_t;

#define KS_BUFFERS 10

typedef struct {
    int T, n_runs, n_lm, threads;
    float *buf[KS_BUFFERS];
    ptrdiff_t width[KS_BUFFERS];    /* each buffer's row stride (elements) */
    const float *cos_t, *sin_t;     /* rope_rotation's cos, signed sin [T, D] */
    const ks_run_t *runs;
    const int64_t *lm_rows;         /* the rows lm_head reads (n_lm of them), or NULL: every row */
    int64_t *op_ns;                 /* NULL, or 2 per op: its start and end (CLOCK_MONOTONIC ns, a trace's times) */
} ks_step_t;

/* A host node's argument (ks_program_node): the op list and the step it runs, and its status. */
typedef struct {
    const ks_op_t *ops;
    int n_ops;
    const ks_step_t *step;
    int status;                     /* 0, or the first failed call's ks_program result */
} ks_program_node_t;

/* ks_norm_node's: x [T, H] -> xn [T, H], inv_rms [T] */
typedef struct {
    const float *x, *w;
    float *xn, *inv_rms;
    int T, H;
    float eps;
} ks_norm_node_t;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Returns 0, or 1 + the index of the op that failed (no memory, or a head over 1,024 values).  A routed
   layer's ops are host_moe.c's. */
int ks_program(const ks_op_t *ops, int n_ops, const ks_step_t *s) {
    for (int i = 0; i < n_ops; i++) {
        const ks_op_t *op = ops + i;
        float *in = s->buf[op->in], *out = s->buf[op->out];
        const ptrdiff_t iw = s->width[op->in], ow = s->width[op->out];
        int status = 0;
        if (s->op_ns) s->op_ns[2 * i] = now_ns();
        switch (op->kind) {
        case OP_LINEAR: {
            int rows = s->T;
            if (op->gather >= 0 && s->lm_rows) {
                float *g = s->buf[op->gather];
                const ptrdiff_t gw = s->width[op->gather];
                for (int r = 0; r < s->n_lm; r++) memcpy(g + gw * r, in + iw * s->lm_rows[r], sizeof(float) * op->linear->K);
                in = g, rows = s->n_lm;
                status = ks_linear(op->linear, in, gw, rows, out + op->col, ow);
            } else {
                status = ks_linear(op->linear, in, iw, rows, out + op->col, ow);
            }
            break;
        }
        case OP_ADD:                /* out += in, as numpy's float32 add */
            for (int t = 0; t < s->T; t++) {
                float *o = out + ow * t;
                const float *a = in + iw * t;
                for (int j = 0; j < op->n; j++) o[j] = o[j] + a[j];
            }
            break;
        case OP_SILU_MUL:           /* out = silu(in[:, :n]) * in[:, n:2n] */
            ks_silu_mul(in, iw, in + op->n, iw, s->T, op->n, out, ow, s->threads);
            break;
        case OP_QKV_ROPE: {         /* in: qkv; out: q; k and v into each session's cache */
            const ptrdiff_t row = (ptrdiff_t)op->n_kv * op->D;
            for (int r = 0; r < s->n_runs && !status; r++) {
                const ks_run_t *run = s->runs + r;
                const ptrdiff_t at = run->layer_stride * (op->layer - run->first) + row * run->start;
                status = ks_qkv_rope(in + iw * run->lo, iw, run->hi - run->lo, op->H, op->n_kv, op->D, op->bias,
                                     op->qk_norm, op->eps, s->cos_t + (ptrdiff_t)op->D * run->lo,
                                     s->sin_t + (ptrdiff_t)op->D * run->lo, out + ow * run->lo, ow, run->k + at,
                                     run->v + at, row, s->threads);
            }
            break;
        }
        case OP_ATTENTION:          /* in: q; out: attn */
            for (int r = 0; r < s->n_runs && !status; r++) {
                const ks_run_t *run = s->runs + r;
                const ptrdiff_t at = run->layer_stride * (op->layer - run->first);
                status = ks_attention(in + iw * run->lo, iw, op->D, run->hi - run->lo, op->H, op->D, run->k + at,
                                      run->v + at, 0, (ptrdiff_t)op->n_kv * op->D, op->D, op->n_kv, run->start,
                                      op->window, op->scale, out + ow * run->lo, ow, s->threads);
            }
            break;
        case OP_ROUTER:
            status = ks_route(op->router, in, iw, s->T, out, ow);
            break;
        case OP_EXPERTS:
            status = ks_experts(op->experts, out, ow, s->T, in, iw, op->gather >= 0 ? s->buf[op->gather] : NULL,
                                op->gather >= 0 ? s->width[op->gather] : 0);
            break;
        default:
            status = -1;
        }
        if (s->op_ns) s->op_ns[2 * i + 1] = now_ns();
        if (status != 0) return i + 1;
    }
    return 0;
}

/* ---------------------------------------------------------------- a step graph's host items */
/* run/mixed.py captures a mixed step whose host segments are op lists into one graph; host_serve.c's thread
 * runs each segment's list (and each norm input the host makes) when the graph's copies have brought what
 * it reads into the pinned state, before those that take its results back. */

void ks_program_node(void *arg) {
    ks_program_node_t *n = arg;
    const int status = ks_program(n->ops, n->n_ops, n->step);
    if (status && !n->status) n->status = status;      /* the first failure, read after the step's sync */
}

/* A device op's norm input where the host wrote x: xn = x * w and 1/rms per row, the GEMV applying 1/rms
 * per token (what a device projection's epilogue writes for the next one).  The sum of squares in float32,
 * in order: the same numbers eagerly and in a graph. */
void ks_norm_node(void *arg) {
    const ks_norm_node_t *n = arg;
    for (int t = 0; t < n->T; t++) {
        const float *x = n->x + (ptrdiff_t)n->H * t;
        float *xn = n->xn + (ptrdiff_t)n->H * t, sum = 0.0f;
        for (int j = 0; j < n->H; j++) {
            xn[j] = x[j] * n->w[j];
            sum += x[j] * x[j];
        }
        n->inv_rms[t] = 1.0f / sqrtf(sum / (float)n->H + n->eps);
    }
}
