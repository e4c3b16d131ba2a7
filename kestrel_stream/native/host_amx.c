/* Quantized matmuls on AMX tiles (AMX-INT8).
 *
 * With AVX-512 VNNI a vpdpbusd adds 64 byte products; with the activations in two levels (host_kernels.c)
 * a matmul of a few tokens is bound by them, not by memory: on the H200's host Q8_0 falls from 95 GB/s at
 * one token to 45 at 8.  A tile instruction (tdpbssd) adds 16 x 16 x 32 products in one: a 16-row tile of
 * weights (A) times a token group's activations laid out as the lanes kernel lays them (B: [K/4][16
 * tokens][4], signed), into int32 sums per weight row and token (C).  Each weight block's sums of both
 * levels come out of two such products (hi and lo), are stored, joined as 128 * hi + lo and scaled in
 * float exactly as the lanes kernel does it (the same int32 values, the same float steps in the same
 * order: the same bits).
 *
 * Tiles need the kernel's permission (Linux ARCH_REQ_XCOMP_PERM, asked once by amx_usable) and a
 * configuration per thread (amx_*_begin), released after (amx_end).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "host_amx.h"
#include "host_simd.h"

#if KS_X86 && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KS_AMX 1
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#else
#define KS_AMX 0
#endif

int amx_usable(void) {
#if KS_AMX
    static int usable = -1;
    if (usable < 0) {
        unsigned a, b, c, d;
        const int cpu = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1);
        usable = cpu && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return usable;
#else
    return 0;
#endif
}

#if KS_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config_t;

/* tile registers (numbers, not an enum: the intrinsics paste them into the instruction) */
#define C_HI 0
#define C_LO 1
#define A_W 2
#define B_HI 3
#define B_LO 4
/* amx_q8_0_one's prefetches of the weight rows' lines, in blocks ahead: into L2 far, into L1 near (at one
   token the 16 row streams are read fastest; 8 ahead into L1 alone measured 7-10 % slower on a core reading
   alone, the dot products' rate; the 16-lane kernel keeps 8 into L1, 5-8 % faster for it) */
#define PF_FAR 16
#define PF_NEAR 4

/* Each configuration is a constant in memory: ldtilecfg reads its operand behind the compiler's back (a
   configuration built on the stack just before was dropped as dead stores). */
static const tile_config_t Q8_0_TILES = {
    .palette = 1,
    .colsb = {[C_HI] = 64, [C_LO] = 64, [A_W] = 32, [B_HI] = 64, [B_LO] = 64},
    .rows = {[C_HI] = 16, [C_LO] = 16, [A_W] = 16, [B_HI] = 8, [B_LO] = 8},    /* A: 16 weight rows x a block of
                                                                                 32; B: its 8 quads x 16 tokens x 4 */
};

/* One token: B its 8 quads of 4 values, read where quantize_act wrote them; C the 16 rows' sums in a row of
   16 int32 (lanes = weight rows) */
static const tile_config_t Q8_0_ONE = {
    .palette = 1,
    .colsb = {[C_HI] = 4, [C_LO] = 4, [A_W] = 32, [B_HI] = 4, [B_LO] = 4},
    .rows = {[C_HI] = 16, [C_LO] = 16, [A_W] = 16, [B_HI] = 8, [B_LO] = 8},
};

/* Repacked Q4_K (host_kquants.c's kq_amx_group) at M tokens: C the sums of two sub-blocks and both levels
   [M tokens][16 rows] int32; A a sub-block's activations of one level [M][32] (signed); B its weights
   [8 quads][16 rows][4] (unsigned nibbles) */
#define KQ_AMX_TILES(M) {.palette = 1, \
    .colsb = {[KQ_C_H0] = 64, [KQ_C_L0] = 64, [KQ_C_H1] = 64, [KQ_C_L1] = 64, [KQ_A_HI] = 32, [KQ_A_LO] = 32, \
              [KQ_B_0] = 64, [KQ_B_1] = 64}, \
    .rows = {[KQ_C_H0] = M, [KQ_C_L0] = M, [KQ_C_H1] = M, [KQ_C_L1] = M, [KQ_A_HI] = M, [KQ_A_LO] = M, \
             [KQ_B_0] = 8, [KQ_B_1] = 8}}
