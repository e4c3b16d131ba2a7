/* Host kernels: quantized GEMV/GEMM on GGUF blocks as stored, and the float ops around them.
 *
 * Weights are never copied to float.  Each call quantizes its activations per block in two int8 levels
 * (q8_0: one float scale d per 32 values, for Q8_0 and Q4_0 weights; q8_K: one per 256 and each level's
 * sum of every 16 values, for Q4_K and Q6_K): hi = round(x / d), lo = round((x / d - hi) * 128), so
 * x = d * (hi + lo / 128) to about max|x| * 2^-15 (one level: 2^-8, ~0.5 % RMS per projection; two:
 * ~5e-5).  Integer dot products per weight block of both levels, joined as 128 * hi + lo, scaled by
 * d / 128; block results accumulated in float32.  native/twins.py is the same arithmetic in numpy.
 *
 * Threads: a small pool of persistent workers of its own (below), not OpenMP: GNU OpenMP's workers hang
 * a forked child, and its spin-then-sleep cannot be set per call.  `#pragma omp simd` (-fopenmp-simd)
 * only asks for vector loops.
 *
 * Each dot product has a scalar version and SIMD versions (AVX2: maddubs; AVX-512 VNNI: vpdpbusd).
 * With VNNI, 512-bit or the 256-bit AVX-VNNI of CPUs without AVX-512, Q4_K and Q6_K weights are repacked 16
 * rows together when prepared, and their matmuls are host_kquants.c's (ks_linear runs them like the
 * others: the same activations, threads and epilogue); AVX-VNNI's other formats run the AVX2 paths.
 * With AMX-INT8 (ISA_AMX), Q8_0 matmuls of any number of tokens run on tiles (host_amx.c) instead of the
 * dot products and the lanes kernel, with the lanes kernel's layout and float steps (a routed layer's
 * few-token experts too, each expert's tokens the lanes of its tile).
 * The caller names the widest ISA to use (ks_isa_supported() says which the CPU has); the build
 * compiles every version for the running machine, so a forced lower path runs here too.
 * Compiled with -ffp-contract=off: the float steps round as numpy's do (no fused multiply-adds the
 * twin does not make), except where a kernel calls an FMA intrinsic itself.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "host_amx.h"
#include "host_kernels.h"
#include "host_kquants.h"
#include "host_simd.h"

int ks_isa_supported(void) {
    int mask = 1 << ISA_SCALAR;
#if KS_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        mask |= 1 << ISA_AVX2;
    unsigned a, b, c, d;           /* AVX-VNNI: CPUID leaf 7, sub-leaf 1, EAX bit 4 (GCC 12's builtin lacks it) */
    if ((mask & (1 << ISA_AVX2)) && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1)) mask |= 1 << ISA_AVXVNNI;
    if ((mask & (1 << ISA_AVX2)) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        mask |= 1 << ISA_AVX512VNNI;
    if ((mask & (1 << ISA_AVX512VNNI)) && amx_usable()) mask |= 1 << ISA_AMX;
#endif
    return mask;
}

/* ---------------------------------------------------------------- thread pool */
/* Persistent workers, started on first use: a call publishes a job (a function of (context, index,
   count)), runs index 0 itself and waits for the others.  Between jobs a worker polls for
   `spin_us` microseconds, then sleeps on a condition variable.  A forked child starts its own workers
   (pthread_atfork), so a process that forks after using the kernels keeps working in the child. */

typedef void (*pool_fn)(void *ctx, int index, int count);

#define POOL_MAX 256

static struct {
    pthread_mutex_t call;           /* one job at a time (callers from several threads queue here) */
    pthread_mutex_t lock;           /* with wake / done: sleeping and waking */
    pthread_cond_t wake, done;
    int workers;                    /* started (indices 1..workers) */
    struct {                        /* job g in job[g & 1]: written before generation becomes g, read after */
        _Atomic(pool_fn) fn;
        _Atomic(void *) ctx;
        _Atomic int count;
    } job[2];
    _Atomic unsigned long generation;
    _Atomic int remaining;
    _Atomic int spin_us;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
          0, {{NULL, NULL, 0}, {NULL, NULL, 0}}, 0, 0, 100};

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static inline double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

static void pool_after_fork(void) {     /* the child has none of the parent's workers */
    pthread_mutex_init(&pool.call, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.workers = 0;
    atomic_store(&pool.remaining, 0);
}

static void pool_register(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

typedef struct {
    int index;
    unsigned long seen;
} worker_start_t;

static void *pool_worker(void *arg) {
    worker_start_t start = *(worker_start_t *)arg;
    free(arg);
    unsigned long seen = start.seen;
    for (;;) {
        unsigned long g = atomic_load_explicit(&pool.generation, memory_order_acquire);
        if (g == seen) {
            double until = now_us() + atomic_load_explicit(&pool.spin_us, memory_order_relaxed);
            for (int i = 1; (g = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen; i++) {
                cpu_relax();
                if ((i & 63) == 0 && now_us() > until) {
                    pthread_mutex_lock(&pool.lock);
                    while ((g = atomic_load(&pool.generation)) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
                    pthread_mutex_unlock(&pool.lock);
                    break;
                }
            }
        }
        /* the job of generation g, read whole from its own slot.  A worker that takes no part in g may
           read it while g's caller has returned and the next job (g + 1, the other slot) is being
           written: reading that one here would run it under g, and again once g + 1 is published (an
           index run twice, `remaining` counted down twice, its caller returning before a worker is
           done).  Job g + 2, the next writer of this slot, comes after generation g + 1: the check
           below sees it, and the worker takes the newest job on the next turn. */
        pool_fn fn = atomic_load(&pool.job[g & 1].fn);
        void *ctx = atomic_load(&pool.job[g & 1].ctx);
        int count = atomic_load(&pool.job[g & 1].count);
        if (atomic_load(&pool.generation) != g) continue;
        seen = g;
        if (start.index < count) {
            fn(ctx, start.index, count);
            if (atomic_fetch_sub_explicit(&pool.remaining, 1, memory_order_acq_rel) == 1) {
                pthread_mutex_lock(&pool.lock);
                pthread_cond_signal(&pool.done);
                pthread_mutex_unlock(&pool.lock);
            }
        }
    }
    return NULL;
}

/* fn(ctx, i, count) for i in 0..count-1, index 0 on the calling thread; returns when all have. */
static void pool_run(pool_fn fn, void *ctx, int count) {
    if (count > POOL_MAX) count = POOL_MAX;
    if (count <= 1) {
        fn(ctx, 0, 1);
        return;
    }
    pthread_once(&pool_once, pool_register);
    pthread_mutex_lock(&pool.call);
    while (pool.workers < count - 1) {
        worker_start_t *start = malloc(sizeof *start);
        pthread_t thread;
        if (!start) break;
        start->index = pool.workers + 1;
        start->seen = atomic_load(&pool.generation);
        if (pthread_create(&thread, NULL, pool_worker, start) != 0) {
            free(start);
            break;
        }
        pthread_detach(thread);
        pool.workers++;
    }
    if (count > pool.workers + 1) count = pool.workers + 1;
    const unsigned long next = atomic_load(&pool.generation) + 1;     /* only callers holding `call` change it */
    atomic_store(&pool.job[next & 1].fn, fn);
    atomic_store(&pool.job[next & 1].ctx, ctx);
    atomic_store(&pool.job[next & 1].count, count);
    atomic_store(&pool.remaining, count - 1);
    pthread_mutex_lock(&pool.lock);
    atomic_store(&pool.generation, next);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    fn(ctx, 0, count);
    double until = now_us() + atomic_load_explicit(&pool.spin_us, memory_order_relaxed);
    for (int i = 1; atomic_load_explicit(&pool.remaining, memory_order_acquire) > 0; i++) {
        cpu_relax();
        if ((i & 63) == 0 && now_us() > until) {
            pthread_mutex_lock(&pool.lock);
            while (atomic_load(&pool.remaining) > 0) pthread_cond_wait(&pool.done, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
            break;
        }
    }
    pthread_mutex_unlock(&pool.call);
}

void ks_pool_run(pool_fn fn, void *ctx, int count) { pool_run(fn, ctx, count); }

/* How long (microseconds) an idle worker, or a caller waiting for workers, polls before sleeping. */
void ks_set_spin_us(int spin_us) { atomic_store(&pool.spin_us, spin_us < 0 ? 0 : spin_us); }

int ks_pool_workers(void) { return pool.workers; }

/* ---------------------------------------------------------------- activation quantization */

/* q8 activations of one token in two int8 levels: qs (hi) [K] and lo [K] int8; d [K/QA] float; bsums and
   bsums_lo [K/16] int16 (q8_K only); joined [K] int16, 128 * hi + lo (|value| <= 16,320), where the AVX2
   and AVX-VNNI Q8_0 dot products read the two levels as one (join_levels; NULL elsewhere).  Value i of a
   block is d * (qs[i] + lo[i] / 128). */
typedef struct {
    int8_t *qs, *lo;
    float *d;
    int16_t *bsums, *bsums_lo;
    int16_t *joined;
} act_t;

/* a->joined from a's levels */
static void join_levels(const act_t *a, int K) {
    for (int i = 0; i < K; i++) a->joined[i] = (int16_t)(128 * a->qs[i] + a->lo[i]);
}

static inline float roundf_away(float v) { return truncf(v + copysignf(0.5f, v)); }

/* Per `group` values: d = max|x| / 127, v = x * (1 / d), hi = round(v), lo = round((v - hi) * 128) (half
   away from zero; v - hi is exact, |lo| <= 64).  The pair carries x to about max|x| * 2^-15. */
static void quantize_act(const float *x, int K, int group, int8_t *qs, int8_t *lo, float *d, int16_t *bsums,
                         int16_t *bsums_lo) {
    for (int b = 0; b < K / group; b++) {
        const float *xb = x + (ptrdiff_t)b * group;
        float amax = 0.0f;
        for (int i = 0; i < group; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float db = amax / 127.0f;
        float id = db != 0.0f ? 1.0f / db : 0.0f;
        d[b] = db;
        int8_t *qb = qs + (ptrdiff_t)b * group, *lb = lo + (ptrdiff_t)b * group;
        for (int i = 0; i < group; i++) {
            float v = xb[i] * id, h = roundf_away(v);
            qb[i] = (int8_t)h;
            lb[i] = (int8_t)roundf_away((v - h) * 128.0f);
        }
    }
    if (bsums)
        for (int g = 0; g < K / 16; g++) {
            int s = 0, l = 0;
            for (int i = 0; i < 16; i++) s += qs[g * 16 + i], l += lo[g * 16 + i];
            bsums[g] = (int16_t)s;
            bsums_lo[g] = (int16_t)l;
        }
}

#if KS_X86
/* quantize_act 16 values a vector, bit for bit: the same float operations on each value (max|x| is
   exact in any order); a call's few tokens are quantized on one thread, so this is part of a step's
   serial time. */
TARGET_VNNI static void quantize_act_avx512(const float *x, int K, int group, int8_t *qs, int8_t *lo, float *d,
                                            int16_t *bsums, int16_t *bsums_lo) {
    const __m512 sign = _mm512_set1_ps(-0.0f), half = _mm512_set1_ps(0.5f), step = _mm512_set1_ps(128.0f);
    for (int b = 0; b < K / group; b++) {
        const float *xb = x + (ptrdiff_t)b * group;
        __m512 m = _mm512_setzero_ps();
        for (int i = 0; i < group; i += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb + i)), m);   /* NaN: m, as fmaxf */
        const float db = _mm512_reduce_max_ps(m) / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        d[b] = db;
        for (int i = 0; i < group; i += 16) {
            const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(xb + i), _mm512_set1_ps(id));
            const __m512 h = _mm512_roundscale_ps(_mm512_add_ps(v, _mm512_or_ps(_mm512_and_ps(v, sign), half)),
                                                  _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            const __m512 r = _mm512_mul_ps(_mm512_sub_ps(v, h), step);
            const __m512 l = _mm512_roundscale_ps(_mm512_add_ps(r, _mm512_or_ps(_mm512_and_ps(r, sign), half)),
                                                  _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            const __m512i h32 = _mm512_cvttps_epi32(h), l32 = _mm512_cvttps_epi32(l);
            const ptrdiff_t at = (ptrdiff_t)b * group + i;
            _mm_storeu_si128((__m128i *)(qs + at), _mm512_cvtsepi32_epi8(h32));
            _mm_storeu_si128((__m128i *)(lo + at), _mm512_cvtsepi32_epi8(l32));
            if (bsums) {
                bsums[at / 16] = (int16_t)_mm512_reduce_add_epi32(h32);
                bsums_lo[at / 16] = (int16_t)_mm512_reduce_add_epi32(l32);
            }
        }
    }
}
#endif

/* The activation quantization with the widest path up to `isa`. */
static void quantize_act_isa(int isa, const float *x, int K, int group, int8_t *qs, int8_t *lo, float *d, int16_t *bsums,
                             int16_t *bsums_lo) {
#if KS_X86
    if (isa >= ISA_AVX512VNNI) {
        quantize_act_avx512(x, K, group, qs, lo, d, bsums, bsums_lo);
        return;
    }
#endif
    (void)isa;
    quantize_act(x, K, group, qs, lo, d, bsums, bsums_lo);
}

/* Exposed for the twins' test: the activation quantization alone. */
void ks_quantize_act(int isa, const float *x, int K, int group, int8_t *qs, int8_t *lo, float *d, int16_t *bsums,
                     int16_t *bsums_lo) {
    quantize_act_isa(isa, x, K, group, qs, lo, d, group == 256 ? bsums : NULL, bsums_lo);
}

/* ---------------------------------------------------------------- horizontal sums */

#if KS_X86
/* The dot products' software prefetch: the line PF_AHEAD bytes past what a row's loop reads now, into L1.  A
   row's blocks follow each other (and the next row follows the last), yet one thread streaming them with
   the hardware's prefetchers alone read Q4_K at 4.5 GB/s where the same loop on cached rows ran 1.6x faster;
   with these, 2.1x (AVX2, one thread, the 2-core VM). */
#define PF_AHEAD 1024
#define PF_LINES(p, n) \
    do { for (int pf_ = 0; pf_ < (n); pf_++) _mm_prefetch((const char *)(p) + PF_AHEAD + 64 * pf_, _MM_HINT_T0); } while (0)

TARGET_AVX2 static inline float hsum256_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

TARGET_AVX2 static inline int hsum256_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}
#endif

/* ---------------------------------------------------------------- Q8_0: qs [K] int8, scales [K/32] f16 */

/* Per 32-block: s = 128 * dot(w, hi) + dot(w, lo) exactly in int32 (|s| < 2^26), scaled by
   d_w * d / 128. */
static float dot_q8_0_scalar(const uint8_t *w, const uint8_t *meta, const act_t *a, int K) {
    const int8_t *wq = (const int8_t *)w;
    float acc = 0.0f;
    for (int b = 0; b < K / 32; b++) {
        int s = 0, l = 0;
        for (int i = 0; i < 32; i++) {
            s += wq[b * 32 + i] * a->qs[b * 32 + i];
            l += wq[b * 32 + i] * a->lo[b * 32 + i];
        }
        acc += h2f_at(meta + 2 * b) * a->d[b] * LO_SCALE * (float)(128 * s + l);
    }
    return acc;
}

#if KS_X86
/* |w| as unsigned bytes times a with w's sign: maddubs's operands without overflow (|a| <= 127); the two
   levels' int32 lanes joined as 128 * hi + lo.  `scale` is d_w * d / 128. */
TARGET_AVX2 static inline __m256 q8_0_block_avx2(const int8_t *wq, const int8_t *aq, const int8_t *al, float scale,
                                                 __m256 acc) {
    __m256i w = _mm256_loadu_si256((const __m256i *)wq);
    __m256i aw = _mm256_sign_epi8(w, w), ones = _mm256_set1_epi16(1);
    __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)aq), w)), ones);
    __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)al), w)), ones);
    __m256i p32 = _mm256_add_epi32(_mm256_slli_epi32(ph, 7), pl);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_set1_ps(scale), acc);
}

#define Q8_0_SCALE(b) (h2f_at(meta + 2 * (b)) * a->d[b] * LO_SCALE)

TARGET_AVX2 static float dot_q8_0_levels_avx2(const uint8_t *w, const uint8_t *meta, const act_t *a, int K) {
    const int8_t *wq = (const int8_t *)w;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int nb = K / 32, b = 0;
    for (; b + 2 <= nb; b += 2) {
        acc0 = q8_0_block_avx2(wq + b * 32, a->qs + b * 32, a->lo + b * 32, Q8_0_SCALE(b), acc0);
        acc1 = q8_0_block_avx2(wq + b * 32 + 32, a->qs + b * 32 + 32, a->lo + b * 32 + 32, Q8_0_SCALE(b + 1), acc1);
    }
    if (b < nb) acc0 = q8_0_block_avx2(wq + b * 32, a->qs + b * 32, a->lo + b * 32, Q8_0_SCALE(b), acc0);
    return hsum256_ps(_mm256_add_ps(acc0, acc1));
}

