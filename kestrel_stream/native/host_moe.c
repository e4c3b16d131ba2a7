/* A routed (mixture-of-experts) layer on the host: the router's choice of experts and the chosen experts'
 * MLPs, two ops of the step program, each bound once by run/host/routed.py (a ks_router_t, a ks_experts_t)
 * and called alone (the per-op program) or from host_program.c's op list: the same numbers either way.
 *
 * The router: x's rows rmsnormed (ks_rmsnorm's numbers), float32 logits onto the experts (each a dot
 * product in a fixed order), and run/host/arithmetic.py's `route`: softmax over every expert, the top k,
 * renormalized (Qwen3-MoE), or the top k logits and softmax over them (Mixtral); ties to the lowest id.
 * Its "route" rows are the state the device reads too: k ids (as floats), then k weights.
 *
 * The experts: those chosen by few tokens (decode, small batches: ks_routed_few) with each token's normed
 * row quantized once for all its experts, every such expert's gate and up rows in one pass (SiLU·mul per
 * row block), then its down rows, all in one job of the pool (the experts' rows spread over the threads
 * together, so one token's eight experts use every core at once); an expert chosen by more tokens with
 * the rows of its tokens gathered and its Linears run (ks_linear_group, tokens in lanes); each output
 * row weighted and added into the layer's sum in ascending expert id (the sum's order fixed); the device
 * part's sum ("moe_out", mode offload's resident experts) added after, then the sum into x.  Experts whose
 * Linears are NULL are another side's.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <time.h>

#include "host_kernels.h"
#include "host_simd.h"

/* ---------------------------------------------------------------- scratch */

static __thread float *moe_scratch;      /* one growable buffer per calling thread, never freed per step */
static __thread size_t moe_scratch_bytes;

static float *scratch_floats(size_t n) {
    const size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
    if (bytes > moe_scratch_bytes) {
        free(moe_scratch);
        moe_scratch = aligned_alloc(64, bytes);
        moe_scratch_bytes = moe_scratch ? bytes : 0;
    }
    return moe_scratch;
}

/* ---------------------------------------------------------------- the router */

static float dot_f32(const float *a, const float *b, int n) {
    float part[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) part[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (int j = 0; j < 16; j++) s += part[j];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

typedef struct {
    const ks_router_t *spec;
    const float *xn;
    float *logits;
    int T;
} logits_t;

static void router_logits(void *ctx, int index, int count) {
    const logits_t *c = ctx;
    const int E = c->spec->E, H = c->spec->H;
    const long jobs = (long)c->T * E;
    for (long j = (long)index * jobs / count, end = (long)(index + 1) * jobs / count; j < end; j++)
        c->logits[j] = dot_f32(c->xn + (ptrdiff_t)H * (j / E), c->spec->router + (ptrdiff_t)H * (j % E), H);
}

/* softmax over n values in place (the max subtracted first) */
static void softmax(float *v, int n) {
    float m = v[0], sum = 0.0f;
    for (int i = 1; i < n; i++) m = v[i] > m ? v[i] : m;
    for (int i = 0; i < n; i++) v[i] = expf(v[i] - m), sum += v[i];
    for (int i = 0; i < n; i++) v[i] = v[i] / sum;
}

/* The k highest of scores [E] into ids and chosen, highest first; ties to the lowest id (a stable sort's). */
static void top_k(const float *scores, int E, int k, int *ids, float *chosen) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < j && !taken; i++) taken = ids[i] == e;
            if (!taken && (best < 0 || scores[e] > scores[best])) best = e;
        }
        ids[j] = best;
        chosen[j] = scores[best];
    }
}