static const tile_config_t KQ_TILES[16] = {
    KQ_AMX_TILES(1), KQ_AMX_TILES(2), KQ_AMX_TILES(3), KQ_AMX_TILES(4), KQ_AMX_TILES(5), KQ_AMX_TILES(6),
    KQ_AMX_TILES(7), KQ_AMX_TILES(8), KQ_AMX_TILES(9), KQ_AMX_TILES(10), KQ_AMX_TILES(11), KQ_AMX_TILES(12),
    KQ_AMX_TILES(13), KQ_AMX_TILES(14), KQ_AMX_TILES(15), KQ_AMX_TILES(16)};

/* Repacked Q4_K's stacked form at M (<= 8) tokens: A [2M][32] (hi rows, then lo rows), C [2M][16] */
#define KQ_STACKED_TILES(M) {.palette = 1, \
    .colsb = {[KQS_A_0] = 32, [KQS_A_1] = 32, [KQS_B_0] = 64, [KQS_B_1] = 64, [KQS_C_0] = 64, [KQS_C_1] = 64, \
              [KQS_C_2] = 64, [KQS_C_3] = 64}, \
    .rows = {[KQS_A_0] = 2 * M, [KQS_A_1] = 2 * M, [KQS_B_0] = 8, [KQS_B_1] = 8, [KQS_C_0] = 2 * M, \
             [KQS_C_1] = 2 * M, [KQS_C_2] = 2 * M, [KQS_C_3] = 2 * M}}
static const tile_config_t KQ_STACKED[8] = {
    KQ_STACKED_TILES(1), KQ_STACKED_TILES(2), KQ_STACKED_TILES(3), KQ_STACKED_TILES(4), KQ_STACKED_TILES(5),
    KQ_STACKED_TILES(6), KQ_STACKED_TILES(7), KQ_STACKED_TILES(8)};

/* The configuration this thread has loaded (AMX_NONE: none). */
static __thread int amx_config;

TARGET_AMX void amx_use(int config) {
    if (amx_config == config) return;
    _tile_loadconfig(config == AMX_Q8_0 ? &Q8_0_TILES : config == AMX_Q8_0_ONE ? &Q8_0_ONE
                     : config > AMX_Q4_K_STACKED ? &KQ_STACKED[config - AMX_Q4_K_STACKED - 1] : &KQ_TILES[config - AMX_Q4_K - 1]);
    amx_config = config;
}

TARGET_AMX void amx_done(void) {
    if (amx_config) _tile_release();
    amx_config = AMX_NONE;
}

TARGET_AMX void amx_q8_0_rows(const int8_t *w, ptrdiff_t w_stride, const float *scales, int K, const uint8_t *acts,
                              const float *d, int next, float out[16][16]) {
    const int nb = K / 32;
    const uint8_t *lo = acts + (size_t)K * 16;
    _Alignas(64) int32_t sums[2][2][16][16];        /* [block & 1][hi, lo][row][lane] */
    __m512 total[16];
    for (int r = 0; r < 16; r++) total[r] = _mm512_setzero_ps();
    /* block b's products are stored while block b - 1's sums are scaled (its stores long done) */
    for (int b = 0; b <= nb; b++) {
        if (b < nb) {
            if (!(b & 1))       /* the rows' lines 4 ahead (a line holds two blocks), past their ends (`next`) the next 16's */
                for (int r = 0; r < 16 && (b + 8 < nb || next); r++) {
                    const int ahead = b + 8;
                    _mm_prefetch((const char *)(ahead < nb ? w + w_stride * r + 32 * ahead : w + w_stride * (r + 16) + 32 * (ahead - nb)),
                                 _MM_HINT_T0);
                }
            _tile_zero(C_HI);
            _tile_zero(C_LO);
            _tile_loadd(A_W, w + 32 * b, w_stride);
            _tile_loadd(B_HI, acts + (size_t)512 * b, 64);
            _tile_loadd(B_LO, lo + (size_t)512 * b, 64);
            _tile_dpbssd(C_HI, A_W, B_HI);
            _tile_dpbssd(C_LO, A_W, B_LO);
            _tile_stored(C_HI, sums[b & 1][0], 64);
            _tile_stored(C_LO, sums[b & 1][1], 64);
        }
        if (b > 0) {
            const int p = b - 1;
            const __m512 ad = _mm512_load_ps(d + (size_t)p * 16);
            for (int r = 0; r < 16; r++) {
                const __m512i joined = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[p & 1][0][r]), 7),
                                                        _mm512_load_si512(sums[p & 1][1][r]));
                total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(joined),
                                           _mm512_mul_ps(_mm512_set1_ps(scales[16 * p + r]), ad), total[r]);
            }
        }
    }
    for (int r = 0; r < 16; r++) _mm512_storeu_ps(out[r], total[r]);
}