/* With the levels joined (act_t.joined: 128 * hi + lo in 16 bits), a block is 32 weights widened to 16 bits
   times 32 joined values: two vpmaddwd (AVX-VNNI: one, then a vpdpwssd into it), the int32 lanes the
   same sum of 128 * hi + lo products as two levels' bytes give (each below 2^24); its scale d_w * d / 128
   in float, eight blocks' at once (F16C), one lane of them broadcast per block. */
#define Q8_0_JOINED_DOT(NAME, TARGET, PAIR)                                                                          \
    TARGET static float NAME(const uint8_t *w, const uint8_t *meta, const act_t *a, int K) {                       \
        const int8_t *wq = (const int8_t *)w;                                                                        \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                                               \
        int nb = K / 32, b = 0;                                                                                      \
        for (; b + 8 <= nb; b += 8) {                                                                                \
            PF_LINES(wq + 32 * b, 4);                                                                                \
            const __m256 s = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(meta + 2 * b))), \
                                                         _mm256_loadu_ps(a->d + b)), _mm256_set1_ps(LO_SCALE));      \
            for (int i = 0; i < 8; i += 2) {                                                                         \
                acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(PAIR(wq + 32 * (b + i), a->joined + 32 * (b + i))),        \
                                       _mm256_permutevar8x32_ps(s, _mm256_set1_epi32(i)), acc0);                     \
                acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(PAIR(wq + 32 * (b + i + 1), a->joined + 32 * (b + i + 1))), \
                                       _mm256_permutevar8x32_ps(s, _mm256_set1_epi32(i + 1)), acc1);                 \
            }                                                                                                        \
        }                                                                                                            \
        for (; b < nb; b++)                                                                                          \
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(PAIR(wq + 32 * b, a->joined + 32 * b)), _mm256_set1_ps(Q8_0_SCALE(b)), acc0); \
        return hsum256_ps(_mm256_add_ps(acc0, acc1));                                                                \
    }

TARGET_AVX2 static inline __m256i q8_0_joined_avx2(const int8_t *wq, const int16_t *x) {
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)wq)), _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wq + 16))),
                                              _mm256_loadu_si256((const __m256i *)(x + 16))));
}

TARGET_AVXVNNI static inline __m256i q8_0_joined_avxvnni(const int8_t *wq, const int16_t *x) {
    return _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)wq)),
                                                     _mm256_loadu_si256((const __m256i *)x)),
                                   _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wq + 16))),
                                   _mm256_loadu_si256((const __m256i *)(x + 16)));
}

Q8_0_JOINED_DOT(dot_q8_0_joined_avx2, TARGET_AVX2, q8_0_joined_avx2)
Q8_0_JOINED_DOT(dot_q8_0_joined_avxvnni, TARGET_AVXVNNI, q8_0_joined_avxvnni)

/* Where a matmul made no joined levels (a caller of its own quantization), the two levels' bytes. */
TARGET_AVX2 static float dot_q8_0_avx2(const uint8_t *w, const uint8_t *meta, const act_t *a, int K) {
    return a->joined ? dot_q8_0_joined_avx2(w, meta, a, K) : dot_q8_0_levels_avx2(w, meta, a, K);
}

TARGET_AVXVNNI static float dot_q8_0_avxvnni(const uint8_t *w, const uint8_t *meta, const act_t *a, int K) {
    return a->joined ? dot_q8_0_joined_avxvnni(w, meta, a, K) : dot_q8_0_levels_avx2(w, meta, a, K);
}

/* Two 32-value blocks' scales as one vector: lanes 0-7 s0, lanes 8-15 s1. */
TARGET_VNNI static inline __m512 pair_scale(float s0, float s1) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(s0)),
                                               _mm256_castps_pd(_mm256_set1_ps(s1)), 1));
}

TARGET_VNNI static inline __m512 q8_0_pair_vnni(const int8_t *wq, const int8_t *aq, const int8_t *al, __m512 scale,
                                               __m512 acc) {
    __m512i w = _mm512_loadu_si512((const void *)wq), aw = _mm512_abs_epi8(w);
    __mmask64 negative = _mm512_movepi8_mask(w);
    __m512i x = _mm512_loadu_si512((const void *)aq), xl = _mm512_loadu_si512((const void *)al);
    __m512i xs = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
    __m512i xls = _mm512_mask_sub_epi8(xl, negative, _mm512_setzero_si512(), xl);
    __m512i p = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, xs), 7);
    p = _mm512_dpbusd_epi32(p, aw, xls);                /* 128 * hi + lo */
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, acc);
}

TARGET_VNNI static float dot_q8_0_vnni(const uint8_t *w, const uint8_t *meta, const act_t *a, int K) {
    const int8_t *wq = (const int8_t *)w;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int nb = K / 32, b = 0;
    for (; b + 4 <= nb; b += 4) {
        PF_LINES(wq + 32 * b, 2);
        __m128 wd = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(meta + 2 * b)));
        __m128 s = _mm_mul_ps(_mm_mul_ps(wd, _mm_loadu_ps(a->d + b)), _mm_set1_ps(LO_SCALE));
        float sv[4];
        _mm_storeu_ps(sv, s);
        acc0 = q8_0_pair_vnni(wq + b * 32, a->qs + b * 32, a->lo + b * 32, pair_scale(sv[0], sv[1]), acc0);
        acc1 = q8_0_pair_vnni(wq + b * 32 + 64, a->qs + b * 32 + 64, a->lo + b * 32 + 64, pair_scale(sv[2], sv[3]), acc1);
    }
    float r = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    __m256 tail = _mm256_setzero_ps();
    for (; b < nb; b++) tail = q8_0_block_avx2(wq + b * 32, a->qs + b * 32, a->lo + b * 32, Q8_0_SCALE(b), tail);
    return r + hsum256_ps(tail);
}
#endif

/* ---------------------------------------------------------------- Q4_0: 18-byte blocks, d f16 + 16 nibble bytes */

static float dot_q4_0_scalar(const uint8_t *w, const uint8_t *meta, const act_t *a, int K) {
    (void)meta;
    float acc = 0.0f;
    for (int b = 0; b < K / 32; b++) {
        const uint8_t *blk = w + 18 * b;
        const int8_t *x = a->qs + b * 32, *xl = a->lo + b * 32;
        int s = 0, l = 0;
        for (int i = 0; i < 16; i++) {
            int q0 = (blk[2 + i] & 0x0F) - 8, q1 = (blk[2 + i] >> 4) - 8;
            s += q0 * x[i] + q1 * x[i + 16];
            l += q0 * xl[i] + q1 * xl[i + 16];
        }
        acc += h2f_at(blk) * a->d[b] * LO_SCALE * (float)(128 * s + l);
    }
    return acc;
}

#if KS_X86
TARGET_AVX2 static inline __m256 q4_0_block_avx2(const uint8_t *blk, const int8_t *aq, const int8_t *al, float scale,
                                                 __m256 acc) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + 2));
    __m128i low = _mm_set1_epi8(0x0F);
    __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
    q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
    __m256i aw = _mm256_sign_epi8(q, q), ones = _mm256_set1_epi16(1);
    __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)aq), q)), ones);
    __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)al), q)), ones);
    __m256i p32 = _mm256_add_epi32(_mm256_slli_epi32(ph, 7), pl);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_set1_ps(scale), acc);
}

#define Q4_0_SCALE(b) (h2f_at(w + 18 * (b)) * a->d[b] * LO_SCALE)


/* With the levels joined (as the Q8_0 dots): the block's 32 nibbles less 8 widened to 16 bits, two vpmaddwd
   (AVX-VNNI: a vpmaddwd and a vpdpwssd) against the joined values. */
TARGET_AVX2 static inline __m256i q4_0_values16(const uint8_t *blk, __m256i *high) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + 2)), low = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    *high = _mm256_cvtepi8_epi16(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), eight));
    return _mm256_cvtepi8_epi16(_mm_sub_epi8(_mm_and_si128(bytes, low), eight));
}

#define Q4_0_JOINED_DOT(NAME, TARGET, PAIR)                                                                          \
    TARGET static float NAME(const uint8_t *w, const act_t *a, int K) {                                             \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                                               \
        for (int b = 0; b < K / 32; b++) {                                                                           \
            if (!(b & 3)) PF_LINES(w + 18 * b, 2);                                                                   \
            __m256i hi16, lo16 = q4_0_values16(w + 18 * b, &hi16);                                                   \
            const __m256 p = _mm256_cvtepi32_ps(PAIR(lo16, hi16, a->joined + 32 * b));                               \
            if (b & 1) acc1 = _mm256_fmadd_ps(p, _mm256_set1_ps(Q4_0_SCALE(b)), acc1);                              \
            else acc0 = _mm256_fmadd_ps(p, _mm256_set1_ps(Q4_0_SCALE(b)), acc0);                                    \
        }                                                                                                            \
        return hsum256_ps(_mm256_add_ps(acc0, acc1));                                                                \
    }

TARGET_AVX2 static inline __m256i q4_0_joined_avx2(__m256i lo16, __m256i hi16, const int16_t *x) {
    return _mm256_add_epi32(_mm256_madd_epi16(lo16, _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(hi16, _mm256_loadu_si256((const __m256i *)(x + 16))));
}

TARGET_AVXVNNI static inline __m256i q4_0_joined_avxvnni(__m256i lo16, __m256i hi16, const int16_t *x) {
    return _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(lo16, _mm256_loadu_si256((const __m256i *)x)), hi16,
                                   _mm256_loadu_si256((const __m256i *)(x + 16)));
}

Q4_0_JOINED_DOT(dot_q4_0_joined_avx2, TARGET_AVX2, q4_0_joined_avx2)
Q4_0_JOINED_DOT(dot_q4_0_joined_avxvnni, TARGET_AVXVNNI, q4_0_joined_avxvnni)

TARGET_AVX2 static float dot_q4_0_avx2(const uint8_t *w, const uint8_t *meta, const act_t *a, int K) {
    (void)meta;
    if (a->joined) return dot_q4_0_joined_avx2(w, a, K);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int nb = K / 32, b = 0;
    for (; b + 2 <= nb; b += 2) {
        acc0 = q4_0_block_avx2(w + 18 * b, a->qs + b * 32, a->lo + b * 32, Q4_0_SCALE(b), acc0);
        acc1 = q4_0_block_avx2(w + 18 * b + 18, a->qs + b * 32 + 32, a->lo + b * 32 + 32, Q4_0_SCALE(b + 1), acc1);
    }
    if (b < nb) acc0 = q4_0_block_avx2(w + 18 * b, a->qs + b * 32, a->lo + b * 32, Q4_0_SCALE(b), acc0);
    return hsum256_ps(_mm256_add_ps(acc0, acc1));
}

/* Where a matmul made no joined levels (a caller of its own quantization), the two levels' bytes. */
TARGET_AVXVNNI static float dot_q4_0_avxvnni(const uint8_t *w, const uint8_t *meta, const act_t *a, int K) {
    return a->joined ? dot_q4_0_joined_avxvnni(w, a, K) : dot_q4_0_avx2(w, meta, a, K);
}

/* Two blocks per vector, nibbles unsigned (0..15): dot(q, x) - dot(8, x) per lane is exact, for each
   level, joined as 128 * hi + lo.  Eight blocks per turn: their eight scales (times the activations')
   in one vector, permuted into the lanes of each pair. */
TARGET_VNNI static inline __m512i q4_0_pair_dot(const uint8_t *b0, const int8_t *x, const int8_t *xl) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m512i order = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), eight = _mm512_set1_epi8(8);
    __m256i bytes = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(b0 + 20)), _mm_loadu_si128((const __m128i *)(b0 + 2)));
    __m256i lo = _mm256_and_si256(bytes, low), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
    /* [lo0 hi0 lo1 hi1]: block 0's values 0..31, then block 1's */
    __m512i q = _mm512_permutex2var_epi64(_mm512_castsi256_si512(lo), order, _mm512_castsi256_si512(hi));
    __m512i xv = _mm512_loadu_si512((const void *)x), xlv = _mm512_loadu_si512((const void *)xl);
    __m512i h = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xv),
                                 _mm512_dpbusd_epi32(_mm512_setzero_si512(), eight, xv));
    __m512i l = _mm512_dpbusd_epi32(_mm512_slli_epi32(h, 7), q, xlv);
    return _mm512_sub_epi32(l, _mm512_dpbusd_epi32(_mm512_setzero_si512(), eight, xlv));
}

TARGET_VNNI static float dot_q4_0_vnni(const uint8_t *w, const uint8_t *meta, const act_t *a, int K) {
    (void)meta;
    __m512i pick[4];            /* lanes 0-7: block 2p's scale, 8-15: block 2p+1's */
    for (int p = 0; p < 4; p++)
        pick[p] = _mm512_inserti64x4(_mm512_set1_epi32(2 * p), _mm256_set1_epi32(2 * p + 1), 1);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int nb = K / 32, b = 0;
    for (; b + 8 <= nb; b += 8) {
        const uint8_t *blk = w + 18 * b;
        PF_LINES(blk, 3);
        uint16_t d[8];
        for (int i = 0; i < 8; i++) memcpy(d + i, blk + 18 * i, 2);
        __m256 s = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d)), _mm256_loadu_ps(a->d + b)),
                                 _mm256_set1_ps(LO_SCALE));
        __m512 s512 = _mm512_castps256_ps512(s);
        const int8_t *x = a->qs + b * 32, *xl = a->lo + b * 32;
        acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q4_0_pair_dot(blk, x, xl)), _mm512_permutexvar_ps(pick[0], s512), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q4_0_pair_dot(blk + 36, x + 64, xl + 64)), _mm512_permutexvar_ps(pick[1], s512), acc1);
        acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q4_0_pair_dot(blk + 72, x + 128, xl + 128)), _mm512_permutexvar_ps(pick[2], s512), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q4_0_pair_dot(blk + 108, x + 192, xl + 192)), _mm512_permutexvar_ps(pick[3], s512), acc1);
    }
    for (; b + 2 <= nb; b += 2)
        acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q4_0_pair_dot(w + 18 * b, a->qs + b * 32, a->lo + b * 32)),
                               pair_scale(Q4_0_SCALE(b), Q4_0_SCALE(b + 1)), acc0);
    float r = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    if (b < nb) r += hsum256_ps(q4_0_block_avx2(w + 18 * b, a->qs + b * 32, a->lo + b * 32, Q4_0_SCALE(b), _mm256_setzero_ps()));
    return r;
}
#endif

/* ---------------------------------------------------------------- Q4_K: 144-byte super-blocks of 256 */

static inline int q4k_mins(const int *m, const int16_t *bsums) {
    int s = 0;
    for (int j = 0; j < 8; j++) s += m[j] * (bsums[2 * j] + bsums[2 * j + 1]);
    return s;
}

/* Per super-block: sumi = 128 * sumi(hi) + sumi(lo) and summ likewise from each level's bsums, in 64 bits
   (the joined sums can pass 2^31), scaled by d / 128. */
static float dot_q4_K_scalar(const uint8_t *w, const uint8_t *meta, const act_t *a, int K) {
    (void)meta;
    float acc = 0.0f;
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk = w + 144 * b, *qs = blk + 16;
        const int8_t *x = a->qs + b * 256, *xl = a->lo + b * 256;
        int sc[8], m[8];
        q4k_scale_min(blk + 4, sc, m);
        int64_t sumi = 0;
        for (int c = 0; c < 4; c++) {
            int lo = 0, hi = 0, lo_l = 0, hi_l = 0;
            for (int i = 0; i < 32; i++) {
                int q0 = qs[32 * c + i] & 0x0F, q1 = qs[32 * c + i] >> 4;
                lo += q0 * x[64 * c + i];
                hi += q1 * x[64 * c + 32 + i];
                lo_l += q0 * xl[64 * c + i];
                hi_l += q1 * xl[64 * c + 32 + i];
            }
            sumi += (int64_t)sc[2 * c] * (128 * lo + lo_l) + (int64_t)sc[2 * c + 1] * (128 * hi + hi_l);
        }
        int64_t summ = 128 * (int64_t)q4k_mins(m, a->bsums + b * 16) + q4k_mins(m, a->bsums_lo + b * 16);
        acc += a->d[b] * LO_SCALE * (h2f_at(blk) * (float)sumi - h2f_at(blk + 2) * (float)summ);
    }
    return acc;
}

#if KS_X86
/* The 8 scales and 8 mins of a Q4_K super-block as bytes, from its 12 packed bytes, four at a time
   (the same unpacking as q4k_scale_min). */
static inline void q4k_scale_min_bytes(const uint8_t *q, uint8_t *sc, uint8_t *m) {
    uint32_t w[3], out[4];
    memcpy(w, q, 12);
    out[0] = w[0] & 0x3f3f3f3fu;
    out[1] = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);
    out[2] = w[1] & 0x3f3f3f3fu;
    out[3] = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);
    memcpy(sc, out, 8);
    memcpy(m, out + 2, 8);
}