int ks_route(const ks_router_t *s, const float *x, ptrdiff_t x_stride, int T, float *route, ptrdiff_t route_stride) {
    const int E = s->E, H = s->H, k = s->k;
    if (T <= 0) return 0;
    float *xn = scratch_floats((size_t)T * H + (size_t)T * E);
    if (!xn) return -1;
    float *logits = xn + (size_t)T * H;
    ks_rmsnorm(x, x_stride, T, H, s->norm, 1, s->eps, xn, H, s->threads);
    logits_t c = {s, xn, logits, T};
    const size_t work = (size_t)T * E * H;
    int threads = work < 65536 ? 1 : s->threads;
    ks_pool_run(router_logits, &c, threads < T * E ? threads : T * E);
    int ids[KS_MAX_CHOICES];
    for (int t = 0; t < T; t++) {
        float *scores = logits + (ptrdiff_t)E * t, *row = route + route_stride * t;
        if (s->softmax_first) softmax(scores, E);
        top_k(scores, E, k, ids, row + k);
        if (!s->softmax_first) {
            softmax(row + k, k);
        } else if (s->normalize) {
            float sum = 0.0f;
            for (int j = 0; j < k; j++) sum += row[k + j];
            for (int j = 0; j < k; j++) row[k + j] = row[k + j] / sum;
        }
        for (int j = 0; j < k; j++) {
            row[j] = (float)ids[j];
            if (s->counts) s->counts[ids[j]]++;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- the link share */

/* The link's experts of a step of T tokens (at most link->max_tokens), written for the device as moe.cu reads
   a grouping (offsets [E + 1], active [E + 1], sorted [T k], position [T k]: the linked experts' choices,
   tokens ascending within each) with the image's slot table (expert e at slot e, -1 elsewhere) and the
   step's route rows (the device's own are stale where the router ran on the host), then `ready` = item -- also when there are none (the device's launches then find no expert and its sums are
   0).  Which: of the experts this side would compute, those chosen by the most tokens (each read once serves
   them all), ties to the one chosen last in route order -- at one token, the last `count` of its host-side
   choices; at T tokens, count / k of those experts (the share the count gives one token).  Returns how
   many experts; table[e] >= 0 marks them for the caller. */
static int share_link(const ks_experts_t *s, const float *route, ptrdiff_t route_stride, int T) {
    ks_link_t *l = s->link;
    const int E = s->E, k = s->k, A = T * k;
    int *offsets = l->groups, *active = offsets + E + 1, *sorted = active + E + 1, *position = sorted + A;
    int *uses = l->scratch, *last = l->scratch + E;        /* each expert's choices here, its last one */
    for (int e = 0; e < E; e++) uses[e] = 0, last[e] = -1, l->table[e] = -1;
    int candidates = 0;
    for (int a = 0; a < A; a++) {
        const int e = (int)route[route_stride * (a / k) + a % k];
        if (!s->gate_up[e]) continue;
        candidates += uses[e]++ == 0;
        last[e] = a;
    }
    const int want = T == 1 ? l->count : (l->count * candidates + k / 2) / k;
    int n = 0;
    for (; n < want && n < candidates; n++) {      /* the most used, then the last chosen (a few dozen experts) */
        int best = -1;
        for (int e = 0; e < E; e++)
            if (uses[e] && l->table[e] < 0 && (best < 0 || uses[e] > uses[best] ||
                                                (uses[e] == uses[best] && last[e] > last[best])))
                best = e;
        l->table[best] = best;
    }
    l->shared = n;
    memset(offsets, 0, sizeof(int) * (size_t)(E + 1));
    for (int a = 0; a < A; a++) {
        const int e = (int)route[route_stride * (a / k) + a % k];
        if (l->table[e] >= 0) offsets[e + 1]++;
    }
    int m = 0;
    for (int e = 0; e < E; e++) {
        if (offsets[e + 1]) active[m++] = e;
        offsets[e + 1] += offsets[e];
    }
    active[E] = m;
    for (int a = 0; a < A; a++) position[a] = 0;
    int *at = uses;                 /* each linked expert's next row */
    memcpy(at, offsets, sizeof(int) * (size_t)E);
    for (int a = 0; a < A; a++) {   /* choices in order: tokens ascending within an expert */
        const int e = (int)route[route_stride * (a / k) + a % k];
        if (l->table[e] >= 0) sorted[at[e]] = a, position[a] = at[e]++;
    }
    for (int t = 0; l->route && t < T; t++)    /* the route rows the device combines by: this item's */
        memcpy(l->route + (ptrdiff_t)2 * k * t, route + route_stride * t, sizeof(float) * 2 * (size_t)k);
    atomic_store_explicit((_Atomic uint32_t *)l->ready, l->item, memory_order_release);
    return n;
}

#define LINK_GIVE_UP_NS 60000000000LL

/* Until the device's sum of the link choices is in `out` (done == item); -1 after a minute without it. */
static int wait_link(const ks_link_t *l) {
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long spins = 1; atomic_load_explicit((_Atomic uint32_t *)l->done, memory_order_acquire) < l->item; spins++) {
        cpu_relax();
        if (spins % 4096 == 0) {
            clock_gettime(CLOCK_MONOTONIC, &t);
            if ((t.tv_sec - t0.tv_sec) * 1000000000LL + (t.tv_nsec - t0.tv_nsec) > LINK_GIVE_UP_NS) return -1;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- the experts */

/* Process-wide, for benches: one-token calls, the nanoseconds they took, the nanoseconds the armed ones spent
   waiting for the link's sum after their own choices, and how many were armed (ks_experts_times). */
static _Atomic long long one_token[4];

static long long clock_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

void ks_experts_times(long long out[4], int reset) {
    for (int i = 0; i < 4; i++) out[i] = reset ? atomic_exchange(&one_token[i], 0) : atomic_load(&one_token[i]);
}

int ks_experts(ks_experts_t *s, float *x, ptrdiff_t x_stride, int T, const float *route, ptrdiff_t route_stride,
               const float *moe_out, ptrdiff_t moe_stride) {
    const int E = s->E, H = s->H, I = s->I, k = s->k;
    s->used = 0;
    if (T <= 0) return 0;
    const long long t0 = clock_ns();
    /* xn [T, H] | sum [T, H] | each choice's row: gathered [Tk, H], act [Tk, I], down's [Tk, H] | weights [Tk]
       | tokens [Tk] | each expert's first row [E + 1] | the used experts' first rows [E + 1] | their projections,
       inputs, outputs, rows */
    const size_t tk = (size_t)T * k, floats = (size_t)T * 2 * H + tk * (2 * H + I) + 2 * tk + 2 * (E + 1);
    float *xn = scratch_floats(floats + 10 * (size_t)E + 8);
    if (!xn) return -1;
    float *sum = xn + (size_t)T * H, *rows_x = sum + (size_t)T * H, *act = rows_x + tk * H, *down = act + tk * I;
    float *weight = down + tk * H;
    int *token = (int *)(weight + tk), *first = token + tk, *start = first + E + 1;
    uintptr_t table = ((uintptr_t)(start + E + 1) + 7) / 8 * 8;
    const ks_linear_t **specs = (const ks_linear_t **)table, **downs = specs + E;
    const float **ins = (const float **)(downs + E);
    float **outs = (float **)(ins + E);
    int *counts = (int *)(outs + E);
    ks_rmsnorm(x, x_stride, T, H, s->norm, 1, s->eps, xn, H, s->threads);
    memset(sum, 0, sizeof(float) * (size_t)T * H);
    /* the link share's experts (inside a step graph): the device's from here on */
    ks_link_t *link = s->link;
    const int handing = link && link->armed && T <= link->max_tokens;  /* the device waits (count 0: for nothing) */
    const int shared = handing ? share_link(s, route, route_stride, T) : 0;
#define LINKED(e) (shared && link->table[e] >= 0)
    /* this side's choices grouped by expert, tokens ascending within each (a counting sort) */
    memset(first, 0, sizeof(int) * (size_t)(E + 1));
    for (int t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            const int e = (int)route[route_stride * t + j];
            if (s->gate_up[e] && !LINKED(e)) first[e + 1]++;
        }
    for (int e = 0; e < E; e++) first[e + 1] += first[e];
    for (int t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            const float *row = route + route_stride * t;
            const int e = (int)row[j];
            if (!s->gate_up[e] || LINKED(e)) continue;
            int *at = &first[e];
            token[*at] = t, weight[*at] = row[k + j];
            (*at)++;
        }
    for (int e = E; e > 0; e--) first[e] = first[e - 1];      /* back to each expert's first */
    first[0] = 0;
    /* the used experts, those with few tokens (ks_routed_fits) first: their choices' rows [start, start + count) */
    int used = 0, few = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int e = 0; e < E; e++) {
            const int n = first[e + 1] - first[e];
            if (n == 0 || (ks_routed_fits(s->gate_up[e], n) && ks_routed_fits(s->down[e], n)) != (pass == 0)) continue;
            specs[used] = s->gate_up[e], downs[used] = s->down[e], counts[used] = n, start[used] = first[e];
            used++;
            few += pass == 0;
        }
    /* few tokens an expert: each token quantized once, every such expert's rows one job */
    const int done = ks_routed_few(specs, downs, few, start, counts, token, xn, T, act, down);
    if (done < 0) return -1;
    if (done > 0) few = 0;      /* their formats or shapes differ: each runs as its Linears */
    /* the others: the rows of each one's tokens gathered, its Linears over them */
    for (int i = few; i < used; i++)
        for (int c = start[i]; c < start[i] + counts[i]; c++)
            memcpy(rows_x + (ptrdiff_t)H * c, xn + (ptrdiff_t)H * token[c], sizeof(float) * H);
    for (int i = few; i < used; i++) ins[i] = rows_x + (ptrdiff_t)H * start[i], outs[i] = act + (ptrdiff_t)I * start[i];
    if (ks_linear_group(specs + few, used - few, ins + few, H, counts + few, outs + few, I) != 0) return -1;
    for (int i = few; i < used; i++) ins[i] = act + (ptrdiff_t)I * start[i], outs[i] = down + (ptrdiff_t)H * start[i];
    if (ks_linear_group(downs + few, used - few, ins + few, I, counts + few, outs + few, H) != 0) return -1;
    for (int c = 0; c < first[E]; c++) {        /* ascending expert id: the sum's order is fixed */
        float *o = sum + (ptrdiff_t)H * token[c];           /* sum[t] += w * down: numpy's product, then sum */
        const float *d = down + (ptrdiff_t)H * c;
        for (int j = 0; j < H; j++) o[j] = o[j] + weight[c] * d[j];
    }
    s->used = used;
    const long long t1 = handing && T == 1 ? clock_ns() : 0;
    if (handing && wait_link(link) != 0) return -1;
    if (t1) atomic_fetch_add(&one_token[2], clock_ns() - t1), atomic_fetch_add(&one_token[3], 1);
    for (int t = 0; t < T; t++) {
        float *xr = x + x_stride * t, *o = sum + (ptrdiff_t)H * t;
        if (moe_out) {
            const float *m = moe_out + moe_stride * t;
            for (int c = 0; c < H; c++) o[c] = o[c] + m[c];
        }
        if (shared)                 /* the device's weighted sum of the link's experts */
            for (int c = 0; c < H; c++) o[c] = o[c] + link->out[(ptrdiff_t)H * t + c];
        for (int c = 0; c < H; c++) xr[c] = xr[c] + o[c];
    }
    const long long ns = clock_ns() - t0;
    if (T == 1) atomic_fetch_add(&one_token[0], 1), atomic_fetch_add(&one_token[1], ns);
    if (handing) link->calls++, link->ns += ns;             /* an armed call's time, for link_tuner.py (any T) */
    return 0;
#undef LINKED
}