TARGET_AMX void amx_q8_0_one(const int8_t *w, ptrdiff_t w_stride, const float *scales, int K, const int8_t *hi,
                             const int8_t *lo, const float *d, int next, float out[16]) {
    const int nb = K / 32;
    _Alignas(64) int32_t sums[2][2][16];            /* [block & 1][hi, lo][row] */
    __m512 total = _mm512_setzero_ps();
    for (int b = 0; b <= nb; b++) {
        if (b < nb) {
            if (!(b & 1))       /* past the rows' ends, where `next`: the next 16 rows' first lines */
                for (int r = 0; r < 16; r++) {
                    const int far = b + PF_FAR, near = b + PF_NEAR;
                    if (far < nb || next)
                        _mm_prefetch((const char *)(far < nb ? w + w_stride * r + 32 * far : w + w_stride * (r + 16) + 32 * (far - nb)),
                                     _MM_HINT_T1);
                    if (near < nb || next)
                        _mm_prefetch((const char *)(near < nb ? w + w_stride * r + 32 * near : w + w_stride * (r + 16) + 32 * (near - nb)),
                                     _MM_HINT_T0);
                }
            _tile_zero(C_HI);
            _tile_zero(C_LO);
            _tile_loadd(A_W, w + 32 * b, w_stride);
            _tile_loadd(B_HI, hi + 32 * b, 4);
            _tile_loadd(B_LO, lo + 32 * b, 4);
            _tile_dpbssd(C_HI, A_W, B_HI);
            _tile_dpbssd(C_LO, A_W, B_LO);
            _tile_stored(C_HI, sums[b & 1][0], 4);
            _tile_stored(C_LO, sums[b & 1][1], 4);
        }
        if (b > 0) {            /* the lanes kernel's steps, a lane a row: scale * (d / 128), one FMA a block */
            const int p = b - 1;
            const __m512i joined = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[p & 1][0]), 7),
                                                    _mm512_load_si512(sums[p & 1][1]));
            total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(joined),
                                    _mm512_mul_ps(_mm512_loadu_ps(scales + 16 * p), _mm512_set1_ps(d[p] * LO_SCALE)), total);
        }
    }
    _mm512_storeu_ps(out, total);
}

#else
void amx_use(int config) { (void)config; }
void amx_q8_0_one(const int8_t *w, ptrdiff_t w_stride, const float *scales, int K, const int8_t *hi, const int8_t *lo,
                  const float *d, int next, float out[16]) {
    (void)w, (void)w_stride, (void)scales, (void)K, (void)hi, (void)lo, (void)d, (void)next, (void)out;
}
void amx_done(void) {}
void amx_q8_0_rows(const int8_t *w, ptrdiff_t w_stride, const float *scales, int K, const uint8_t *acts, const float *d,
                   int next, float out[16][16]) {
    (void)w, (void)w_stride, (void)scales, (void)K, (void)acts, (void)d, (void)next, (void)out;
}

#endif