/* Per 32-byte chunk (sub-blocks 2c, 2c + 1: the low and high nibbles) each level's int16 pair sums times
   the sub-block's scale (madd) into int32 lanes, joined per lane as 128 * hi + lo (below 2^31: a lane adds
   8 madds of at most 2 x 3,810 x 63), scaled in float per super-block and reduced once at the end; the mins
   as dot_q4_K_vnni's (SSE).  The scales' unpacking, the joins and the reductions were scalar per super-block
   before: about half of the work at one token. */
TARGET_AVX2 static float dot_q4_K_avx2(const uint8_t *w, const uint8_t *meta, const act_t *a, int K) {
    (void)meta;
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps();
    __m128 acc_min = _mm_setzero_ps();
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk = w + 144 * b, *qs = blk + 16;
        const int8_t *x = a->qs + b * 256, *xl = a->lo + b * 256;
        PF_LINES(blk, 3);
        uint8_t sc[8], m[8];
        q4k_scale_min_bytes(blk + 4, sc, m);
        __m256i sum = _mm256_setzero_si256(), sum_l = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            __m256i ql = _mm256_and_si256(q, low), qh = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
            __m256i s0 = _mm256_set1_epi16((short)sc[2 * c]), s1 = _mm256_set1_epi16((short)sc[2 * c + 1]);
            __m256i lo = _mm256_maddubs_epi16(ql, _mm256_loadu_si256((const __m256i *)(x + 64 * c)));
            __m256i hi = _mm256_maddubs_epi16(qh, _mm256_loadu_si256((const __m256i *)(x + 64 * c + 32)));
            sum = _mm256_add_epi32(sum, _mm256_add_epi32(_mm256_madd_epi16(lo, s0), _mm256_madd_epi16(hi, s1)));
            lo = _mm256_maddubs_epi16(ql, _mm256_loadu_si256((const __m256i *)(xl + 64 * c)));
            hi = _mm256_maddubs_epi16(qh, _mm256_loadu_si256((const __m256i *)(xl + 64 * c + 32)));
            sum_l = _mm256_add_epi32(sum_l, _mm256_add_epi32(_mm256_madd_epi16(lo, s0), _mm256_madd_epi16(hi, s1)));
        }
        const float dad = h2f_at(blk) * (a->d[b] * LO_SCALE), dmad = h2f_at(blk + 2) * (a->d[b] * LO_SCALE);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(sum, 7), sum_l)), _mm256_set1_ps(dad), acc);
        __m128i m16 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)m));
        const __m128i *bs = (const __m128i *)(a->bsums + b * 16), *bl = (const __m128i *)(a->bsums_lo + b * 16);
        __m128i mins = _mm_madd_epi16(m16, _mm_hadd_epi16(_mm_loadu_si128(bs), _mm_loadu_si128(bs + 1)));
        __m128i mins_l = _mm_madd_epi16(m16, _mm_hadd_epi16(_mm_loadu_si128(bl), _mm_loadu_si128(bl + 1)));
        acc_min = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_add_epi32(_mm_slli_epi32(mins, 7), mins_l)), _mm_set1_ps(dmad), acc_min);
    }
    __m128 t = _mm_add_ps(acc_min, _mm_movehl_ps(acc_min, acc_min));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    return hsum256_ps(acc) - _mm_cvtss_f32(t);
}

TARGET_VNNI static inline __m512i pair_epi16(int s0, int s1) {
    return _mm512_inserti64x4(_mm512_set1_epi16((short)s0), _mm256_set1_epi16((short)s1), 1);
}

TARGET_VNNI static inline __m512i load_pair256(const int8_t *p0, const int8_t *p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p0)),
                              _mm256_loadu_si256((const __m256i *)p1), 1);
}


/* 64 quant bytes (two 32-byte chunks) per vector: low nibbles are sub-blocks 4c, 4c+2; high 4c+1, 4c+3.
   Scales reach the 16-bit lanes by one permute of the 8 scales; the per-lane int32 sums are scaled in
   float per super-block and reduced once at the end; the mins term (dmin * sum_j m_j * (sum of the
   activations of sub-block j)) runs on 128-bit vectors. */
TARGET_VNNI static float dot_q4_K_vnni(const uint8_t *w, const uint8_t *meta, const act_t *a, int K) {
    (void)meta;
    const __m512i low = _mm512_set1_epi8(0x0F);
    /* 16-bit lane l of a permuted scale vector takes scale idx[l]: lanes 0-15 one sub-block, 16-31 another */
    const __m512i pick02 = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    const __m512i pick13 = _mm512_inserti64x4(_mm512_set1_epi16(1), _mm256_set1_epi16(3), 1);
    const __m512i pick46 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    const __m512i pick57 = _mm512_inserti64x4(_mm512_set1_epi16(5), _mm256_set1_epi16(7), 1);
    __m512 acc = _mm512_setzero_ps();
    __m128 acc_min = _mm_setzero_ps();
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk = w + 144 * b, *qs = blk + 16;
        uint8_t sc[8], m[8];
        q4k_scale_min_bytes(blk + 4, sc, m);
        __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
        __m512i s02 = _mm512_permutexvar_epi16(pick02, sc16), s13 = _mm512_permutexvar_epi16(pick13, sc16);
        __m512i s46 = _mm512_permutexvar_epi16(pick46, sc16), s57 = _mm512_permutexvar_epi16(pick57, sc16);
        __m512i q0 = _mm512_loadu_si512((const void *)qs), q1 = _mm512_loadu_si512((const void *)(qs + 64));
        __m512i n0 = _mm512_and_si512(q0, low), n1 = _mm512_and_si512(_mm512_srli_epi16(q0, 4), low);
        __m512i n2 = _mm512_and_si512(q1, low), n3 = _mm512_and_si512(_mm512_srli_epi16(q1, 4), low);
        __m512i sum = _mm512_setzero_si512();
        for (int level = 0; level < 2; level++) {   /* hi, then lo: sum = 128 * hi + lo per lane (< 2^27) */
            const int8_t *x = (level ? a->lo : a->qs) + b * 256;
            __m512i p0 = _mm512_maddubs_epi16(n0, load_pair256(x, x + 64));
            __m512i p1 = _mm512_maddubs_epi16(n1, load_pair256(x + 32, x + 96));
            __m512i p2 = _mm512_maddubs_epi16(n2, load_pair256(x + 128, x + 192));
            __m512i p3 = _mm512_maddubs_epi16(n3, load_pair256(x + 160, x + 224));
            sum = _mm512_add_epi32(_mm512_slli_epi32(sum, 7),
                                   _mm512_add_epi32(_mm512_add_epi32(_mm512_madd_epi16(p0, s02), _mm512_madd_epi16(p1, s13)),
                                                    _mm512_add_epi32(_mm512_madd_epi16(p2, s46), _mm512_madd_epi16(p3, s57))));
        }
        float dad = h2f_at(blk) * (a->d[b] * LO_SCALE), dmad = h2f_at(blk + 2) * (a->d[b] * LO_SCALE);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(dad), acc);
        /* sums of the activations per sub-block of 32 (pairs of bsums) times the mins, each level */
        __m128i m16 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)m));
        const __m128i *bs = (const __m128i *)(a->bsums + b * 16), *bl = (const __m128i *)(a->bsums_lo + b * 16);
        __m128i mins = _mm_madd_epi16(m16, _mm_hadd_epi16(_mm_loadu_si128(bs), _mm_loadu_si128(bs + 1)));
        __m128i mins_l = _mm_madd_epi16(m16, _mm_hadd_epi16(_mm_loadu_si128(bl), _mm_loadu_si128(bl + 1)));
        mins = _mm_add_epi32(_mm_slli_epi32(mins, 7), mins_l);
        acc_min = _mm_fmadd_ps(_mm_cvtepi32_ps(mins), _mm_set1_ps(dmad), acc_min);
    }
    __m128 t = _mm_add_ps(acc_min, _mm_movehl_ps(acc_min, acc_min));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    return _mm512_reduce_add_ps(acc) - _mm_cvtss_f32(t);
}
#endif

/* ---------------------------------------------------------------- Q6_K: 210-byte super-blocks of 256 */
/* value 128h + 32s + i: low 4 bits from ql[64h + 32(s%2) + i] (low nibble for s < 2, high for s >= 2),
   high 2 bits from qh[32h + i] >> 2s; q - 32 times the int8 scale of its 16. */

static inline int q6k_offsets(const int8_t *sc, const int16_t *bsums) {
    int s = 0;
    for (int g = 0; g < 16; g++) s += sc[g] * bsums[g];
    return 32 * s;
}

/* Per super-block: sumi = 128 * sumi(hi) + sumi(lo) (each less its offsets), in 64 bits, scaled by
   d * d_w / 128. */
static float dot_q6_K_scalar(const uint8_t *w, const uint8_t *meta, const act_t *a, int K) {
    (void)meta;
    float acc = 0.0f;
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk = w + 210 * b, *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const int8_t *x = a->qs + b * 256, *xl = a->lo + b * 256;
        int sums[16] = {0}, sums_l[16] = {0};
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int i = 0; i < 32; i++) {
                    int l = ql[64 * h + 32 * (s & 1) + i];
                    l = s < 2 ? l & 0x0F : l >> 4;
                    int q = l | (((qh[32 * h + i] >> (2 * s)) & 3) << 4);
                    int e = 128 * h + 32 * s + i;
                    sums[e / 16] += q * x[e];
                    sums_l[e / 16] += q * xl[e];
                }
        int sumi = 0, sumi_l = 0;
        for (int g = 0; g < 16; g++) sumi += sc[g] * sums[g], sumi_l += sc[g] * sums_l[g];
        sumi -= q6k_offsets(sc, a->bsums + b * 16);
        sumi_l -= q6k_offsets(sc, a->bsums_lo + b * 16);
        acc += a->d[b] * LO_SCALE * h2f_at(blk + 208) * (float)(128 * (int64_t)sumi + sumi_l);
    }
    return acc;
}

#if KS_X86
/* Per piece of 32 values (two groups of 16, their scales in the two 128-bit halves) each level's int16 pair
   sums times the scales (madd) into int32 lanes, joined in float (128 * hi + lo can pass 2^31 here) and
   scaled per super-block, reduced once; the offsets (32 * sum_g scale_g * bsum_g, both levels joined in
   int32) on a 256-bit vector: dot_q6_K_vnni's steps at half the width. */
TARGET_AVX2 static float dot_q6_K_avx2(const uint8_t *w, const uint8_t *meta, const act_t *a, int K) {
    (void)meta;
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3);
    __m256 acc = _mm256_setzero_ps(), acc_off = _mm256_setzero_ps();
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk = w + 210 * b, *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const int8_t *x = a->qs + b * 256, *xl = a->lo + b * 256;
        PF_LINES(blk, 4);
        __m256i sum = _mm256_setzero_si256(), sum_l = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
            __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            __m256i lows[4] = {_mm256_and_si256(l0, low), _mm256_and_si256(l1, low),
                               _mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                               _mm256_and_si256(_mm256_srli_epi16(l1, 4), low)};
            for (int s = 0; s < 4; s++) {
                __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * s), two), 4);
                __m256i q = _mm256_or_si256(lows[s], high);
                int g = 8 * h + 2 * s;
                __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
                __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)(x + 128 * h + 32 * s)));
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, scale));
                p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)(xl + 128 * h + 32 * s)));
                sum_l = _mm256_add_epi32(sum_l, _mm256_madd_epi16(p, scale));
            }
        }
        const float dad = h2f_at(blk + 208) * (a->d[b] * LO_SCALE);
        __m256 joined = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(128.0f), _mm256_cvtepi32_ps(sum_l));
        acc = _mm256_fmadd_ps(joined, _mm256_set1_ps(dad), acc);
        __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        __m256i off = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a->bsums + b * 16)), sc16);
        __m256i off_l = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a->bsums_lo + b * 16)), sc16);
        off = _mm256_add_epi32(_mm256_slli_epi32(off, 7), off_l);
        acc_off = _mm256_fmadd_ps(_mm256_cvtepi32_ps(off), _mm256_set1_ps(32.0f * dad), acc_off);
    }
    return hsum256_ps(acc) - hsum256_ps(acc_off);
}

/* 64 values per vector: half h's s and s+1 (two 32-value pieces), their four scales of 16 through one
   permute of the 16 scales; per-lane int32 sums of each level, joined in float (128 * hi + lo can pass
   2^31 here) and scaled per super-block, reduced once; the offset (32 * sum_g scale_g * bsum_g, the two
   levels' bsums joined in int32) on a 256-bit vector. */
TARGET_VNNI static float dot_q6_K_vnni(const uint8_t *w, const uint8_t *meta, const act_t *a, int K) {
    (void)meta;
    const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(3);
    __m512i pick[4];            /* lanes 0-7: scale 4i, 8-15: 4i+1, 16-23: 4i+2, 24-31: 4i+3 */
    for (int i = 0; i < 4; i++)
        pick[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16((short)(4 * i + 1)),
                                                                             _mm_set1_epi16((short)(4 * i)))),
                                     _mm256_set_m128i(_mm_set1_epi16((short)(4 * i + 3)), _mm_set1_epi16((short)(4 * i + 2))), 1);
    __m512 acc = _mm512_setzero_ps();
    __m256 acc_off = _mm256_setzero_ps();
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk = w + 210 * b, *ql = blk, *qh = blk + 128;
        const int8_t *x = a->qs + b * 256, *xl = a->lo + b * 256;
        __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        __m512i sc512 = _mm512_castsi256_si512(sc16);
        __m512i sum = _mm512_setzero_si512(), sum_l = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            __m512i l = _mm512_loadu_si512((const void *)(ql + 64 * h));   /* pieces s=0 | s=1 low nibbles */
            __m256i hb256 = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(hb256), hb256, 1);
            for (int p = 0; p < 2; p++) {       /* p = 0: s = 0, 1 (low nibbles); p = 1: s = 2, 3 (high) */
                __m512i lq = p == 0 ? _mm512_and_si512(l, low) : _mm512_and_si512(_mm512_srli_epi16(l, 4), low);
                /* lanes 0-255 are piece s = 2p (shift 4p), lanes 256-511 piece s = 2p + 1 (shift 4p + 2) */
                __m512i shifted = _mm512_mask_blend_epi64(0xF0, _mm512_srli_epi16(hb, 4 * p), _mm512_srli_epi16(hb, 4 * p + 2));
                __m512i q = _mm512_or_si512(lq, _mm512_slli_epi16(_mm512_and_si512(shifted, two), 4));
                __m512i scale = _mm512_permutexvar_epi16(pick[2 * h + p], sc512);
                __m512i prod = _mm512_maddubs_epi16(q, _mm512_loadu_si512((const void *)(x + 128 * h + 64 * p)));
                sum = _mm512_add_epi32(sum, _mm512_madd_epi16(prod, scale));
                prod = _mm512_maddubs_epi16(q, _mm512_loadu_si512((const void *)(xl + 128 * h + 64 * p)));
                sum_l = _mm512_add_epi32(sum_l, _mm512_madd_epi16(prod, scale));
            }
        }
        float dad = h2f_at(blk + 208) * (a->d[b] * LO_SCALE);
        __m512 joined = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(128.0f), _mm512_cvtepi32_ps(sum_l));
        acc = _mm512_fmadd_ps(joined, _mm512_set1_ps(dad), acc);
        __m256i off = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a->bsums + b * 16)), sc16);
        __m256i off_l = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a->bsums_lo + b * 16)), sc16);
        off = _mm256_add_epi32(_mm256_slli_epi32(off, 7), off_l);
        acc_off = _mm256_fmadd_ps(_mm256_cvtepi32_ps(off), _mm256_set1_ps(32.0f * dad), acc_off);
    }
    return _mm512_reduce_add_ps(acc) - hsum256_ps(acc_off);
}
#endif

/* ---------------------------------------------------------------- one call's state */

typedef struct {
    int fmt, isa, N, K, T, group;
    const uint8_t *w, *meta;
    ptrdiff_t w_stride, meta_stride, x_stride, out_stride;
    int half;                       /* rows from here on start at w + up_w (meta + up_meta): glu's up half */
    int pairs;                      /* the up half interleaved with the gate's (0 < up_w < w_stride) */
    ptrdiff_t up_w, up_meta;
    const float *x;
    float *out;
    const float *norm;              /* the prologue's rmsnorm weight [K], or NULL */
    float eps;
    uint8_t *buf, *tiles;
    size_t per_token, qs_bytes, d_bytes, bs_bytes, tile_bytes, joined_at;     /* joined_at: 0 without */
    int token_groups, row_tiles;
    int kq_grab;                    /* repacked Q4_K / Q6_K: row groups a thread takes at a time */
    int dot_grab;                   /* a dot product per row and token: row tiles a thread takes at a time */
    kq_acts_t kq_acts;              /* and the activations as their kernels read them (in `tiles`) */
    _Atomic int next;               /* the next row tile (row group) to hand out */
    _Atomic int failed;
    int lanes, glu, grabs;          /* tokens in lanes; a SiLU·mul epilogue; the row ranges a job hands out */
    int amx;                        /* the lanes' tiles multiplied on AMX tiles (Q8_0, ks_amx_min_tokens+) */
    size_t tiles_bytes;             /* the lanes' tiles or the repacked kernels' activations (64-byte multiple) */
    float *glu_out;                 /* glu: where the epilogue writes (out holds the gate | up rows) */
    ptrdiff_t glu_stride;
} matmul_t;

/* Token t's activations in buf: hi [K] | lo [K] | d [K/group] | bsums [K/16] | bsums_lo [K/16] (q8_K). */
static inline act_t token_act(const matmul_t *m, int t) {
    uint8_t *p = m->buf + m->per_token * (size_t)t, *d = p + 2 * m->qs_bytes;
    int16_t *bs = m->bs_bytes ? (int16_t *)(d + m->d_bytes) : NULL;
    return (act_t){(int8_t *)p, (int8_t *)(p + m->qs_bytes), (float *)d, bs, bs ? bs + m->bs_bytes / 2 : NULL,
                   m->joined_at ? (int16_t *)(p + m->joined_at) : NULL};
}

static inline int repacked(int fmt) { return fmt == FMT_Q4_K_R16 || fmt == FMT_Q6_K_R16; }

/* Row r's weight bytes and meta (NULL without) of a plain format: glu's up half where up_w says. */
static inline const uint8_t *row_w(const matmul_t *m, ptrdiff_t r) {
    return r < m->half ? m->w + m->w_stride * r : m->w + m->up_w + m->w_stride * (r - m->half);
}

static inline const uint8_t *row_meta(const matmul_t *m, ptrdiff_t r) {
    if (!m->meta) return NULL;
    return r < m->half ? m->meta + m->meta_stride * r : m->meta + m->up_meta + m->meta_stride * (r - m->half);
}

/* The row computed j-th: in memory order, so with the halves interleaved gate 0, up 0, gate 1, ... (a
   row at a time from each half would read every other row, and the prefetchers lose the stream). */
static inline ptrdiff_t logical_row(const matmul_t *m, ptrdiff_t j) {
    return m->pairs ? ((j & 1) ? m->half + (j >> 1) : j >> 1) : j;
}

/* A spec's up half, from w and meta (ks_linear_t's up_w, up_meta; 0: after the gate half). */
static inline ptrdiff_t up_w_of(const ks_linear_t *s) { return s->up_w ? s->up_w : s->w_stride * (s->N / 2); }
static inline ptrdiff_t up_meta_of(const ks_linear_t *s) { return s->up_meta ? s->up_meta : s->meta_stride * (s->N / 2); }

/* ---------------------------------------------------------------- many tokens: tokens in lanes (VNNI) */
/* For 4+ tokens, vpdpbusd runs with 16 tokens in the lanes of one vector: each token's activations
   as unsigned bytes (q + 128), 4 values per lane (act_tiles), and 4 of one weight row's signed values
   broadcast to every lane.  A weight row is unpacked once per call (unpack_row: signed values, a
   float scale and its value sum per group of G, Q4_K's min per group) and read by every token, so a
   block is decoded once, not once per token.  q + 128 adds 128 * (the row's group sum), taken off
   before the group's float scale.  Each level has its own bytes and its own int32 sums per group, both
   fed by one broadcast of each weight quad; the hi sum shifted by 7 (times 128) plus the lo sum is
   128 * hi + lo exactly (below 2^27 for every format's groups), and the tile's scales are d / 128. */

#define LANES 16

#if KS_X86
typedef struct {
    int group;          /* values per weight group: 32, or 16 for Q6_K */
    int act_group;      /* values per activation scale: 32 (q8_0) or 256 (q8_K) */
    int has_mins;       /* Q4_K: value = scale * q - min, per group of 32 */
} tiled_t;

static const tiled_t TILED[4] = {{32, 32, 0}, {32, 32, 0}, {32, 256, 1}, {16, 256, 0}};

/* Sums of the unsigned bytes of x: (first 16, last 16). */
TARGET_VNNI static inline void sum_halves(__m256i x, int *lo, int *hi) {
    __m256i s = _mm256_sad_epu8(x, _mm256_setzero_si256());
    *lo = (int)(_mm256_extract_epi64(s, 0) + _mm256_extract_epi64(s, 1));
    *hi = (int)(_mm256_extract_epi64(s, 2) + _mm256_extract_epi64(s, 3));
}

/* One weight row as signed bytes vals [K] (Q8_0: the row itself); per group its float scale, Q4_K's
   float min, and 128 times the sum of its values (sums). */
TARGET_VNNI static const int8_t *unpack_row(int fmt, const uint8_t *w, const uint8_t *meta, int K, int8_t *vals,
                                            float *scale, float *mins, int32_t *sums) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    int lo, hi;
    if (fmt == FMT_Q8_0) {
        for (int b = 0; b < K / 32; b++) {
            scale[b] = h2f_at(meta + 2 * b);
            sum_halves(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 32 * b)), _mm256_set1_epi8((char)0x80)), &lo, &hi);
            sums[b] = 128 * (lo + hi - 32 * 128);
        }
        return (const int8_t *)w;
    }
    if (fmt == FMT_Q4_0) {
        for (int b = 0; b < K / 32; b++) {
            const uint8_t *blk = w + 18 * b;
            scale[b] = h2f_at(blk);
            __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + 2));
            __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), low);
            sum_halves(q, &lo, &hi);
            sums[b] = 128 * (lo + hi - 8 * 32);
            _mm256_storeu_si256((__m256i *)(vals + 32 * b), _mm256_sub_epi8(q, _mm256_set1_epi8(8)));
        }
        return vals;
    }
    if (fmt == FMT_Q4_K) {
        for (int b = 0; b < K / 256; b++) {
            const uint8_t *blk = w + 144 * b, *qs = blk + 16;
            float d = h2f_at(blk), dmin = h2f_at(blk + 2);
            int sc[8], m[8];
            q4k_scale_min(blk + 4, sc, m);
            for (int j = 0; j < 8; j++) {
                scale[8 * b + j] = d * (float)sc[j];
                mins[8 * b + j] = dmin * (float)m[j];
            }
            for (int c = 0; c < 4; c++) {
                __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                __m256i ql = _mm256_and_si256(q, low), qh = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
                sum_halves(ql, &lo, &hi);
                sums[8 * b + 2 * c] = 128 * (lo + hi);
                sum_halves(qh, &lo, &hi);
                sums[8 * b + 2 * c + 1] = 128 * (lo + hi);
                _mm256_storeu_si256((__m256i *)(vals + 256 * b + 64 * c), ql);
                _mm256_storeu_si256((__m256i *)(vals + 256 * b + 64 * c + 32), qh);
            }
        }
        return vals;
    }
    const __m256i three = _mm256_set1_epi8(3);
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk = w + 210 * b, *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        float d = h2f_at(blk + 208);
        for (int g = 0; g < 16; g++) scale[16 * b + g] = d * (float)sc[g];
        for (int h = 0; h < 2; h++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
            __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            __m256i lows[4] = {_mm256_and_si256(l0, low), _mm256_and_si256(l1, low),
                               _mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(_mm256_srli_epi16(l1, 4), low)};
            for (int s = 0; s < 4; s++) {
                __m256i q = _mm256_or_si256(lows[s], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * s), three), 4));
                int g = 16 * b + 8 * h + 2 * s;
                sum_halves(q, &lo, &hi);
                sums[g] = 128 * (lo - 32 * 16);
                sums[g + 1] = 128 * (hi - 32 * 16);
                _mm256_storeu_si256((__m256i *)(vals + 256 * b + 128 * h + 32 * s), _mm256_sub_epi8(q, _mm256_set1_epi8(32)));
            }
        }
    }
    return vals;
}

/* Tokens t0..t0+15 of the quantized activations into lanes: bytes [2][K/4][16][4] (the hi level, then the
   lo level; each byte XOR flip: 0x80 makes q + 128 for vpdpbusd's unsigned operand, 0 keeps q signed for
   the AMX tiles; past T left as they were), scales d / 128 [K/act_group][16] (past T 0), and (Q4_K) the
   value sums per 32 of 128 * hi + lo, [K/32][16] float. */
static void act_tiles(const matmul_t *m, int t0, uint8_t *bytes, float *d, float *sums, uint32_t flip) {
    const int K = m->K;
    for (int l = 0; l < LANES; l++) {
        int t = t0 + l;
        act_t a = t < m->T ? token_act(m, t) : (act_t){NULL, NULL, NULL, NULL, NULL, NULL};
        /* a lane past T keeps whatever bytes it held (its results are never read: every lane is its own
           token's) and gets scales of 0; writing all 16 lanes cost a one-token call ~16 us of one thread */
        for (int level = 0; a.qs && level < 2; level++) {
            const int8_t *qs = level ? a.lo : a.qs;
            uint8_t *out = bytes + (size_t)level * K * LANES;
            for (int q = 0; q < K / 4; q++) {
                uint32_t v;
                memcpy(&v, qs + 4 * q, 4);
                v ^= flip;
                memcpy(out + ((size_t)q * LANES + l) * 4, &v, 4);
            }
        }
        for (int b = 0; b < K / m->group; b++) d[b * LANES + l] = a.d ? a.d[b] * LO_SCALE : 0.0f;
        if (m->fmt == FMT_Q4_K)
            for (int j = 0; j < K / 32; j++)
                sums[j * LANES + l] = a.bsums ? (float)(128 * (a.bsums[2 * j] + a.bsums[2 * j + 1]) +
                                                        a.bsums_lo[2 * j] + a.bsums_lo[2 * j + 1]) : 0.0f;
    }
}

#define TILE_ROWS 16
#define PASS_ROWS 8     /* rows whose int32 sums the quad loop keeps in registers at once (2 levels each) */

/* out[r][l] for TILE_ROWS rows and 16 token lanes; group, act_group and has_mins are constants in each
   caller, so the quad loop unrolls.  Within a group the rows go in passes of PASS_ROWS: 8 rows' two levels
   of sums (16 zmm) with the two activation quads and the weight broadcast fit the 32 registers (16 rows'
   did not: the hot loop spilled); the group's activation quads are read again from L1 by the second pass.
   Each row's sums run in the same order either way (the results are the same bits). */
TARGET_VNNI static inline __attribute__((always_inline)) void lanes_kernel(
    const int group, const int act_group, const int has_mins, int K, const int8_t *const *vals,
    const float *const *scale, const float *const *mins, const int32_t *const *sums, const uint8_t *bytes,
    const float *d, const float *asums, float out[TILE_ROWS][LANES]) {
    __m512 total[TILE_ROWS], part[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) total[r] = part[r] = _mm512_setzero_ps();
    const uint8_t *lb = bytes + (size_t)K * LANES;
    for (int g0 = 0; g0 < K; g0 += group) {
        const int gi = g0 / group;
        for (int r0 = 0; r0 < TILE_ROWS; r0 += PASS_ROWS) {
            /* both levels in one pass, each weight broadcast read once for both */
            __m512i acc[PASS_ROWS], acc_lo[PASS_ROWS];
            for (int r = 0; r < PASS_ROWS; r++) acc[r] = acc_lo[r] = _mm512_set1_epi32(-sums[r0 + r][gi]);
            for (int q = g0 / 4; q < (g0 + group) / 4; q++) {
                __m512i a = _mm512_load_si512((const void *)(bytes + (size_t)q * 64));
                __m512i al = _mm512_load_si512((const void *)(lb + (size_t)q * 64));
                for (int r = 0; r < PASS_ROWS; r++) {
                    int32_t wv;
                    memcpy(&wv, vals[r0 + r] + 4 * q, 4);
                    const __m512i wb = _mm512_set1_epi32(wv);
                    acc[r] = _mm512_dpbusd_epi32(acc[r], a, wb);
                    acc_lo[r] = _mm512_dpbusd_epi32(acc_lo[r], al, wb);
                }
            }
            for (int r = 0; r < PASS_ROWS; r++) acc[r] = _mm512_add_epi32(_mm512_slli_epi32(acc[r], 7), acc_lo[r]);
            if (act_group == 32) {
                __m512 ad = _mm512_load_ps(d + (size_t)gi * LANES);
                for (int r = 0; r < PASS_ROWS; r++)
                    total[r0 + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]),
                                                    _mm512_mul_ps(_mm512_set1_ps(scale[r0 + r][gi]), ad), total[r0 + r]);
            } else {
                for (int r = 0; r < PASS_ROWS; r++) {
                    part[r0 + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_set1_ps(scale[r0 + r][gi]),
                                                   part[r0 + r]);
                    if (has_mins)
                        part[r0 + r] = _mm512_fnmadd_ps(_mm512_set1_ps(mins[r0 + r][gi]),
                                                        _mm512_load_ps(asums + (size_t)gi * LANES), part[r0 + r]);
                }
            }
        }
        if (act_group != 32 && (g0 + group) % 256 == 0) {
            __m512 ad = _mm512_load_ps(d + (size_t)(g0 / 256) * LANES);
            for (int r = 0; r < TILE_ROWS; r++) {
                total[r] = _mm512_fmadd_ps(part[r], ad, total[r]);
                part[r] = _mm512_setzero_ps();
            }
        }
    }
    for (int r = 0; r < TILE_ROWS; r++) _mm512_storeu_ps(out[r], total[r]);
}

#define LANES_ARGS int K, const int8_t *const *vals, const float *const *scale, const float *const *mins, \
    const int32_t *const *sums, const uint8_t *bytes, const float *d, const float *asums, float out[TILE_ROWS][LANES]
#define LANES_PASS K, vals, scale, mins, sums, bytes, d, asums, out
TARGET_VNNI static void lanes_g32_a32(LANES_ARGS) { lanes_kernel(32, 32, 0, LANES_PASS); }
TARGET_VNNI static void lanes_g32_a256_mins(LANES_ARGS) { lanes_kernel(32, 256, 1, LANES_PASS); }
TARGET_VNNI static void lanes_g16_a256(LANES_ARGS) { lanes_kernel(16, 256, 0, LANES_PASS); }
typedef void (*lanes_fn)(LANES_ARGS);
static const lanes_fn LANES_KERNELS[4] = {lanes_g32_a32, lanes_g32_a32, lanes_g32_a256_mins, lanes_g16_a256};
#endif

/* ---------------------------------------------------------------- the GEMM driver */

typedef float (*dot_fn)(const uint8_t *w, const uint8_t *meta, const act_t *a, int K);

#if KS_X86
/* [format][ISA up to AVX-512 VNNI]: AVX-VNNI's K-quant dot products are AVX2's (its 256-bit vpdpbusd serves
   their repacked kernels, host_kquants.c, which every matmul of theirs runs) */
static const dot_fn DOTS[4][4] = {
    {dot_q8_0_scalar, dot_q8_0_avx2, dot_q8_0_avxvnni, dot_q8_0_vnni},
    {dot_q4_0_scalar, dot_q4_0_avx2, dot_q4_0_avxvnni, dot_q4_0_vnni},
    {dot_q4_K_scalar, dot_q4_K_avx2, dot_q4_K_avx2, dot_q4_K_vnni},
    {dot_q6_K_scalar, dot_q6_K_avx2, dot_q6_K_avx2, dot_q6_K_vnni},
};
#else
static const dot_fn DOTS[4][4] = {
    {dot_q8_0_scalar, dot_q8_0_scalar, dot_q8_0_scalar, dot_q8_0_scalar},
    {dot_q4_0_scalar, dot_q4_0_scalar, dot_q4_0_scalar, dot_q4_0_scalar},
    {dot_q4_K_scalar, dot_q4_K_scalar, dot_q4_K_scalar, dot_q4_K_scalar},
    {dot_q6_K_scalar, dot_q6_K_scalar, dot_q6_K_scalar, dot_q6_K_scalar},
};
#endif

/* The dot product of a format at an ISA (AMX's is VNNI's, for the formats the tiles do not take). */
static inline dot_fn dot_for(int fmt, int isa) { return DOTS[fmt][isa > ISA_AVX512VNNI ? ISA_AVX512VNNI : isa]; }

static __thread uint8_t *scratch;
static __thread size_t scratch_bytes;

static void *scratch_for(size_t bytes) {
    if (bytes > scratch_bytes) {
        free(scratch);
        scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
        scratch_bytes = scratch ? bytes : 0;
    }
    return scratch;
}

#define ROW_TILE 16

/* From this many tokens the VNNI path runs 16 tokens in lanes (lanes_kernel), per format; fewer: a dot
   product per row and token.  Measured on one core of the 2-core VM (2048x2048, 1 thread, the rows in passes
   of 8): a group of 16 lanes costs 1.12-1.15 ms, the dot products of 5 / 6 tokens 1.01 / 1.19 ms (Q8_0) and
   1.02 / 1.46 ms (Q4_0), so both switch at 6 (Q4_0 switched at 4 before, where lanes cost 1.45x the dots).
   Q4_K and Q6_K under VNNI are repacked (host_kquants.c) and take neither path; their entries serve a
   build that keeps their blocks.  A group of 8 lanes (256-bit) was tried and cost the same as 16: the
   per-row work (unpacking, broadcasts, scales per group) does not shrink with the lanes. */
int ks_lanes_min_tokens[4] = {6, 6, 6, 5};

/* From this many tokens a Q8_0 matmul runs on AMX tiles where the CPU has them (host_amx.c): from one, so
   every step size rounds alike (the lanes kernel's float steps) and a session's numbers do not depend on the
   tokens beside it in a step.  On the 2-core VM (two threads, alternated against VNNI) one token on tiles
   read 1.25x the dot products' rate, 2-5 tokens 1.2-2.0x, 6-16 2.2-2.35x. */
int ks_amx_min_tokens = 1;

/* Whether a matmul of T tokens runs on AMX tiles; whether on the lanes' tiles (the lanes kernel or AMX). */
static inline int amx_tokens(int fmt, int isa, int T) {
    return KS_X86 && isa >= ISA_AMX && fmt == FMT_Q8_0 && T >= ks_amx_min_tokens;
}

/* Whether a matmul's activations carry their levels joined in 16 bits (the AVX2 / AVX-VNNI Q8_0 and Q4_0 dots). */
static inline int joins_levels(int fmt, int isa) {
    return KS_X86 && (fmt == FMT_Q8_0 || fmt == FMT_Q4_0) && (isa == ISA_AVX2 || isa == ISA_AVXVNNI);
}

static inline int lanes_tokens(int fmt, int isa, int T) {
    return KS_X86 && !repacked(fmt) && isa >= ISA_AVX512VNNI && (T >= ks_lanes_min_tokens[fmt] || amx_tokens(fmt, isa, T));
}

#if KS_X86
/* Row r's nb block scales (Q8_0's f16) as floats into scales [nb][16] (the tiles' layout: a block's 16 rows
   side by side); NULL meta: zeros (a row past N). */
TARGET_VNNI static void row_scales(const uint8_t *meta, int nb, float *scales, int r) {
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(16));
    int b = 0;
    for (; b + 16 <= nb; b += 16) {
        const __m512 v = meta ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(meta + 2 * b))) : _mm512_setzero_ps();
        _mm512_i32scatter_ps(scales + 16 * b + r, at, v, 4);
    }
    for (; b < nb; b++) scales[16 * b + r] = meta ? h2f_at(meta + 2 * b) : 0.0f;
}

/* AMX scratch of a thread: a tile's rows copied together (16 x K bytes) and their scales. */
static __thread uint8_t *amx_own;
static __thread size_t amx_own_bytes;

static uint8_t *amx_scratch(int K) {
    const size_t bytes = (size_t)TILE_ROWS * K + (size_t)TILE_ROWS * (K / 32) * 4 + 64;
    if (bytes > amx_own_bytes) {
        free(amx_own);
        amx_own = aligned_alloc(64, (bytes + 63) / 64 * 64);
        amx_own_bytes = amx_own ? bytes : 0;
    }
    return amx_own;
}

/* The R (<= 16) rows of a Q8_0 weight from row w (meta: its scales) at one stride on AMX tiles, for each of
   `count` tokens alone (acts[l] into out[r][l]): the one-token kernel per token over the same rows, their scales
   converted once; next: the 16 rows after these are this thread's next (the last token's call prefetches into
   them).  Fewer than 16 rows are copied into `own` (16 * K bytes) with zeros after them; `scales` holds
   16 * K / 32 floats. */
static void amx_rows_each(const uint8_t *w, ptrdiff_t w_stride, const uint8_t *meta, ptrdiff_t meta_stride, int R, int K,
                          const act_t *acts, int count, int next, uint8_t *own, float *scales,
                          float out[TILE_ROWS][LANES]) {
    const int nb = K / 32;
    for (int r = 0; r < TILE_ROWS; r++) row_scales(r < R ? meta + meta_stride * r : NULL, nb, scales, r);
    if (R < TILE_ROWS) {
        for (int r = 0; r < TILE_ROWS; r++) {
            if (r < R) memcpy(own + (size_t)r * K, w + w_stride * r, (size_t)K);
            else memset(own + (size_t)r * K, 0, (size_t)K);
        }
        w = own, w_stride = K, next = 0;
    }
    amx_use(AMX_Q8_0_ONE);
    for (int l = 0; l < count; l++) {
        float one[TILE_ROWS];
        amx_q8_0_one((const int8_t *)w, w_stride, scales, K, acts[l].qs, acts[l].lo, acts[l].d, next && l == count - 1, one);
        for (int r = 0; r < TILE_ROWS; r++) out[r][l] = one[r];
    }
}
#endif

static void rmsnorm_row(const float *xr, const float *wr, int n, float eps, float *o);

static __thread float *normed;      /* a worker's normed row (the prologue), apart from its scratch */
static __thread int normed_n;

static void matmul_quantize(void *ctx, int index, int count) {
    matmul_t *m = ctx;
    if (m->norm && normed_n < m->K) {
        free(normed);
        normed = aligned_alloc(64, ((size_t)m->K * 4 + 63) / 64 * 64);
        normed_n = normed ? m->K : 0;
        if (!normed) {
            atomic_store(&m->failed, 1);
            return;
        }
    }
    for (int t = index; t < m->T; t += count) {
        act_t a = token_act(m, t);
        const float *x = m->x + m->x_stride * t;
        if (m->norm) {          /* the same numbers as ks_rmsnorm, then quantized */
            rmsnorm_row(x, m->norm, m->K, m->eps, normed);
            x = normed;
        }
        quantize_act_isa(m->isa, x, m->K, m->group, a.qs, a.lo, a.d, a.bsums, a.bsums_lo);
        if (a.joined) join_levels(&a, m->K);
        if (repacked(m->fmt)) kq_token(m->fmt, a.qs, a.lo, a.d, a.bsums, a.bsums_lo, t, &m->kq_acts);
    }
}

/* Repacked Q4_K / Q6_K: row groups handed out kq_grab at a time, each for every token (host_kquants.c). */
static void matmul_kq(void *ctx, int index, int count) {
    (void)index, (void)count;
    matmul_t *m = ctx;
    const int groups = (m->N + KQ_ROWS - 1) / KQ_ROWS;
    for (int first; (first = atomic_fetch_add_explicit(&m->next, m->kq_grab, memory_order_relaxed)) < groups;)
        kq_rows(m->fmt, m->isa, m->w, m->w_stride, m->K, m->N, first, first + m->kq_grab < groups ? first + m->kq_grab : groups,
                &m->kq_acts, m->out, m->out_stride);
}

#define TILES_PER_GRAB 4        /* row tiles a thread takes at a time: 64 rows (at most, dot products) */

/* Grabs a thread takes of a projection's rows, about (dot products and repacked groups): the last grab of
   the slowest thread is the op's tail; a grab is one atomic add.  On the H200's host (16 threads, 1.7B
   Q8_0 and Q4_K_M, cpu and layers=14 decode, A/B in one process) 8 a thread measured 0.96-1.03x of 4, and a
   software prefetch of the row 1 or 2 ahead 0.97-1.04x: noise both ways, so 4 and the hardware's prefetchers. */
int ks_grabs_per_thread = 4;

static void matmul_dots(void *ctx, int index, int count) {
    (void)index, (void)count;
    matmul_t *m = ctx;
    const dot_fn dot = dot_for(m->fmt, m->isa);
    for (int first; (first = atomic_fetch_add_explicit(&m->next, m->dot_grab, memory_order_relaxed)) < m->row_tiles;) {
        int r0 = first * ROW_TILE, r1 = (first + m->dot_grab) * ROW_TILE < m->N ? (first + m->dot_grab) * ROW_TILE : m->N;
        for (int t = 0; t < m->T; t++) {
            act_t a = token_act(m, t);
            float *o = m->out + m->out_stride * t;
            for (int j = r0; j < r1; j++) {
                const ptrdiff_t r = logical_row(m, j);
                o[r] = dot(row_w(m, r), row_meta(m, r), &a, m->K);
            }
        }
    }
}

#if KS_X86
static void matmul_tiles(void *ctx, int index, int count) {
    matmul_t *m = ctx;
    const size_t scales = (size_t)m->K * LANES * 2, sums = scales + (size_t)(m->K / m->group) * LANES * 4;
    for (int tg = index; tg < m->token_groups; tg += count) {
        uint8_t *tile = m->tiles + m->tile_bytes * (size_t)tg;
        act_tiles(m, tg * LANES, tile, (float *)(tile + scales), (float *)(tile + sums), m->amx ? 0u : 0x80808080u);
    }
}

static void matmul_lanes(void *ctx, int index, int count) {
    (void)index, (void)count;
    matmul_t *m = ctx;
    const int K = m->K, N = m->N;
    const size_t ng = (size_t)(K / TILED[m->fmt].group), row_bytes = K + ng * 12;
    const size_t scales = (size_t)K * LANES * 2, sums = scales + (size_t)(K / m->group) * LANES * 4;
    /* this thread's TILE_ROWS unpacked rows (values, scales, mins, sums) */
    uint8_t *own = aligned_alloc(64, (TILE_ROWS * row_bytes + 63) / 64 * 64);
    if (!own) {
        atomic_store(&m->failed, 1);
        return;
    }
    for (int first; (first = atomic_fetch_add_explicit(&m->next, TILES_PER_GRAB, memory_order_relaxed)) < m->row_tiles;) {
        int r_end = (first + TILES_PER_GRAB) * ROW_TILE < N ? (first + TILES_PER_GRAB) * ROW_TILE : N;
        for (int r0 = first * ROW_TILE; r0 < r_end; r0 += TILE_ROWS) {
            int R = r_end - r0 < TILE_ROWS ? r_end - r0 : TILE_ROWS;
            const int8_t *vals[TILE_ROWS];
            const float *scale[TILE_ROWS], *mins[TILE_ROWS];
            const int32_t *sum[TILE_ROWS];
            for (int r = 0; r < TILE_ROWS; r++) {
                if (r >= R) {       /* past N: row r0 again, its results dropped */
                    vals[r] = vals[0], scale[r] = scale[0], mins[r] = mins[0], sum[r] = sum[0];
                    continue;
                }
                uint8_t *mine = own + (size_t)r * row_bytes;
                float *sc = (float *)(mine + K), *mn = sc + ng;
                int32_t *sm = (int32_t *)(mn + ng);
                const ptrdiff_t row = logical_row(m, r0 + r);
                vals[r] = unpack_row(m->fmt, row_w(m, row), row_meta(m, row), K, (int8_t *)mine, sc, mn, sm);
                scale[r] = sc, mins[r] = mn, sum[r] = sm;
            }
            for (int tg = 0; tg < m->token_groups; tg++) {
                const uint8_t *tile = m->tiles + m->tile_bytes * (size_t)tg;
                float res[TILE_ROWS][LANES];
                LANES_KERNELS[m->fmt](K, vals, scale, mins, sum, tile, (const float *)(tile + scales),
                                      (const float *)(tile + sums), res);
                for (int l = 0; l < LANES && tg * LANES + l < m->T; l++)
                    for (int r = 0; r < R; r++) m->out[m->out_stride * (tg * LANES + l) + logical_row(m, r0 + r)] = res[r][l];
            }
        }
    }
    free(own);
}

/* Q8_0 on AMX tiles: each thread's row tiles of 16 (TILES_PER_GRAB a grab) against every token group,
   host_amx.c's amx_q8_0_rows (one token: amx_q8_0_one, on the quantized row itself).  A tile's rows are
   read where they lie when they are 16 at one stride; otherwise (the last rows, glu halves apart) they are
   copied together first. */
static void matmul_amx(void *ctx, int index, int count) {
    (void)index, (void)count;
    matmul_t *m = ctx;
    const int K = m->K, N = m->N, nb = K / 32;
    const size_t scales_at = (size_t)K * LANES * 2;
    uint8_t *own = amx_scratch(K);
    if (!own) {
        atomic_store(&m->failed, 1);
        return;
    }
    float *scales = (float *)(own + (size_t)TILE_ROWS * K);
    const act_t first = token_act(m, 0);
    amx_use(m->T == 1 ? AMX_Q8_0_ONE : AMX_Q8_0);
    for (int grab; (grab = atomic_fetch_add_explicit(&m->next, TILES_PER_GRAB, memory_order_relaxed)) < m->row_tiles;) {
        int r_end = (grab + TILES_PER_GRAB) * ROW_TILE < N ? (grab + TILES_PER_GRAB) * ROW_TILE : N;
        for (int r0 = grab * ROW_TILE; r0 < r_end; r0 += TILE_ROWS) {
            const int R = r_end - r0 < TILE_ROWS ? r_end - r0 : TILE_ROWS;
            const uint8_t *w0 = row_w(m, logical_row(m, r0));
            const ptrdiff_t stride = R > 1 ? row_w(m, logical_row(m, r0 + 1)) - w0 : m->w_stride;
            int direct = R == TILE_ROWS;
            for (int r = 0; r < TILE_ROWS; r++) {
                const ptrdiff_t row = r < R ? logical_row(m, r0 + r) : 0;
                row_scales(r < R ? row_meta(m, row) : NULL, nb, scales, r);
                if (r < R && row_w(m, row) != w0 + stride * r) direct = 0;
            }
            if (!direct)
                for (int r = 0; r < TILE_ROWS; r++) {       /* past N: zeros, their results dropped */
                    if (r < R) memcpy(own + (size_t)r * K, row_w(m, logical_row(m, r0 + r)), (size_t)K);
                    else memset(own + (size_t)r * K, 0, (size_t)K);
                }
            const int8_t *w = direct ? (const int8_t *)w0 : (const int8_t *)own;
            const ptrdiff_t w_stride = direct ? stride : K;
            /* this thread's next 16 rows follow at the same stride: the kernels prefetch into them */
            const int next = direct && r0 + 2 * TILE_ROWS <= r_end && row_w(m, logical_row(m, r0 + TILE_ROWS)) == w0 + stride * TILE_ROWS;
            if (m->T == 1) {
                float res[TILE_ROWS];
                amx_q8_0_one(w, w_stride, scales, K, first.qs, first.lo, first.d, next, res);
                for (int r = 0; r < R; r++) m->out[logical_row(m, r0 + r)] = res[r];
                continue;
            }
            for (int tg = 0; tg < m->token_groups; tg++) {
                const uint8_t *tile = m->tiles + m->tile_bytes * (size_t)tg;
                float res[TILE_ROWS][LANES];
                amx_q8_0_rows(w, w_stride, scales, K, tile, (const float *)(tile + scales_at), next, res);
                for (int l = 0; l < LANES && tg * LANES + l < m->T; l++)
                    for (int r = 0; r < R; r++) m->out[m->out_stride * (tg * LANES + l) + logical_row(m, r0 + r)] = res[r][l];
            }
        }
    }
    amx_done();
}
#endif

/* A projection bound once (ks_linear_t, host_kernels.h): prologue norm, matmul, SiLU·mul epilogue. */
static void silu_mul_rows(const float *gate, ptrdiff_t g_stride, const float *up, ptrdiff_t u_stride, int rows, int n,
                          float *out, ptrdiff_t out_stride, int threads);

/* A call's state for spec over x [T, K] -> out (its buffers placed later, matmul_place); returns the scratch
   bytes it needs (a multiple of 64). */
static size_t matmul_init(matmul_t *m, const ks_linear_t *spec, const float *x, ptrdiff_t x_stride, int T, float *out,
                          ptrdiff_t out_stride) {
    const int fmt = spec->fmt, isa = spec->isa, N = spec->N, K = spec->K;
    *m = (matmul_t){.fmt = fmt, .isa = isa, .N = N, .K = K, .T = T, .w = spec->w, .meta = spec->meta,
                    .w_stride = spec->w_stride, .meta_stride = spec->meta_stride, .x_stride = x_stride,
                    .out_stride = out_stride, .x = x, .out = out, .norm = spec->norm, .eps = spec->eps,
                    .half = spec->glu ? N / 2 : N, .up_w = up_w_of(spec), .up_meta = up_meta_of(spec),
                    .pairs = spec->glu && spec->up_w > 0 && spec->up_w < spec->w_stride};
    const int kq = repacked(fmt), threads = spec->threads < 1 ? 1 : spec->threads;
    m->group = fmt == FMT_Q8_0 || fmt == FMT_Q4_0 ? 32 : 256;
    m->qs_bytes = (size_t)K, m->d_bytes = (size_t)(K / m->group) * 4, m->bs_bytes = m->group == 256 ? (size_t)(K / 16) * 2 : 0;
    m->per_token = (2 * (m->qs_bytes + m->bs_bytes) + m->d_bytes + 63) / 64 * 64;     /* both levels */
    if (joins_levels(fmt, isa)) {        /* and both as one, 16 bits a value */
        m->joined_at = m->per_token;
        m->per_token += ((size_t)K * 2 + 63) / 64 * 64;
    }
    m->row_tiles = kq ? (N + KQ_ROWS - 1) / KQ_ROWS : (N + ROW_TILE - 1) / ROW_TILE;
    m->amx = amx_tokens(fmt, isa, T);
    m->lanes = lanes_tokens(fmt, isa, T);
    m->token_groups = (T + LANES - 1) / LANES;
    /* per token group: bytes [2][K/4][16][4], scales [K/group][16], Q4_K's sums [K/32][16] */
    m->tile_bytes = (size_t)K * LANES * 2 + (size_t)(K / m->group) * LANES * 4 + (fmt == FMT_Q4_K ? (size_t)(K / 32) * LANES * 4 : 0);
    m->tiles_bytes = ((m->lanes ? m->tile_bytes * (size_t)m->token_groups : kq ? kq_acts_bytes(K, T, kq_stacks(fmt, isa, T)) : 0) + 63) / 64 * 64;
    m->glu = spec->glu;
    /* row groups (tiles) a grab: about ks_grabs_per_thread grabs a thread (dot products: at most TILES_PER_GRAB
       tiles; the lanes kernels TILES_PER_GRAB) */
    const int per_grab = m->row_tiles / (ks_grabs_per_thread * threads) > 1 ? m->row_tiles / (ks_grabs_per_thread * threads) : 1;
    m->kq_grab = per_grab;
    m->dot_grab = m->lanes ? TILES_PER_GRAB : per_grab < TILES_PER_GRAB ? per_grab : TILES_PER_GRAB;
    m->grabs = (m->row_tiles + (kq ? m->kq_grab : m->dot_grab) - 1) / (kq ? m->kq_grab : m->dot_grab);
    return m->per_token * (size_t)T + m->tiles_bytes + (spec->glu ? (size_t)T * N * 4 + 64 : 0);
}

/* m's activations, tiles and (glu) gate | up rows in buf (64-aligned, matmul_init's bytes). */
static void matmul_place(matmul_t *m, uint8_t *buf) {
    m->buf = buf;
    m->tiles = m->buf + m->per_token * (size_t)m->T;
    if (repacked(m->fmt)) {
        m->kq_acts = kq_acts_at(m->tiles, m->K, m->T, kq_stacks(m->fmt, m->isa, m->T));
        m->kq_acts.rows = (const int8_t *)m->buf;       /* token_act's levels */
        m->kq_acts.row_stride = (ptrdiff_t)m->per_token, m->kq_acts.lo_offset = (ptrdiff_t)m->qs_bytes;
    }
    if (m->glu) {               /* the gate | up rows land in scratch, the epilogue writes out */
        m->glu_out = m->out, m->glu_stride = m->out_stride;
        m->out = (float *)(m->tiles + m->tiles_bytes);
        m->out_stride = m->N;
    }
}

/* The SiLU·mul epilogue of a glu projection, from its gate | up rows. */
static void matmul_epilogue(const matmul_t *m, int threads) {
    if (m->glu)
        silu_mul_rows(m->out, m->N, m->out + m->N / 2, m->N, m->T, m->N / 2, m->glu_out, m->glu_stride, threads);
}

int ks_linear(const ks_linear_t *spec, const float *x, ptrdiff_t x_stride, int T, float *out, ptrdiff_t out_stride) {
    matmul_t m;
    const int threads = spec->threads < 1 ? 1 : spec->threads;
    uint8_t *buf = scratch_for(matmul_init(&m, spec, x, x_stride, T, out, out_stride));
    if (!buf) return -1;
    matmul_place(&m, buf);
    const int workers = threads < m.grabs ? threads : m.grabs;
    /* a few tokens are quantized on the calling thread: no job of their own */
    pool_run(matmul_quantize, &m, T > 4 ? (threads < T ? threads : T) : 1);
    if (atomic_load(&m.failed)) return -1;
    if (repacked(m.fmt))
        pool_run(matmul_kq, &m, workers);
#if KS_X86
    else if (m.lanes) {
        if (!(m.amx && T == 1))         /* one token on tiles reads its quantized row as it is */
            pool_run(matmul_tiles, &m, threads < m.token_groups ? threads : m.token_groups);
        pool_run(m.amx ? matmul_amx : matmul_lanes, &m, workers);
        if (atomic_load(&m.failed)) return -1;
    }
#endif
    else
        pool_run(matmul_dots, &m, workers);
    matmul_epilogue(&m, threads);
    return 0;
}

/* ---------------------------------------------------------------- several projections as one job */
/* A routed layer's experts at a step's few tokens: each expert's projection over the rows of its tokens,
   every projection's row tiles handed out from one counter, so the pool's threads share all of them in one
   job (not a job per expert, each too small to spread well).  The numbers of ks_linear on each: the same
   activations, the same dot product per row and token.  Projections with tokens enough for the lanes
   kernel run as ks_linear, one after the other. */

typedef struct {
    matmul_t *m;
    const int *first;               /* [n + 1]: each projection's first grab in the job's numbering */
    int n;
    _Atomic int next;
} group_t;

static void group_grabs(void *ctx, int index, int count) {
    (void)index, (void)count;
    group_t *g = ctx;
    int i = 0;
    for (int grab; (grab = atomic_fetch_add_explicit(&g->next, 1, memory_order_relaxed)) < g->first[g->n];) {
        while (grab >= g->first[i + 1]) i++;            /* grabs are taken in ascending order */
        matmul_t *m = g->m + i;
        const int at = grab - g->first[i];
        if (repacked(m->fmt)) {
            const int groups = m->row_tiles, lo = at * m->kq_grab, hi = lo + m->kq_grab < groups ? lo + m->kq_grab : groups;
            kq_rows(m->fmt, m->isa, m->w, m->w_stride, m->K, m->N, lo, hi, &m->kq_acts, m->out, m->out_stride);
            continue;
        }
        const dot_fn dot = dot_for(m->fmt, m->isa);
        const int r0 = at * m->dot_grab * ROW_TILE, r1 = r0 + m->dot_grab * ROW_TILE < m->N ? r0 + m->dot_grab * ROW_TILE : m->N;
        for (int t = 0; t < m->T; t++) {
            act_t a = token_act(m, t);
            float *o = m->out + m->out_stride * t;
            for (int j = r0; j < r1; j++) {
                const ptrdiff_t r = logical_row(m, j);
                o[r] = dot(row_w(m, r), row_meta(m, r), &a, m->K);
            }
        }
    }
}

#define GROUP_MAX 256

int ks_linear_group(const ks_linear_t *const *specs, int n, const float *const *x, ptrdiff_t x_stride, const int *T,
                    float *const *out, ptrdiff_t out_stride) {
    if (n > GROUP_MAX) {
        for (int done = 0; done < n; done += GROUP_MAX)
            if (ks_linear_group(specs + done, n - done < GROUP_MAX ? n - done : GROUP_MAX, x + done, x_stride, T + done,
                                out + done, out_stride) != 0)
                return -1;
        return 0;
    }
    matmul_t m[GROUP_MAX];
    int first[GROUP_MAX + 1], lanes[GROUP_MAX], grouped = 0, threads = 1;
    size_t bytes = 0;
    first[0] = 0;
    for (int i = 0; i < n; i++) {
        const size_t need = matmul_init(&m[grouped], specs[i], x[i], x_stride, T[i], out[i], out_stride);
        lanes[i] = m[grouped].lanes || T[i] > 4;
        if (lanes[i] || T[i] <= 0) continue;
        bytes += need;
        threads = specs[i]->threads > threads ? specs[i]->threads : threads;
        first[grouped + 1] = first[grouped] + m[grouped].grabs;
        grouped++;
    }
    if (grouped) {
        uint8_t *buf = scratch_for(bytes);
        if (!buf) return -1;
        for (int i = 0; i < grouped; i++) {
            matmul_place(&m[i], buf);
            buf += m[i].per_token * (size_t)m[i].T + m[i].tiles_bytes + (m[i].glu ? (size_t)m[i].T * m[i].N * 4 + 64 : 0);
            matmul_quantize(&m[i], 0, 1);       /* a few tokens: on the calling thread, as ks_linear does */
            if (atomic_load(&m[i].failed)) return -1;
        }
        group_t g = {m, first, grouped, 0};
        pool_run(group_grabs, &g, threads < first[grouped] ? threads : first[grouped]);
        for (int i = 0; i < grouped; i++) matmul_epilogue(&m[i], threads);
    }
    for (int i = 0; i < n; i++)
        if (lanes[i] && T[i] > 0 && ks_linear(specs[i], x[i], x_stride, T[i], out[i], out_stride) != 0) return -1;
    return 0;
}

/* ---------------------------------------------------------------- a routed layer's experts at few tokens */
/* Each token's normed row quantized once for every expert that token chose (not once per expert); an
   expert's gate and up rows (its glu weight's halves) read in one pass, SiLU·mul applied per row block.
   One job of the pool hands out every chosen expert's gate|up row blocks, then every one's down row
   blocks: the thread that finishes an expert's last gate|up block quantizes that expert's SiLU·mul rows,
   and a down block waits (spinning) until its expert's are ready, so the threads run from gate|up into
   down with no barrier between (a down block is handed out only after every gate|up block was, so at most
   the last few experts' are still running).  The numbers of ks_linear_group on the same experts: the same
   quantized activations (quantization is per token and deterministic), the same dot per row and token,
   silu_mul_run per value.  On AMX tiles (Q8_0) each choice runs the one-token kernel over the expert's 16-row
   tiles (their scales converted once for all its choices): ks_linear's numbers on tiles (the lanes kernel
   gives each token the one-token kernel's bits), at a token's cost each where the lanes kernel costs 16
   lanes whatever the count (2-core VM, Qwen3-30B-A3B's layer at 16 tokens: 37.6 against 56.2 ms). */

static void silu_mul_run(const float *restrict g, const float *restrict u, float *restrict o, int n);

#define ROUTED_GATE_ROWS 64         /* gate rows of a block, with as many up rows: 128 weight rows */
#define ROUTED_DOWN_ROWS 64

typedef struct {
    const ks_linear_t *const *gate_up, *const *down;
    const int *first, *count, *token;   /* expert i's choices [first[i], first[i] + count[i]), each one's token */
    int n, I, H, gate_grabs, down_grabs;
    const matmul_t *in, *mid;       /* the tokens' quantized rows; the choices' SiLU·mul rows quantized */
    float *act, *out;               /* act [choices, I], out [choices, H] */
    _Atomic int *gate_done;         /* [n]: each expert's gate|up blocks finished */
    _Atomic int *ready;             /* [n]: each expert's SiLU·mul rows quantized */
    _Atomic int next;
    int amx;                        /* Q8_0 on AMX tiles: the one-token kernel per choice */
} routed_t;

static void routed_gate_block(const routed_t *c, int e, int r0) {
    const ks_linear_t *s = c->gate_up[e];
    const dot_fn dot = dot_for(s->fmt, s->isa);
    const int rows = c->I - r0 < ROUTED_GATE_ROWS ? c->I - r0 : ROUTED_GATE_ROWS;
    const ptrdiff_t up_w = up_w_of(s), up_meta = up_meta_of(s);
    float gate[ROUTED_GATE_ROWS], up[ROUTED_GATE_ROWS];
#if KS_X86
    uint8_t *own;
    if (c->amx && (own = amx_scratch(s->K))) {      /* each choice on the one-token kernel: gate, then up rows */
        float *scales = (float *)(own + (size_t)TILE_ROWS * s->K);
        act_t acts[4];              /* count <= 4 (ks_routed_few): each choice's quantized row as it is */
        for (int l = 0; l < c->count[e]; l++) acts[l] = token_act(c->in, c->token[c->first[e] + l]);
        for (int t0 = r0; t0 < r0 + rows; t0 += TILE_ROWS) {     /* 16 gate rows, then their up rows */
            const int n = r0 + rows - t0 < TILE_ROWS ? r0 + rows - t0 : TILE_ROWS;
            const int next = t0 + 2 * TILE_ROWS <= r0 + rows;         /* each half's next 16 rows are this block's */
            float g[TILE_ROWS][LANES], u[TILE_ROWS][LANES];
            amx_rows_each(s->w + s->w_stride * t0, s->w_stride, s->meta + s->meta_stride * t0, s->meta_stride, n, s->K,
                          acts, c->count[e], next, own, scales, g);
            amx_rows_each(s->w + up_w + s->w_stride * t0, s->w_stride, s->meta + up_meta + s->meta_stride * t0,
                          s->meta_stride, n, s->K, acts, c->count[e], next, own, scales, u);
            for (int l = 0; l < c->count[e]; l++) {
                for (int r = 0; r < n; r++) gate[r] = g[r][l], up[r] = u[r][l];
                silu_mul_run(gate, up, c->act + (ptrdiff_t)c->I * (c->first[e] + l) + t0, n);
            }
        }
        return;
    }
#endif
    for (int ch = c->first[e]; ch < c->first[e] + c->count[e]; ch++) {
        const act_t a = token_act(c->in, c->token[ch]);
        for (int r = 0; r < rows; r++) {
            const ptrdiff_t g = r0 + r;
            gate[r] = dot(s->w + s->w_stride * g, s->meta ? s->meta + s->meta_stride * g : NULL, &a, s->K);
            up[r] = dot(s->w + up_w + s->w_stride * g, s->meta ? s->meta + up_meta + s->meta_stride * g : NULL, &a, s->K);
        }
        silu_mul_run(gate, up, c->act + (ptrdiff_t)c->I * ch + r0, rows);
    }
}

static void routed_down_block(const routed_t *c, int e, int r0) {
    const ks_linear_t *s = c->down[e];
    const dot_fn dot = dot_for(s->fmt, s->isa);
    const int r1 = r0 + ROUTED_DOWN_ROWS < c->H ? r0 + ROUTED_DOWN_ROWS : c->H;
#if KS_X86
    uint8_t *own;
    if (c->amx && (own = amx_scratch(s->K))) {     /* (no memory for its scratch: the dot products) */
        float *scales = (float *)(own + (size_t)TILE_ROWS * s->K);
        act_t acts[4];
        for (int l = 0; l < c->count[e]; l++) acts[l] = token_act(c->mid, c->first[e] + l);
        for (int t0 = r0; t0 < r1; t0 += TILE_ROWS) {
            const int rows = r1 - t0 < TILE_ROWS ? r1 - t0 : TILE_ROWS;
            float res[TILE_ROWS][LANES];
            amx_rows_each(s->w + s->w_stride * t0, s->w_stride, s->meta + s->meta_stride * t0, s->meta_stride, rows, s->K,
                          acts, c->count[e], t0 + 2 * TILE_ROWS <= r1, own, scales, res);
            for (int l = 0; l < c->count[e]; l++)
                for (int r = 0; r < rows; r++) c->out[(ptrdiff_t)c->H * (c->first[e] + l) + t0 + r] = res[r][l];
        }
        return;
    }
#endif
    for (int ch = c->first[e]; ch < c->first[e] + c->count[e]; ch++) {
        const act_t a = token_act(c->mid, ch);
        float *o = c->out + (ptrdiff_t)c->H * ch;
        for (int r = r0; r < r1; r++) o[r] = dot(s->w + s->w_stride * r, s->meta ? s->meta + s->meta_stride * r : NULL, &a, s->K);
    }
}

/* Until flag is raised (another thread's work). */
static void wait_flag(_Atomic int *flag) {
    for (int spins = 1; !atomic_load_explicit(flag, memory_order_acquire); spins++) {
        cpu_relax();
        if ((spins & 1023) == 0) sched_yield();      /* the thread raising it may be off the CPU */
    }
}

static void routed_rows(void *ctx, int index, int count) {
    (void)index, (void)count;
    routed_t *c = ctx;
    /* grabs: every gate|up block, then every down block */
    const int gate_total = c->n * c->gate_grabs, total = gate_total + c->n * c->down_grabs;
    const matmul_t *mid = c->mid;
    for (int grab; (grab = atomic_fetch_add_explicit(&c->next, 1, memory_order_relaxed)) < total;) {
        if (grab < gate_total) {
            const int e = grab / c->gate_grabs;
            routed_gate_block(c, e, grab % c->gate_grabs * ROUTED_GATE_ROWS);
            if (atomic_fetch_add_explicit(&c->gate_done[e], 1, memory_order_acq_rel) + 1 < c->gate_grabs) continue;
            for (int ch = c->first[e]; ch < c->first[e] + c->count[e]; ch++) {    /* the expert's last block: its rows */
                act_t a = token_act(mid, ch);
                quantize_act_isa(mid->isa, c->act + (ptrdiff_t)c->I * ch, c->I, mid->group, a.qs, a.lo, a.d, a.bsums, a.bsums_lo);
                if (a.joined) join_levels(&a, c->I);
            }
            atomic_store_explicit(&c->ready[e], 1, memory_order_release);
            continue;
        }
        const int e = (grab - gate_total) / c->down_grabs;
        wait_flag(&c->ready[e]);
        routed_down_block(c, e, (grab - gate_total) % c->down_grabs * ROUTED_DOWN_ROWS);
    }
#if KS_X86
    amx_done();
#endif
}

/* Whether an expert's Linear chosen by `tokens` tokens runs in ks_routed_few: a plain (not repacked)
   format, no prologue, and fewer tokens than its format's lanes kernel or AMX tiles take (ks_linear_group's
   test: an expert's tokens get the numbers of its Linear run alone). */
int ks_routed_fits(const ks_linear_t *s, int tokens) {
    if (s->norm || repacked(s->fmt) || tokens > 4) return 0;
    return amx_tokens(s->fmt, s->isa, tokens) || !lanes_tokens(s->fmt, s->isa, tokens);
}

/* Whether n Linears share one format and shape. */
static int routed_alike(const ks_linear_t *const *specs, int n) {
    for (int i = 1; i < n; i++)
        if (specs[i]->fmt != specs[0]->fmt || specs[i]->isa != specs[0]->isa || specs[i]->N != specs[0]->N ||
            specs[i]->K != specs[0]->K)
            return 0;
    return 1;
}

int ks_routed_few(const ks_linear_t *const *gate_up, const ks_linear_t *const *down, int n, const int *first,
                  const int *count, const int *token, const float *xn, int T, float *act, float *out) {
    if (n <= 0) return 0;
    if (!routed_alike(gate_up, n) || !routed_alike(down, n)) return 1;
    const int H = gate_up[0]->K, I = gate_up[0]->N / 2;
    if (!gate_up[0]->glu || down[0]->K != I || down[0]->N != H) return 1;
    for (int i = 0; i < n; i++)
        if (count[i] > 4) return 1;             /* not what ks_routed_fits passes: each runs as its Linears */
    int choices = 0;                /* the act rows up to the last expert's: mid's tokens */
    for (int i = 0; i < n; i++) choices = first[i] + count[i] > choices ? first[i] + count[i] : choices;
    ks_linear_t in_spec = *gate_up[0], mid_spec = *down[0];
    in_spec.glu = 0;
    matmul_t in, mid;
    const size_t in_bytes = matmul_init(&in, &in_spec, xn, H, T, NULL, 0);
    const size_t mid_bytes = matmul_init(&mid, &mid_spec, act, I, choices, NULL, 0);
    const size_t flag_bytes = (2 * (size_t)n * sizeof(_Atomic int) + 63) / 64 * 64;
    const int amx = amx_tokens(gate_up[0]->fmt, gate_up[0]->isa, 1) && amx_tokens(down[0]->fmt, down[0]->isa, 1);
    uint8_t *buf = scratch_for(in_bytes + mid_bytes + flag_bytes);
    if (!buf) return -1;
    matmul_place(&in, buf);
    matmul_place(&mid, buf + in_bytes);
    _Atomic int *flags = (_Atomic int *)(buf + in_bytes + mid_bytes);
    for (int i = 0; i < 2 * n; i++) atomic_init(&flags[i], 0);
    int threads = 1;
    for (int i = 0; i < n; i++) threads = gate_up[i]->threads > threads ? gate_up[i]->threads : threads;
    pool_run(matmul_quantize, &in, T > 4 ? (threads < T ? threads : T) : 1);
    routed_t c = {gate_up, down, first, count, token, n, I, H, (I + ROUTED_GATE_ROWS - 1) / ROUTED_GATE_ROWS,
                  (H + ROUTED_DOWN_ROWS - 1) / ROUTED_DOWN_ROWS, &in, &mid, act, out, flags, flags + n, 0, amx};
    const int grabs = n * (c.gate_grabs + c.down_grabs);
    pool_run(routed_rows, &c, threads < grabs ? threads : grabs);
    return atomic_load(&in.failed) ? -1 : 0;
}

/* out[t, r] = dot(weight row r, x[t]) for r < N, t < T.  w: row r at w + r * w_stride; meta (Q8_0's
   scales, f16) at meta + r * meta_stride.  Returns 0, or -1 when memory for the activations ran out. */
int ks_matmul(int fmt, int isa, const uint8_t *w, ptrdiff_t w_stride, const uint8_t *meta, ptrdiff_t meta_stride,
              int N, int K, const float *x, ptrdiff_t x_stride, int T, float *out, ptrdiff_t out_stride, int threads) {
    ks_linear_t spec = {fmt, isa, N, K, 0, threads, w, meta, w_stride, meta_stride, NULL, 0.0f, 0, 0};
    return ks_linear(&spec, x, x_stride, T, out, out_stride);
}

/* ---------------------------------------------------------------- float ops (run/host.py's conventions) */

typedef struct {
    const float *x, *w;
    float *out;
    ptrdiff_t x_stride, out_stride;
    int rows, n, w_rows;
    float eps;
} rmsnorm_t;

/* o = (x / sqrt(sum(x^2) / n + eps)) * w for one row (o may be x) */
static void rmsnorm_row(const float *xr, const float *wr, int n, float eps, float *o) {
    float part[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) part[j] += xr[i + j] * xr[i + j];
    float ss = 0.0f;
    for (int j = 0; j < 16; j++) ss += part[j];
    for (; i < n; i++) ss += xr[i] * xr[i];
    float root = sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++) o[i] = (xr[i] / root) * wr[i];
}

static void rmsnorm_rows(void *ctx, int index, int count) {
    const rmsnorm_t *c = ctx;
    for (int r = index; r < c->rows; r += count)
        rmsnorm_row(c->x + c->x_stride * r, c->w + (ptrdiff_t)(r % c->w_rows) * c->n, c->n, c->eps,
                    c->out + c->out_stride * r);
}

/* The threads for `work` values of an elementwise op: one below 16K values (a job costs more). */
static inline int op_threads(int threads, size_t work, int items) {
    int t = work < 16384 ? 1 : threads;
    return t < items ? t : items;
}

/* out[r] = (x[r] / sqrt(sum(x[r]^2) / n + eps)) * w[r % w_rows] */
void ks_rmsnorm(const float *x, ptrdiff_t x_stride, int rows, int n, const float *w, int w_rows, float eps,
                float *out, ptrdiff_t out_stride, int threads) {
    rmsnorm_t c = {x, w, out, x_stride, out_stride, rows, n, w_rows, eps};
    pool_run(rmsnorm_rows, &c, op_threads(threads, (size_t)rows * n, rows));
}

/* exp(x) for float32, within 2 ulp of expf on [-87.3, 88.7] (0 below, inf above): x = n ln2 + r,
   |r| <= ln2/2, e^r by a degree-6 polynomial (Cephes' expf coefficients), times 2^n through the exponent
   bits.  Plain arithmetic, so a loop over it vectorizes (libm's expf does not without -ffast-math). */
static inline float exp_poly(float x) {
    float xc = x < -87.33654f ? -87.33654f : x;
    xc = xc > 88.72283f ? 88.72283f : xc;
    float n = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } two_n = {((int32_t)n + 127) << 23};
    y = y * two_n.f;
    y = x < -87.33654f ? 0.0f : y;
    return x > 88.72283f ? INFINITY : y;
}

static void silu_mul_run(const float *restrict g, const float *restrict u, float *restrict o, int n) {
    for (int i = 0; i < n; i++) o[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
}

typedef struct {
    const float *gate, *up;
    float *out;
    ptrdiff_t g_stride, u_stride, out_stride;
    int rows, n, chunks;
} silu_t;

static void silu_mul_parts(void *ctx, int index, int count) {
    const silu_t *c = ctx;
    for (int job = index; job < c->rows * c->chunks; job += count) {
        int r = job / c->chunks, part = job % c->chunks;
        int i0 = (int)((long)c->n * part / c->chunks), i1 = (int)((long)c->n * (part + 1) / c->chunks);
        silu_mul_run(c->gate + c->g_stride * r + i0, c->up + c->u_stride * r + i0, c->out + c->out_stride * r + i0, i1 - i0);
    }
}

static void silu_mul_rows(const float *gate, ptrdiff_t g_stride, const float *up, ptrdiff_t u_stride, int rows, int n,
                          float *out, ptrdiff_t out_stride, int threads) {
    silu_t c = {gate, up, out, g_stride, u_stride, out_stride, rows, n, n >= 4096 ? 4 : 1};
    pool_run(silu_mul_parts, &c, op_threads(threads, (size_t)rows * n / 4, rows * c.chunks));
}

/* out = gate / (1 + exp(-gate)) * up, row by row */
void ks_silu_mul(const float *gate, ptrdiff_t g_stride, const float *up, ptrdiff_t u_stride, int rows, int n,
                 float *out, ptrdiff_t out_stride, int threads) {
    silu_mul_rows(gate, g_stride, up, u_stride, rows, n, out, out_stride, threads);
}

/* In place, rotate-half: x' = x * cos + cat(-x2, x1) * sin.  x: [T, heads, D] (token stride, head stride);
   cos, sin: [T, D]. */
void ks_rope(float *x, ptrdiff_t t_stride, ptrdiff_t h_stride, int T, int heads, int D, const float *cos_t,
             const float *sin_t) {
    int half = D / 2;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < heads; h++) {
            float *v = x + t_stride * t + h_stride * h;
            const float *c = cos_t + (ptrdiff_t)t * D, *s = sin_t + (ptrdiff_t)t * D;
            for (int i = 0; i < half; i++) {
                float x1 = v[i], x2 = v[i + half];
                v[i] = x1 * c[i] + (-x2) * s[i];
                v[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
}

/* The rope op of one session's run of rows, as run/host/program.py's numpy: a fused qkv output [T, (H + 2
   n_kv) * D] (row stride qkv_t) plus bias [(H + 2 n_kv) * D] (or NULL), q and k heads rmsnormed over D by
   qk_norm [H + n_kv, D] (or NULL), rotated by rope_rotation's tables (cos, signed sin [T, D]:
   x' = x * cos + swap_halves(x) * sin); q into q_out [T, H * D] (row stride q_t), k and v into a cache's
   rows k_out, v_out [T, n_kv * D] (row stride kv_t).  Rows are independent: the work splits by token. */
typedef struct {
    const float *qkv, *bias, *qk_norm, *cos_t, *sin_t;
    float *q_out, *k_out, *v_out;
    ptrdiff_t qkv_t, q_t, kv_t;
    int T, H, n_kv, D;
    float eps;
} qkv_rope_t;

static void qkv_rope_rows(void *ctx, int index, int count) {
    const qkv_rope_t *c = ctx;
    const int D = c->D, half = D / 2, heads = c->H + c->n_kv;
    float head[1024];
    for (int t = index; t < c->T; t += count) {
        const float *row = c->qkv + c->qkv_t * t, *cs = c->cos_t + (ptrdiff_t)t * D, *sn = c->sin_t + (ptrdiff_t)t * D;
        for (int h = 0; h < heads; h++) {
            const float *src = row + (ptrdiff_t)h * D, *b = c->bias ? c->bias + (ptrdiff_t)h * D : NULL;
            if (b)
                for (int i = 0; i < D; i++) head[i] = src[i] + b[i];
            else
                memcpy(head, src, sizeof(float) * D);
            if (c->qk_norm) rmsnorm_row(head, c->qk_norm + (ptrdiff_t)h * D, D, c->eps, head);
            float *o = h < c->H ? c->q_out + c->q_t * t + (ptrdiff_t)h * D : c->k_out + c->kv_t * t + (ptrdiff_t)(h - c->H) * D;
            for (int i = 0; i < half; i++) {
                o[i] = head[i] * cs[i] + head[i + half] * sn[i];
                o[i + half] = head[i + half] * cs[i + half] + head[i] * sn[i + half];
            }
        }
        const float *v = row + (ptrdiff_t)heads * D, *vb = c->bias ? c->bias + (ptrdiff_t)heads * D : NULL;
        float *vo = c->v_out + c->kv_t * t;
        if (vb)
            for (int i = 0; i < c->n_kv * D; i++) vo[i] = v[i] + vb[i];
        else
            memcpy(vo, v, sizeof(float) * c->n_kv * D);
    }
}

/* Returns 0, or -1 when D is over the 1,024 a head's buffer holds. */
int ks_qkv_rope(const float *qkv, ptrdiff_t qkv_t, int T, int H, int n_kv, int D, const float *bias, const float *qk_norm,
                float eps, const float *cos_t, const float *sin_t, float *q_out, ptrdiff_t q_t, float *k_out,
                float *v_out, ptrdiff_t kv_t, int threads) {
    if (D > 1024 || D % 2) return -1;
    qkv_rope_t c = {qkv, bias, qk_norm, cos_t, sin_t, q_out, k_out, v_out, qkv_t, q_t, kv_t, T, H, n_kv, D, eps};
    pool_run(qkv_rope_rows, &c, op_threads(threads, (size_t)T * (H + 2 * n_kv) * D, T));
    return 0;
}

/* Row j of a KV head as float32: the row itself, or (f16) converted into tmp. */
static inline const float *kv_row(const void *base, int f16, ptrdiff_t offset, int D, float *tmp) {
    if (!f16) return (const float *)base + offset;
    const uint16_t *h = (const uint16_t *)base + offset;
    int d = 0;
#if KS_X86 && defined(__F16C__)
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(tmp + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + d))));
#endif
    for (; d < D; d++) tmp[d] = h2f(h[d]);
    return tmp;
}

/* One job: query heads 0..nh*group-1 from q (head stride q_h) over kv heads 0..nh-1 at `head` (head
   stride kv_h), keys first..pos: the nh kv heads of a key row are adjacent in memory, so a job streams
   through them; each row is read (and converted) once for its group of query heads.
   probs: [nh * group][S]; tmp: [D]. */
static void attention_job(const float *q, ptrdiff_t q_h, int group, int nh, int D, const void *k, const void *v,
                          int f16, ptrdiff_t kv_t, ptrdiff_t kv_h, ptrdiff_t head, int first, int pos, float scale,
                          float *probs, int S, float *tmp, float *best, float *out) {
    const int heads = nh * group;
    for (int g = 0; g < heads; g++) best[g] = -INFINITY;
    for (int j = first; j <= pos; j++)
        for (int hh = 0; hh < nh; hh++) {
            const float *kr = kv_row(k, f16, kv_t * j + head + kv_h * hh, D, tmp);
            for (int g = hh * group; g < (hh + 1) * group; g++) {
                const float *qv = q + q_h * g;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < D; d++) s = fmaf(qv[d], kr[d], s);
                s *= scale;
                probs[(size_t)g * S + j] = s;
                best[g] = s > best[g] ? s : best[g];
            }
        }
    for (int g = 0; g < heads; g++) {
        float *p = probs + (size_t)g * S, total = 0.0f, bg = best[g];
#pragma omp simd reduction(+ : total)
        for (int j = first; j <= pos; j++) {
            p[j] = exp_poly(p[j] - bg);
            total += p[j];
        }
#pragma omp simd
        for (int j = first; j <= pos; j++) p[j] = p[j] / total;
        for (int d = 0; d < D; d++) out[(size_t)g * D + d] = 0.0f;
    }
    for (int j = first; j <= pos; j++)
        for (int hh = 0; hh < nh; hh++) {
            const float *vr = kv_row(v, f16, kv_t * j + head + kv_h * hh, D, tmp);
            for (int g = hh * group; g < (hh + 1) * group; g++) {
                float pj = probs[(size_t)g * S + j], *o = out + (size_t)g * D;
#pragma omp simd
                for (int d = 0; d < D; d++) o[d] = fmaf(pj, vr[d], o[d]);
            }
        }
}

/* q: [n, H, D] at positions start..start+n-1 (strides q_t, q_h); k, v: [S, n_kv, D] float32 or f16
   (kv_f16), row stride kv_t, head stride kv_h (elements); out: [n, H * D] (row stride out_t).  Query i
   sees keys max(0, start+i-window+1) .. start+i (window <= 0: no window); q head h reads kv head
   h / (H / n_kv).  softmax(q k^T * scale) v, as run/host.attention.  Up to ROW_QUERIES queries (decode,
   a short draft) jobs are (query, kv head) pairs, so the heads of a group read each key and value row
   once and one query still splits over the threads; more queries (a prompt's chunk) go to
   ks_attention_tiled, whose jobs (kv head, a run of queries) score tiles of queries against tiles of
   keys with SIMD over the keys (a dot product a key at a time bounds this one). */
#define ROW_QUERIES 4

typedef struct {
    const float *q;
    const void *k, *v;
    float *out;
    ptrdiff_t q_t, q_h, kv_t, kv_h, out_t;
    int n, D, group, n_kv, start, window, kv_f16, run, runs, S;
    float scale;
    _Atomic int next, failed;
} attention_t;

static void attention_jobs(void *ctx, int index, int count) {
    (void)index, (void)count;
    attention_t *c = ctx;
    const int group = c->group, run = c->run, S = c->S, D = c->D;
    float *probs = malloc(sizeof(float) * ((size_t)S * run * group + (size_t)D + (size_t)run * group));
    if (!probs) {
        atomic_store(&c->failed, 1);
        return;
    }
    for (int job; (job = atomic_fetch_add_explicit(&c->next, 1, memory_order_relaxed)) < c->n * c->runs;) {
        int i = job / c->runs, h0 = (job % c->runs) * run, nh = c->n_kv - h0 < run ? c->n_kv - h0 : run, pos = c->start + i;
        int first = c->window > 0 && pos - c->window + 1 > 0 ? pos - c->window + 1 : 0;
        attention_job(c->q + c->q_t * i + c->q_h * (ptrdiff_t)(h0 * group), c->q_h, group, nh, D, c->k, c->v, c->kv_f16,
                      c->kv_t, c->kv_h, c->kv_h * h0, first, pos, c->scale, probs, S, probs + (size_t)S * run * group,
                      probs + (size_t)S * run * group + D, c->out + c->out_t * i + (ptrdiff_t)h0 * group * D);
    }
    free(probs);
}

int ks_attention(const float *q, ptrdiff_t q_t, ptrdiff_t q_h, int n, int H, int D, const void *k, const void *v,
                 int kv_f16, ptrdiff_t kv_t, ptrdiff_t kv_h, int n_kv, int start, int window, float scale,
                 float *out, ptrdiff_t out_t, int threads) {
    if (n > ROW_QUERIES)
        return ks_attention_tiled(q, q_t, q_h, n, H, D, k, v, kv_f16, kv_t, kv_h, n_kv, start, window, scale, out,
                                  out_t, threads);
    if (threads < 1) threads = 1;
    attention_t c = {.q = q, .k = k, .v = v, .out = out, .q_t = q_t, .q_h = q_h, .kv_t = kv_t, .kv_h = kv_h, .out_t = out_t,
                     .n = n, .D = D, .group = H / n_kv, .n_kv = n_kv, .start = start, .window = window, .kv_f16 = kv_f16,
                     .S = start + n, .scale = scale};
    /* jobs: (query, a run of adjacent kv heads), about `threads` jobs per query when there are few queries */
    const int parts = n >= threads ? 1 : (threads + n - 1) / n < n_kv ? (threads + n - 1) / n : n_kv;
    c.run = (n_kv + parts - 1) / parts, c.runs = (n_kv + c.run - 1) / c.run;
    pool_run(attention_jobs, &c, op_threads(threads, (size_t)c.S * n * H * D / 4, n * c.runs));
    return atomic_load(&c.failed) ? -1 : 0;
}

/* The tiled attention of a prompt's chunk (flash-attention style): a tile of TILE_ROWS query vectors
   (queries × the heads of a group, which share a kv head) against tiles of TILE_KEYS keys, scores in a
   [TILE_ROWS][TILE_KEYS] block, an online softmax (a running max and sum a row, the output rescaled when
   the max grows) so no row of S probabilities is kept.  A job is (kv head, a run of queries): it first
   packs the keys it reads transposed, [tile][D][TILE_KEYS] (and f16 values as float32), so the score
   block is an outer-product loop over D with SIMD over keys and each key and value row is read (and
   converted) once for every query of the job. */
#define TILE_ROWS 16
#define TILE_KEYS 16

typedef struct {
    const float *q;
    const void *k, *v;
    float *out;
    ptrdiff_t q_t, q_h, kv_t, kv_h, out_t;
    int n, D, group, n_kv, start, window, kv_f16, per_job, jobs_per_head;
    float scale;
    _Atomic int next, failed;
} attention_tiled_t;

/* A pool thread's packing buffer, grown as a job needs (the pool's threads persist) */
static _Thread_local float *tiled_buffer;
static _Thread_local size_t tiled_capacity;

static float *tiled_floats(size_t count) {
    if (count > tiled_capacity) {
        free(tiled_buffer);
        tiled_buffer = malloc(sizeof(float) * count);
        tiled_capacity = tiled_buffer ? count : 0;
    }
    return tiled_buffer;
}

static inline int first_key(int pos, int window) { return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0; }

/* One key tile's step of rows q [TILE_ROWS][D] (scaled) at keys first[r]..pos[r]: scores against the
   tile kb [D][TILE_KEYS] (keys j0..), the running max best and sum total, o [TILE_ROWS][D] rescaled and
   added the tile's `keys` value rows (row stride vs). */
static void tile_step(const float *restrict q, const int *pos, const int *first, const float *restrict kb, int j0,
                      const float *restrict vr, ptrdiff_t vs, int keys, int D, float *best, float *total,
                      float *restrict o) {
    float s[TILE_ROWS][TILE_KEYS];
    for (int r = 0; r < TILE_ROWS; r++)
        for (int l = 0; l < TILE_KEYS; l++) s[r][l] = 0.0f;
    for (int d = 0; d < D; d++) {
        const float *kd = kb + (size_t)d * TILE_KEYS;
        for (int r = 0; r < TILE_ROWS; r++) {
            const float qd = q[(size_t)r * D + d];
#pragma omp simd
            for (int l = 0; l < TILE_KEYS; l++) s[r][l] = fmaf(qd, kd[l], s[r][l]);
        }
    }
    for (int r = 0; r < TILE_ROWS; r++) {
        float m = best[r];
        for (int l = 0; l < TILE_KEYS; l++) {
            const int j = j0 + l;
            if (j < first[r] || j > pos[r]) s[r][l] = -INFINITY;
            m = s[r][l] > m ? s[r][l] : m;
        }
        float f = 1.0f, sum = 0.0f;
        if (m == -INFINITY) {                   /* no key of this tile for this row */
            for (int l = 0; l < TILE_KEYS; l++) s[r][l] = 0.0f;
            continue;
        }
        if (m > best[r]) f = exp_poly(best[r] - m), best[r] = m;
        for (int l = 0; l < TILE_KEYS; l++) {
            s[r][l] = exp_poly(s[r][l] - m);
            sum += s[r][l];
        }
        total[r] = total[r] * f + sum;
        if (f != 1.0f) {
            float *orow = o + (size_t)r * D;
#pragma omp simd
            for (int d = 0; d < D; d++) orow[d] *= f;
        }
    }
    for (int l = 0; l < keys; l++) {
        const float *v = vr + vs * l;
        for (int r = 0; r < TILE_ROWS; r++) {
            const float p = s[r][l];
            float *orow = o + (size_t)r * D;
#pragma omp simd
            for (int d = 0; d < D; d++) orow[d] = fmaf(p, v[d], orow[d]);
        }
    }
}

#if KS_X86 && defined(__AVX512F__)
/* exp_poly on 16 lanes, the same operations in the same order */
static inline __m512 exp_poly16(__m512 x) {
    __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.72283f));
    __m512 n = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(xc, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
    y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_LT_OQ), _mm512_setzero_ps());
    return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.72283f), _CMP_GT_OQ), _mm512_set1_ps(INFINITY));
}

/* tile_step with the scores in registers and the output in 16-lane strips (D a multiple of 16) */
static void tile_step_avx512(const float *restrict q, const int *pos, const int *first, const float *restrict kb,
                             int j0, const float *restrict vr, ptrdiff_t vs, int keys, int D, float *best,
                             float *total, float *restrict o) {
    __m512 s[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) s[r] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
        const __m512 kd = _mm512_loadu_ps(kb + (size_t)d * TILE_KEYS);
        for (int r = 0; r < TILE_ROWS; r++) s[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[(size_t)r * D + d]), kd, s[r]);
    }
    const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(j0), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    float p[TILE_ROWS][TILE_KEYS], f[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) {
        const __mmask16 seen = _mm512_cmp_epi32_mask(key, _mm512_set1_epi32(first[r]), _MM_CMPINT_NLT) &
                               _mm512_cmp_epi32_mask(key, _mm512_set1_epi32(pos[r]), _MM_CMPINT_LE);
        f[r] = 1.0f;
        if (!seen) {
            _mm512_storeu_ps(p[r], _mm512_setzero_ps());
            continue;
        }
        const float m0 = _mm512_mask_reduce_max_ps(seen, s[r]), m = m0 > best[r] ? m0 : best[r];
        if (m > best[r]) f[r] = exp_poly(best[r] - m), best[r] = m;
        const __m512 e = _mm512_maskz_mov_ps(seen, exp_poly16(_mm512_sub_ps(s[r], _mm512_set1_ps(m))));
        _mm512_storeu_ps(p[r], e);
        total[r] = total[r] * f[r] + _mm512_reduce_add_ps(e);
    }
    for (int d = 0; d < D; d += 16) {
        __m512 acc[TILE_ROWS];
        for (int r = 0; r < TILE_ROWS; r++)
            acc[r] = _mm512_mul_ps(_mm512_loadu_ps(o + (size_t)r * D + d), _mm512_set1_ps(f[r]));
        for (int l = 0; l < keys; l++) {
            const __m512 v = _mm512_loadu_ps(vr + vs * l + d);
            for (int r = 0; r < TILE_ROWS; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][l]), v, acc[r]);
        }
        for (int r = 0; r < TILE_ROWS; r++) _mm512_storeu_ps(o + (size_t)r * D + d, acc[r]);
    }
}
#endif

/* Rows q [TILE_ROWS][D] (scaled) at positions pos[r] (keys first[r]..pos[r]) over the packed keys kt
   (tile 0 starts at key k0) and values vals (row j - k0, row stride vs) → o [TILE_ROWS][D] (normalized). */
static void tiled_rows(const float *restrict q, const int *pos, const int *first, const float *restrict kt, int k0,
                       const float *restrict vals, ptrdiff_t vs, int D, float *restrict o) {
    float best[TILE_ROWS], total[TILE_ROWS];
    int lo = first[0], hi = pos[0];
    for (int r = 0; r < TILE_ROWS; r++) {
        best[r] = -INFINITY, total[r] = 0.0f;
        lo = first[r] < lo ? first[r] : lo, hi = pos[r] > hi ? pos[r] : hi;
        for (int d = 0; d < D; d++) o[(size_t)r * D + d] = 0.0f;
    }
    for (int j0 = k0 + (lo - k0) / TILE_KEYS * TILE_KEYS; j0 <= hi; j0 += TILE_KEYS) {
        const float *kb = kt + (size_t)((j0 - k0) / TILE_KEYS) * D * TILE_KEYS;
        const int keys = hi - j0 + 1 < TILE_KEYS ? hi - j0 + 1 : TILE_KEYS;
#if KS_X86 && defined(__AVX512F__)
        if (D % 16 == 0) {
            tile_step_avx512(q, pos, first, kb, j0, vals + vs * (j0 - k0), vs, keys, D, best, total, o);
            continue;
        }
#endif
        tile_step(q, pos, first, kb, j0, vals + vs * (j0 - k0), vs, keys, D, best, total, o);
    }
    for (int r = 0; r < TILE_ROWS; r++) {
        float *orow = o + (size_t)r * D;
        const float t = total[r];
#pragma omp simd
        for (int d = 0; d < D; d++) orow[d] = orow[d] / t;
    }
}

static void attention_tiled_jobs(void *ctx, int index, int count) {
    (void)index, (void)count;
    attention_tiled_t *c = ctx;
    const int D = c->D, group = c->group;
    for (int job; (job = atomic_fetch_add_explicit(&c->next, 1, memory_order_relaxed)) < c->n_kv * c->jobs_per_head;) {
        const int h = job / c->jobs_per_head, i0 = (job % c->jobs_per_head) * c->per_job;
        const int i1 = i0 + c->per_job < c->n ? i0 + c->per_job : c->n;
        if (i0 >= i1) continue;
        const int k0 = first_key(c->start + i0, c->window), k1 = c->start + i1;       /* keys k0..k1-1 */
        const int tiles = (k1 - k0 + TILE_KEYS - 1) / TILE_KEYS;
        const size_t packed = (size_t)tiles * TILE_KEYS * D, values = c->kv_f16 ? (size_t)(k1 - k0) * D : 0;
        float *kt = tiled_floats(packed + values + (size_t)TILE_ROWS * 2 * D);
        if (!kt) {
            atomic_store(&c->failed, 1);
            return;
        }
        float *vbuf = kt + packed, *qt = vbuf + values, *o = qt + (size_t)TILE_ROWS * D;
        for (int t = 0; t < tiles; t++) {
            float *block = kt + (size_t)t * TILE_KEYS * D;
            for (int l = 0; l < TILE_KEYS; l++) {
                const int j = k0 + t * TILE_KEYS + l;
                if (j >= k1) {
                    for (int d = 0; d < D; d++) block[(size_t)d * TILE_KEYS + l] = 0.0f;
                    continue;
                }
                const ptrdiff_t at = c->kv_t * j + c->kv_h * h;
                const float *kr = kv_row(c->k, c->kv_f16, at, D, o);
                for (int d = 0; d < D; d++) block[(size_t)d * TILE_KEYS + l] = kr[d];
                if (c->kv_f16) kv_row(c->v, 1, at, D, vbuf + (size_t)(j - k0) * D);
            }
        }
        const float *vals = c->kv_f16 ? vbuf : (const float *)c->v + c->kv_t * k0 + c->kv_h * h;
        const ptrdiff_t vs = c->kv_f16 ? D : c->kv_t;
        const int rows = (i1 - i0) * group;
        for (int r0 = 0; r0 < rows; r0 += TILE_ROWS) {
            int pos[TILE_ROWS], first[TILE_ROWS];
            for (int r = 0; r < TILE_ROWS; r++) {
                const int row = r0 + r < rows ? r0 + r : rows - 1;        /* past the end: the last row again */
                const int i = i0 + row / group, g = row % group;
                const float *qv = c->q + c->q_t * i + c->q_h * (ptrdiff_t)(h * group + g);
                for (int d = 0; d < D; d++) qt[(size_t)r * D + d] = qv[d] * c->scale;
                pos[r] = c->start + i, first[r] = first_key(pos[r], c->window);
            }
            tiled_rows(qt, pos, first, kt, k0, vals, vs, D, o);
            for (int r = 0; r < TILE_ROWS && r0 + r < rows; r++) {
                const int i = i0 + (r0 + r) / group, g = (r0 + r) % group;
                memcpy(c->out + c->out_t * i + (ptrdiff_t)(h * group + g) * D, o + (size_t)r * D, sizeof(float) * D);
            }
        }
    }
}

int ks_attention_tiled(const float *q, ptrdiff_t q_t, ptrdiff_t q_h, int n, int H, int D, const void *k, const void *v,
                       int kv_f16, ptrdiff_t kv_t, ptrdiff_t kv_h, int n_kv, int start, int window, float scale,
                       float *out, ptrdiff_t out_t, int threads) {
    if (threads < 1) threads = 1;
    attention_tiled_t c = {.q = q, .k = k, .v = v, .out = out, .q_t = q_t, .q_h = q_h, .kv_t = kv_t, .kv_h = kv_h,
                           .out_t = out_t, .n = n, .D = D, .group = H / n_kv, .n_kv = n_kv, .start = start,
                           .window = window, .kv_f16 = kv_f16, .scale = scale};
    /* jobs: (kv head, a run of queries), at least 4 a thread where the queries allow it */
    const int tile_queries = (TILE_ROWS + c.group - 1) / c.group;
    int parts = (4 * threads + n_kv - 1) / n_kv, tiles = (n + tile_queries - 1) / tile_queries;
    parts = parts < tiles ? parts : tiles;
    c.per_job = (tiles + parts - 1) / parts * tile_queries;
    c.jobs_per_head = (n + c.per_job - 1) / c.per_job;
    pool_run(attention_tiled_jobs, &c, op_threads(threads, (size_t)(start + n) * n * H * D / 4, n_kv * c.jobs_per_head));
    return atomic_load(&c.failed) ? -1 : 0;
}

typedef struct {
    const uint64_t *p;
    size_t n;
    uint64_t partial[POOL_MAX];
} read_sum_t;

static void read_sum_part(void *ctx, int index, int count) {
    read_sum_t *c = ctx;
    size_t lo = c->n * (size_t)index / (size_t)count, hi = c->n * (size_t)(index + 1) / (size_t)count;
    uint64_t total = 0;
    for (size_t i = lo; i < hi; i++) total += c->p[i];
    c->partial[index] = total;
}

/* The sum of n 64-bit words read once by `threads` threads: the bench's plain memory read. */
uint64_t ks_read_sum(const uint64_t *p, size_t n, int threads) {
    read_sum_t *c = calloc(1, sizeof *c);
    if (!c) return 0;
    c->p = p, c->n = n;
    int count = threads < 1 ? 1 : threads > POOL_MAX ? POOL_MAX : threads;
    pool_run(read_sum_part, c, count);
    uint64_t total = 0;
    for (int i = 0; i < count; i++) total += c->partial[i];
    free(c);
    return total;
}
