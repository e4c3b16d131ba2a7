/* Q4_K and Q6_K weights repacked 16 rows together, and their GEMV / small GEMM.
 *
 * The blocks as stored hold one row each, so a vector of them holds values of one row: a dot product
 * per row and token, its sub-block scales applied to a few lanes at a time and the row's sum reduced
 * across lanes.  Repacked (ks_repack, once per weight), a group of 16 rows keeps each 4-byte piece of
 * the rows' quants side by side: one 64-byte load holds 4 quants of each of the 16 rows, vpdpbusd with
 * 4 activations broadcast adds their dot products into the 16 rows' lanes, and 8 such loads make a
 * 32-value sub-block whose scale (one per row: a vector) is applied once to 16 rows.  A decoded load
 * serves 4 tokens (a chunk of the call's activations, kq_acts_t), so a prefill decodes each block once
 * per 4 tokens, not once per token.  The results are the 16 rows' lanes: no reduction.
 *
 * Group layouts (r: row in the group; the group's rows past N are zeros, their results dropped):
 *   Q4_K, per 256-value block (2,304 bytes, the 16 rows' 144): quants [32][16][4] (piece p = 8c + q of
 *   row r: bytes 32c + 4q .. +3 of the row's 128, whose low nibbles are sub-block 2c's values 4q..4q+3
 *   and high nibbles sub-block 2c+1's), the 12 packed scale bytes [12][16], d [16] and dmin [16] f16.
 *   Q6_K, per block (3,392 bytes: the 16 rows' 3,360 and 32 to keep blocks 64-byte aligned): low bits
 *   [2 h][2 s'][8 q][16][4] (ql bytes 64h + 32s' + 4q ..), high bits [2 h][8 q][16][4] (qh bytes 32h + 4q
 *   ..), scales [16][16] int8, d [16] f16.
 *
 * The arithmetic is host_kernels.c's (q8_K activations in two levels, integer dot products per
 * sub-block joined as 128 * hi + lo): kq_row_scalar forms each block's term exactly as the twin; the
 * VNNI kernels scale each sub-block's int32 sums in float, as the lanes kernels do.
 */
#include <stddef.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "host_amx.h"
#include "host_kquants.h"
#include "host_simd.h"

#define Q4K_BLOCK 144
#define Q6K_BLOCK 210
#define Q4K_GROUP_BLOCK (KQ_ROWS * Q4K_BLOCK)       /* 2,304 */
#define Q4K_SCALES 2048
#define Q4K_D 2240
#define Q4K_DMIN 2272
#define Q6K_GROUP_BLOCK 3392                        /* the 16 rows' 3,360 bytes, 64-byte aligned */
#define Q6K_HIGH 2048
#define Q6K_SCALES 3072
#define Q6K_D 3328

static size_t group_bytes(int fmt, int K) {
    const size_t nb = (size_t)(K / 256);
    return nb * (fmt == FMT_Q4_K ? Q4K_GROUP_BLOCK : Q6K_GROUP_BLOCK);
}

/* Bytes per group of 16 rows of a repacked Q4_K or Q6_K weight of K columns (its group stride). */
size_t ks_repacked_group_bytes(int fmt, int K) { return group_bytes(fmt, K); }

/* The N x K weight of Q4_K or Q6_K blocks (row r at w + r * w_stride) into `out`, ceil(N / 16) groups of
   ks_repacked_group_bytes each (out 64-byte aligned for the kernels' loads). */
void ks_repack(int fmt, const uint8_t *w, ptrdiff_t w_stride, int N, int K, uint8_t *out) {
    const int nb = K / 256, groups = (N + KQ_ROWS - 1) / KQ_ROWS;
    const size_t stride = group_bytes(fmt, K);
    memset(out, 0, stride * (size_t)groups);
    for (int g = 0; g < groups; g++) {
        uint8_t *grp = out + stride * (size_t)g;
        for (int r = 0; r < KQ_ROWS && g * KQ_ROWS + r < N; r++) {
            const uint8_t *row = w + w_stride * (ptrdiff_t)(g * KQ_ROWS + r);
            for (int b = 0; b < nb; b++) {
                if (fmt == FMT_Q4_K) {
                    const uint8_t *blk = row + (size_t)Q4K_BLOCK * b;
                    uint8_t *o = grp + (size_t)Q4K_GROUP_BLOCK * b;
                    for (int p = 0; p < 32; p++) memcpy(o + 64 * p + 4 * r, blk + 16 + 4 * p, 4);
                    for (int k = 0; k < 12; k++) o[Q4K_SCALES + 16 * k + r] = blk[4 + k];
                    memcpy(o + Q4K_D + 2 * r, blk, 2);
                    memcpy(o + Q4K_DMIN + 2 * r, blk + 2, 2);
                } else {
                    const uint8_t *blk = row + (size_t)Q6K_BLOCK * b;
                    uint8_t *o = grp + (size_t)Q6K_GROUP_BLOCK * b;
                    for (int p = 0; p < 32; p++) memcpy(o + 64 * p + 4 * r, blk + 4 * p, 4);
                    for (int p = 0; p < 16; p++) memcpy(o + Q6K_HIGH + 64 * p + 4 * r, blk + 128 + 4 * p, 4);
                    for (int k = 0; k < 16; k++) o[Q6K_SCALES + 16 * k + r] = blk[192 + k];
                    memcpy(o + Q6K_D + 2 * r, blk + 208, 2);
                }
            }
        }
    }
}

static size_t chunk_bytes(int K) { return ((size_t)8 * K + (size_t)(K / 256 + K / 16) * KQ_CHUNK * 4 + 63) / 64 * 64; }

static size_t chunks_bytes(int K, int T) { return chunk_bytes(K) * (size_t)((T + KQ_CHUNK - 1) / KQ_CHUNK); }

size_t kq_acts_bytes(int K, int T, int stacked) { return chunks_bytes(K, T) + (stacked ? (size_t)2 * T * K : 0); }

kq_acts_t kq_acts_at(uint8_t *buf, int K, int T, int stacked) {     /* the last chunk's missing tokens are never read */
    return (kq_acts_t){.base = buf, .chunk_bytes = chunk_bytes(K), .K = K, .T = T,
                       .stacked = stacked ? (int8_t *)(buf + chunks_bytes(K, T)) : NULL};
}

int ks_kq_amx_min_tokens = 5;

/* Up to this many tokens a Q4_K call on AMX runs on the stacked levels (kq_amx_stacked): one tile product a
   sub-block for both levels of every token, where kq_amx_group takes one a level. */
#define KQ_STACKED_MAX 8

int kq_stacks(int fmt, int isa, int T) {
    return KS_X86 && isa >= ISA_AMX && fmt == FMT_Q4_K_R16 && T >= ks_kq_amx_min_tokens && T <= KQ_STACKED_MAX;
}

void kq_token(int fmt, const int8_t *hi, const int8_t *lo, const float *d, const int16_t *bsums,
              const int16_t *bsums_lo, int t, const kq_acts_t *acts) {
    const int K = acts->K, c = t / KQ_CHUNK, u = t % KQ_CHUNK;
    int8_t *h = kq_hi(acts, c) + 4 * u, *l = kq_lo(acts, c) + 4 * u;
    for (int p = 0; p < K / 4; p++) {
        memcpy(h + 4 * KQ_CHUNK * p, hi + 4 * p, 4);
        memcpy(l + 4 * KQ_CHUNK * p, lo + 4 * p, 4);
    }
    if (acts->stacked) {
        memcpy(acts->stacked + (size_t)K * t, hi, (size_t)K);
        memcpy(acts->stacked + (size_t)K * (acts->T + t), lo, (size_t)K);
    }
    float *dl = kq_dl(acts, c);
    for (int b = 0; b < K / 256; b++) dl[KQ_CHUNK * b + u] = d[b] * LO_SCALE;
    if (fmt == FMT_Q4_K_R16) {
        float *sums = kq_sums(acts, c);         /* exact: |128 * hi + lo| summed over 32 values < 2^20 */
        for (int j = 0; j < K / 32; j++)
            sums[KQ_CHUNK * j + u] = (float)(128 * (bsums[2 * j] + bsums[2 * j + 1]) + bsums_lo[2 * j] + bsums_lo[2 * j + 1]);
    } else {
        int32_t *offsets = kq_sums(acts, c);
        for (int g = 0; g < K / 16; g++) offsets[KQ_CHUNK * g + u] = -32 * (128 * bsums[g] + bsums_lo[g]);
    }
}

/* ---------------------------------------------------------------- scalar: one row, one token */

/* Where value i of a token is, from its first piece, in a chunk's pieces. */
static inline int value_at(int i) { return 4 * KQ_CHUNK * (i / 4) + i % 4; }

/* Row r of a group against token t, each block's term formed as dot_q4_K_scalar / dot_q6_K_scalar
   (and the twin) form it: exact 64-bit sums, d / 128 times (d_w * sumi - dmin * summ). */
static float kq_row_scalar(int fmt, const uint8_t *grp, int r, int nb, const kq_acts_t *a, int t) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        const int c = t / KQ_CHUNK, u = t % KQ_CHUNK;
        const int8_t *x = kq_hi(a, c) + 256 * KQ_CHUNK * b + 4 * u, *xl = kq_lo(a, c) + 256 * KQ_CHUNK * b + 4 * u;
        const float dl = kq_dl(a, c)[KQ_CHUNK * b + u];
        if (fmt == FMT_Q4_K_R16) {
            const uint8_t *blk = grp + (size_t)Q4K_GROUP_BLOCK * b;
            const float *sums = kq_sums(a, c);
            uint8_t packed[12];
            for (int k = 0; k < 12; k++) packed[k] = blk[Q4K_SCALES + 16 * k + r];
            int sc[8], m[8];
            q4k_scale_min(packed, sc, m);
            int64_t sumi = 0, summ = 0;
            for (int j = 0; j < 8; j++) {
                int s = 0, l = 0;
                for (int i = 0; i < 32; i++) {
                    int v = (blk[64 * (8 * (j >> 1) + i / 4) + 4 * r + i % 4] >> (4 * (j & 1))) & 0x0F;
                    s += v * x[value_at(32 * j + i)];
                    l += v * xl[value_at(32 * j + i)];
                }
                sumi += (int64_t)sc[j] * (128 * s + l);
                summ += (int64_t)m[j] * (int64_t)sums[KQ_CHUNK * (8 * b + j) + u];
            }
            acc += dl * (h2f_at(blk + Q4K_D + 2 * r) * (float)sumi - h2f_at(blk + Q4K_DMIN + 2 * r) * (float)summ);
        } else {
            const uint8_t *q = grp + (size_t)Q6K_GROUP_BLOCK * b;
            const int8_t *sc = (const int8_t *)(q + Q6K_SCALES);
            const int32_t *offsets = kq_sums(a, c);
            int64_t sumi = 0;
            for (int g = 0; g < 16; g++) {
                const int h = g >> 3, s = (g >> 1) & 3;
                int hs = 0, ls = 0;
                for (int i = 16 * (g & 1); i < 16 * (g & 1) + 16; i++) {
                    const int at = 4 * r + (i & 3);
                    int v = (q[64 * (16 * h + 8 * (s & 1) + i / 4) + at] >> (4 * (s >> 1))) & 0x0F;
                    v |= ((q[Q6K_HIGH + 64 * (8 * h + i / 4) + at] >> (2 * s)) & 3) << 4;
                    hs += v * x[value_at(128 * h + 32 * s + i)];
                    ls += v * xl[value_at(128 * h + 32 * s + i)];
                }
                sumi += (int64_t)sc[16 * g + r] * (128 * hs + ls + offsets[KQ_CHUNK * (16 * b + g) + u]);
            }
            float d = h2f_at(q + Q6K_D + 2 * r);
            acc += dl * d * (float)sumi;
        }
    }
    return acc;
}

/* ---------------------------------------------------------------- AVX-512 VNNI: a row group x C tokens */

#if KS_X86
#define PIECE (4 * KQ_CHUNK)       /* bytes from a piece of a chunk's activations to the next */
/* Software prefetches into L2 (into L1 they measured slower) of the group's blocks b + 2 and b + 4 while
   computing block b: with the hardware's, one thread streams 20+ GB/s of weights (about 13 without). */
#define AHEAD_NEAR 2
#define AHEAD_FAR 4
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T1)

/* Broadcast 4 activations (one token's 32-bit piece) to every lane. */
#define KQ_BCAST(p) _mm512_set1_epi32(*(const int32_t *)(p))

/* The 8 scales and 8 mins of each of 16 rows of a Q4_K block, as bytes sc [8][16] and m [8][16]: the
   12 packed bytes [12][16] unpacked 64 at a time (q4k_scale_min's arithmetic). */
TARGET_VNNI static inline void q4k_unpack_scales(const uint8_t *packed, uint8_t *sc, uint8_t *m) {
    const __m512i six = _mm512_set1_epi8(0x3F), four = _mm512_set1_epi8(0x0F), two_high = _mm512_set1_epi8(0x30);
    __m512i z0 = _mm512_loadu_si512(packed), z1 = _mm512_loadu_si512(packed + 64), z2 = _mm512_loadu_si512(packed + 128);
    _mm512_store_si512(sc, _mm512_and_si512(z0, six));
    _mm512_store_si512(m, _mm512_and_si512(z1, six));
    /* (a & 0x0F) | (b & 0x30): ternary logic 0xEA on (b, 0x30, a & 0x0F) */
    _mm512_store_si512(sc + 64, _mm512_ternarylogic_epi32(_mm512_srli_epi16(z0, 2), two_high, _mm512_and_si512(z2, four), 0xEA));
    _mm512_store_si512(m + 64, _mm512_ternarylogic_epi32(_mm512_srli_epi16(z1, 2), two_high,
                                                         _mm512_and_si512(_mm512_srli_epi16(z2, 4), four), 0xEA));
}

/* Sub-blocks 2c and 2c + 1 of a Q4_K block (the low and the high nibbles of pieces 8c..8c+7) for C
   tokens: each piece masked to each nibble (0x0F; 0xF0 keeps the high nibble in place, 16 times its
   value: its scale carries 1/16), vpdpbusd with the tokens' pieces of both levels into int32 sums per
   row (4 independent sums a token), joined as 128 * hi + lo, times d * sc_j in float, less dmin * m_j
   times the token's value sum of the sub-block.  `ahead` (the first chunk's pass over the group): blocks
   b + 2 and b + 4 are prefetched (36 lines a block, 9 a call). */
TARGET_VNNI static inline __attribute__((always_inline)) void q4k_sub_blocks(
    const int C, int c, const uint8_t *blk, const uint8_t *sc, const uint8_t *mn, __m512 d, __m512 dmin,
    const int8_t *hi_at, const int8_t *lo_at, const float *sums_at, int ahead, __m512 *part) {
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);
    __m512i acc[KQ_CHUNK][4];       /* [token][2 * nibble + level] */
    for (int t = 0; t < C; t++)
        for (int i = 0; i < 4; i++) acc[t][i] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int q = 0; q < 8; q++) {
        const __m512i v = _mm512_load_si512(blk + 64 * (8 * c + q));
        const __m512i wl = _mm512_and_si512(v, low), wh = _mm512_and_si512(v, high);
        if (ahead) {
            PREFETCH(blk + AHEAD_NEAR * Q4K_GROUP_BLOCK + 64 * (9 * c + q));
            PREFETCH(blk + AHEAD_FAR * Q4K_GROUP_BLOCK + 64 * (9 * c + q));
        }
        if (ahead && q == 7) {
            PREFETCH(blk + AHEAD_NEAR * Q4K_GROUP_BLOCK + 64 * (9 * c + 8));
            PREFETCH(blk + AHEAD_FAR * Q4K_GROUP_BLOCK + 64 * (9 * c + 8));
        }
        for (int t = 0; t < C; t++) {
            const int at = PIECE * q + 4 * t;
            acc[t][0] = _mm512_dpbusd_epi32(acc[t][0], wl, KQ_BCAST(hi_at + at));
            acc[t][1] = _mm512_dpbusd_epi32(acc[t][1], wl, KQ_BCAST(lo_at + at));
            acc[t][2] = _mm512_dpbusd_epi32(acc[t][2], wh, KQ_BCAST(hi_at + 8 * PIECE + at));
            acc[t][3] = _mm512_dpbusd_epi32(acc[t][3], wh, KQ_BCAST(lo_at + 8 * PIECE + at));
        }
    }
    for (int n = 0; n < 2; n++) {
        const int j = 2 * c + n;
        const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(sc + 16 * j)))),
                                       n ? _mm512_mul_ps(d, _mm512_set1_ps(0.0625f)) : d);
        const __m512 mv = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(mn + 16 * j)))),
                                        dmin);
        for (int t = 0; t < C; t++) {
            const __m512i joined = _mm512_add_epi32(_mm512_slli_epi32(acc[t][2 * n], 7), acc[t][2 * n + 1]);
            part[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(joined), s, part[t]);
            part[t] = _mm512_fnmadd_ps(mv, _mm512_set1_ps(sums_at[KQ_CHUNK * n + t]), part[t]);
        }
    }
}

/* C tokens' results for a group: out + t * out_stride, `rows` of the 16 (the rest are past N). */
TARGET_VNNI static inline __attribute__((always_inline)) void kq_store(const int C, const __m512 *total, float *out,
                                                                      ptrdiff_t out_stride, int rows) {
    for (int t = 0; t < C; t++)
        _mm512_mask_storeu_ps(out + out_stride * t, (__mmask16)((1u << rows) - 1), total[t]);
}

/* out[t, lane] for the group at `grp` and the C tokens of chunk `chunk`: each block's sum of its
   sub-blocks times the token's d / 128. */
TARGET_VNNI static inline __attribute__((always_inline)) void q4k_tile(
    const int C, const uint8_t *grp, int nb, const kq_acts_t *acts, int chunk, float *out, ptrdiff_t out_stride, int rows) {
    __m512 total[KQ_CHUNK];
    for (int t = 0; t < C; t++) total[t] = _mm512_setzero_ps();
    _Alignas(64) uint8_t sc[128], mn[128];
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (size_t)Q4K_GROUP_BLOCK * b;
        const __m512 d = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(blk + Q4K_D)));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(blk + Q4K_DMIN)));
        q4k_unpack_scales(blk + Q4K_SCALES, sc, mn);
        __m512 part[KQ_CHUNK];
        for (int t = 0; t < C; t++) part[t] = _mm512_setzero_ps();
        const int8_t *hi = kq_hi(acts, chunk) + 64 * PIECE * b, *lo = kq_lo(acts, chunk) + 64 * PIECE * b;
        const float *sums = (const float *)kq_sums(acts, chunk) + 8 * KQ_CHUNK * b;
#pragma GCC unroll 1
        for (int c = 0; c < 4; c++)
            q4k_sub_blocks(C, c, blk, sc, mn, d, dmin, hi + 16 * PIECE * c, lo + 16 * PIECE * c, sums + 2 * KQ_CHUNK * c,
                           chunk == 0, part);
        for (int t = 0; t < C; t++)
            total[t] = _mm512_fmadd_ps(part[t], _mm512_set1_ps(kq_dl(acts, chunk)[KQ_CHUNK * b + t]), total[t]);
    }
    kq_store(C, total, out, out_stride, rows);
}

/* Groups g = 8h + 2s + half for s = s2 and s2 + 2 of a Q6_K block (values 128h + 32s + 16 half ..+15)
   for C tokens: their pieces' 6-bit values from the low (s < 2) and the high nibble of the same ql
   pieces (h, s2) and bits 2s, 2s + 1 of the same qh pieces; both levels' int32 sums (4 independent sums
   a token), the lo ones started at the token's -32 * (the group's value sum) (q - 32 is the weight),
   joined, times d * sc_g in float.  `ahead_`: blocks b + 2 and b + 4 are prefetched (53 lines a block, 8 a
   call). */
TARGET_VNNI static inline __attribute__((always_inline)) void q6k_groups(
    const int C, const int s2, int h, int half, const uint8_t *blk, __m512 d, const int8_t *hi_at, const int8_t *lo_at,
    const int32_t *offsets_at, int ahead_, __m512 *part) {
    const __m512i low = _mm512_set1_epi8(0x0F), two_high = _mm512_set1_epi8(0x30);
    const int g0 = 8 * h + 2 * s2 + half;       /* and g0 + 4 */
    __m512i acc[KQ_CHUNK][4];                   /* [token][2 * group + level] */
    for (int t = 0; t < C; t++) {
        acc[t][0] = acc[t][2] = _mm512_setzero_si512();
        acc[t][1] = _mm512_set1_epi32(offsets_at[t]), acc[t][3] = _mm512_set1_epi32(offsets_at[4 * KQ_CHUNK + t]);
    }
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) {
        const __m512i l = _mm512_load_si512(blk + 64 * (16 * h + 8 * s2 + 4 * half + q));
        const __m512i hb = _mm512_load_si512(blk + Q6K_HIGH + 64 * (8 * h + 4 * half + q));
        /* bits 2s, 2s + 1 of hb to bits 4, 5: (top & 0x30) | nibble */
        const __m512i w0 = _mm512_ternarylogic_epi32(s2 ? _mm512_slli_epi16(hb, 2) : _mm512_slli_epi16(hb, 4), two_high,
                                                     _mm512_and_si512(l, low), 0xEA);
        const __m512i w1 = _mm512_ternarylogic_epi32(s2 ? _mm512_srli_epi16(hb, 2) : hb, two_high,
                                                     _mm512_and_si512(_mm512_srli_epi16(l, 4), low), 0xEA);
        if (ahead_) {
            const uint8_t *lines = blk + 64 * (32 * h + 16 * half + 8 * s2 + 2 * q);
            PREFETCH(lines + AHEAD_NEAR * Q6K_GROUP_BLOCK);
            PREFETCH(lines + AHEAD_NEAR * Q6K_GROUP_BLOCK + 64);
            PREFETCH(lines + AHEAD_FAR * Q6K_GROUP_BLOCK);
            PREFETCH(lines + AHEAD_FAR * Q6K_GROUP_BLOCK + 64);
        }
        for (int t = 0; t < C; t++) {
            const int at = PIECE * q + 4 * t;
            acc[t][0] = _mm512_dpbusd_epi32(acc[t][0], w0, KQ_BCAST(hi_at + at));
            acc[t][1] = _mm512_dpbusd_epi32(acc[t][1], w0, KQ_BCAST(lo_at + at));
            acc[t][2] = _mm512_dpbusd_epi32(acc[t][2], w1, KQ_BCAST(hi_at + 16 * PIECE + at));
            acc[t][3] = _mm512_dpbusd_epi32(acc[t][3], w1, KQ_BCAST(lo_at + 16 * PIECE + at));
        }
    }
    for (int n = 0; n < 2; n++) {
        const __m512 sv = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                            _mm_load_si128((const __m128i *)(blk + Q6K_SCALES + 16 * (g0 + 4 * n))))), d);
        for (int t = 0; t < C; t++) {
            const __m512i joined = _mm512_add_epi32(_mm512_slli_epi32(acc[t][2 * n], 7), acc[t][2 * n + 1]);
            part[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(joined), sv, part[t]);
        }
    }
}

TARGET_VNNI static inline __attribute__((always_inline)) void q6k_tile(
    const int C, const uint8_t *grp, int nb, const kq_acts_t *acts, int chunk, float *out, ptrdiff_t out_stride, int rows) {
    __m512 total[KQ_CHUNK];
    for (int t = 0; t < C; t++) total[t] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (size_t)Q6K_GROUP_BLOCK * b;
        const __m512 d = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(blk + Q6K_D)));
        __m512 part[KQ_CHUNK];
        for (int t = 0; t < C; t++) part[t] = _mm512_setzero_ps();
        const int8_t *hi = kq_hi(acts, chunk) + 64 * PIECE * b, *lo = kq_lo(acts, chunk) + 64 * PIECE * b;
        const int32_t *offsets = (const int32_t *)kq_sums(acts, chunk) + 16 * KQ_CHUNK * b;
#pragma GCC unroll 1
        for (int u = 0; u < 8; u++) {       /* (h, half, s2): groups s2 and s2 + 2 share their pieces */
            const int h = u >> 2, half = (u >> 1) & 1, g = 8 * h + 2 * (u & 1) + half;
            if (u & 1)
                q6k_groups(C, 1, h, half, blk, d, hi + 4 * PIECE * g, lo + 4 * PIECE * g, offsets + KQ_CHUNK * g, chunk == 0, part);
            else
                q6k_groups(C, 0, h, half, blk, d, hi + 4 * PIECE * g, lo + 4 * PIECE * g, offsets + KQ_CHUNK * g, chunk == 0, part);
        }
        for (int t = 0; t < C; t++)
            total[t] = _mm512_fmadd_ps(part[t], _mm512_set1_ps(kq_dl(acts, chunk)[KQ_CHUNK * b + t]), total[t]);
    }
    kq_store(C, total, out, out_stride, rows);
}

#define KQ_TILE_ARGS const uint8_t *grp, int nb, const kq_acts_t *acts, int chunk, float *out, ptrdiff_t out_stride, int rows
typedef void (*kq_tile_fn)(KQ_TILE_ARGS);
#define KQ_TILE(fmt, C) \
    TARGET_VNNI static void fmt##_tile_##C(KQ_TILE_ARGS) { fmt##_tile(C, grp, nb, acts, chunk, out, out_stride, rows); }
KQ_TILE(q4k, 1) KQ_TILE(q4k, 2) KQ_TILE(q4k, 3) KQ_TILE(q4k, 4)
KQ_TILE(q6k, 1) KQ_TILE(q6k, 2) KQ_TILE(q6k, 3) KQ_TILE(q6k, 4)

/* [Q4_K, Q6_K][tokens of the chunk - 1] */
static const kq_tile_fn KQ_TILES[2][KQ_CHUNK] = {{q4k_tile_1, q4k_tile_2, q4k_tile_3, q4k_tile_4},
                                                 {q6k_tile_1, q6k_tile_2, q6k_tile_3, q6k_tile_4}};

/* ---------------------------------------------------------------- AMX: a row group x up to 16 tokens (Q4_K) */

/* With the activations in two levels, vpdpbusd bounds a Q4_K matmul of a few tokens (4 of them a 64-byte
   load, 16 rows by 4 values each): past 4 tokens its time grows with the tokens.  On tiles a sub-block
   pair of the group is one tdpbsud per sub-block and level: A the M tokens' 32 activations of the sub-block
   (one level, signed, read in place from quantize_act's rows; the pair's second sub-block loaded into the
   same A tiles once the first's products have read them), B the sub-block's 8 quads of the 16 rows (the
   group's pieces masked to the low nibble, or the high nibble in place: 16 times its value, as the VNNI
   kernel's), C [M][16] int32: the VNNI kernel's sums exactly.  They are stored and scaled in float by the
   VNNI kernel's steps in its order, a token's 16 rows a vector (the same bits).  A step's weights are
   unpacked a step before its products, and its sums scaled two steps after: no load waits on a store just
   made.  sums [K/32][16] and dl [K/256][16]: the tokens' value sums and d / 128 (kq_amx_acts).  `ahead`:
   prefetch as q4k_sub_blocks does. */
#define KQ_AMX_LAG 2

/* Step `step` (sub-blocks 2c and 2c + 1 of block b) of a Q4_K row group on tiles: its 16 rows' nibbles into w
   [sub-block][quad][16 rows x 4] (the low nibble masked, the high one in place: 16 times its value, as the VNNI
   kernel's), and at a block's first step its d, dmin, scales and mins into slot b & 1; `ahead`: prefetch as
   q4k_sub_blocks does. */
TARGET_AMX static inline __attribute__((always_inline)) void kq_amx_unpack(
    const uint8_t *grp, int step, uint8_t (*w)[8][64], __m512 *d, __m512 *dmin, uint8_t (*sc)[128], uint8_t (*mn)[128],
    int ahead) {
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);
    const int b = step / 4, c = step % 4;
    const uint8_t *blk = grp + (size_t)Q4K_GROUP_BLOCK * b;
    if (c == 0) {
        d[b & 1] = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(blk + Q4K_D)));
        dmin[b & 1] = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(blk + Q4K_DMIN)));
        q4k_unpack_scales(blk + Q4K_SCALES, sc[b & 1], mn[b & 1]);
    }
    for (int q = 0; q < 8; q++) {
        const __m512i v = _mm512_load_si512(blk + 64 * (8 * c + q));
        _mm512_store_si512(w[0][q], _mm512_and_si512(v, low));
        _mm512_store_si512(w[1][q], _mm512_and_si512(v, high));
        if (ahead) {
            PREFETCH(blk + AHEAD_NEAR * Q4K_GROUP_BLOCK + 64 * (9 * c + q));
            PREFETCH(blk + AHEAD_FAR * Q4K_GROUP_BLOCK + 64 * (9 * c + q));
        }
    }
    if (ahead) {
        PREFETCH(blk + AHEAD_NEAR * Q4K_GROUP_BLOCK + 64 * (9 * c + 8));
        PREFETCH(blk + AHEAD_FAR * Q4K_GROUP_BLOCK + 64 * (9 * c + 8));
    }
}

/* Sub-block j of block b into part[t] for the M tokens: hi[t] and lo[t] its int32 sums of each level (a row a
   lane), joined as 128 * hi + lo and scaled by q4k_sub_blocks' float steps in its order (the same bits). */
TARGET_AMX static inline __attribute__((always_inline)) void kq_amx_scale(
    const int M, int b, int j, const int32_t (*hi)[16], const int32_t (*lo)[16], uint8_t (*sc)[128],
    uint8_t (*mn)[128], const __m512 *d, const __m512 *dmin, const float *asums, __m512 *part) {
    const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(sc[b & 1] + 16 * j)))),
                                   (j & 1) ? _mm512_mul_ps(d[b & 1], _mm512_set1_ps(0.0625f)) : d[b & 1]);
    const __m512 mv = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(mn[b & 1] + 16 * j)))),
                                    dmin[b & 1]);
    const float *token_sums = asums + 16 * (8 * b + j);
#pragma GCC unroll 16
    for (int t = 0; t < M; t++) {
        const __m512i joined = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(hi[t]), 7), _mm512_load_si512(lo[t]));
        part[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(joined), s, part[t]);
        part[t] = _mm512_fnmadd_ps(mv, _mm512_set1_ps(token_sums[t]), part[t]);
    }
}
TARGET_AMX static inline __attribute__((always_inline)) void kq_amx_group(
    const int M, const uint8_t *grp, int nb, const int8_t *hi, ptrdiff_t stride, ptrdiff_t lo_offset, const float *asums,
    const float *adl, int ahead, float *out, ptrdiff_t out_stride, int rows) {
    _Alignas(64) uint8_t wq[2][2][8][64];    /* [step & 1][nibble: sub-block 2c, 2c + 1][quad][16 rows x 4] */
    _Alignas(64) int32_t sums[KQ_AMX_LAG + 1][4][16][16];   /* [step % 3][H0, L0, H1, L1][token][row] */
    _Alignas(64) uint8_t sc[2][128], mn[2][128];            /* [block & 1] */
    __m512 d[2], dmin[2], part[16], total[16];
    for (int t = 0; t < M; t++) part[t] = total[t] = _mm512_setzero_ps();
    const int steps = 4 * nb;
    for (int i = -1; i < steps + KQ_AMX_LAG; i++) {
        if (i + 1 < steps)          /* step i + 1's weights, unpacked */
            kq_amx_unpack(grp, i + 1, wq[(i + 1) & 1], d, dmin, sc, mn, ahead);
        if (i >= 0 && i < steps) {  /* step i's products */
            const int8_t *a = hi + 256 * (size_t)(i / 4) + 64 * (i % 4);
            int32_t (*out_sums)[16][16] = sums[i % (KQ_AMX_LAG + 1)];
            _tile_loadd(KQ_B_0, wq[i & 1][0], 64);
            _tile_loadd(KQ_B_1, wq[i & 1][1], 64);
            _tile_zero(KQ_C_H0);
            _tile_zero(KQ_C_L0);
            _tile_zero(KQ_C_H1);
            _tile_zero(KQ_C_L1);
            _tile_loadd(KQ_A_HI, a, stride);
            _tile_loadd(KQ_A_LO, a + lo_offset, stride);
            _tile_dpbsud(KQ_C_H0, KQ_A_HI, KQ_B_0);
            _tile_dpbsud(KQ_C_L0, KQ_A_LO, KQ_B_0);
            _tile_loadd(KQ_A_HI, a + 32, stride);
            _tile_loadd(KQ_A_LO, a + 32 + lo_offset, stride);
            _tile_dpbsud(KQ_C_H1, KQ_A_HI, KQ_B_1);
            _tile_dpbsud(KQ_C_L1, KQ_A_LO, KQ_B_1);
            _tile_stored(KQ_C_H0, out_sums[0], 64);
            _tile_stored(KQ_C_L0, out_sums[1], 64);
            _tile_stored(KQ_C_H1, out_sums[2], 64);
            _tile_stored(KQ_C_L1, out_sums[3], 64);
        }
        const int p = i - KQ_AMX_LAG;
        if (p >= 0) {               /* step p's sums: q4k_sub_blocks' float steps, then q4k_tile's at a block's end */
            const int b = p / 4, c = p % 4;
            int32_t (*in_sums)[16][16] = sums[p % (KQ_AMX_LAG + 1)];
            for (int n = 0; n < 2; n++)
                kq_amx_scale(M, b, 2 * c + n, in_sums[2 * n], in_sums[2 * n + 1], sc, mn, d, dmin, asums, part);
            if (c == 3)
#pragma GCC unroll 16
                for (int t = 0; t < M; t++) {
                    total[t] = _mm512_fmadd_ps(part[t], _mm512_set1_ps(adl[16 * b + t]), total[t]);
                    part[t] = _mm512_setzero_ps();
                }
        }
    }
    for (int t = 0; t < M; t++) _mm512_mask_storeu_ps(out + out_stride * t, (__mmask16)((1u << rows) - 1), total[t]);
}

/* kq_amx_group for each M (1..16), its per-token loops unrolled and `part` in registers */
#define KQ_AMX_ARGS const uint8_t *grp, int nb, const int8_t *hi, ptrdiff_t stride, ptrdiff_t lo_offset, const float *asums, \
    const float *adl, int ahead, float *out, ptrdiff_t out_stride, int rows
typedef void (*kq_amx_fn)(KQ_AMX_ARGS);
#define KQ_AMX(M) TARGET_AMX static void kq_amx_group_##M(KQ_AMX_ARGS) { \
    kq_amx_group(M, grp, nb, hi, stride, lo_offset, asums, adl, ahead, out, out_stride, rows); }
KQ_AMX(1) KQ_AMX(2) KQ_AMX(3) KQ_AMX(4) KQ_AMX(5) KQ_AMX(6) KQ_AMX(7) KQ_AMX(8)
KQ_AMX(9) KQ_AMX(10) KQ_AMX(11) KQ_AMX(12) KQ_AMX(13) KQ_AMX(14) KQ_AMX(15) KQ_AMX(16)
static const kq_amx_fn KQ_AMX_GROUPS[16] = {kq_amx_group_1, kq_amx_group_2, kq_amx_group_3, kq_amx_group_4, kq_amx_group_5,
    kq_amx_group_6, kq_amx_group_7, kq_amx_group_8, kq_amx_group_9, kq_amx_group_10, kq_amx_group_11, kq_amx_group_12,
    kq_amx_group_13, kq_amx_group_14, kq_amx_group_15, kq_amx_group_16};

/* kq_amx_group for M <= 8 tokens on the stacked levels (kq_acts_t.stacked, [2M][K]): a sub-block's products
   for both levels of every token are one tdpbsud (A [2M][32]: C rows 0..M-1 the hi sums, M..2M-1 the lo
   sums), half kq_amx_group's products and stores, and with the tiles that frees a step's C tiles alternate
   between two pairs: a step's products are issued before the step before has its sums stored, so neither
   waits on the other.  The sums are the same int32 values, scaled by the same float steps in the same order
   (the same bits). */
TARGET_AMX static inline __attribute__((always_inline)) void kq_amx_stacked(
    const int M, const uint8_t *grp, int nb, const int8_t *stacked, int K, const float *asums, const float *adl,
    int ahead, float *out, ptrdiff_t out_stride, int rows) {
    _Alignas(64) uint8_t wq[2][2][8][64];    /* [step & 1][nibble: sub-block 2c, 2c + 1][quad][16 rows x 4] */
    _Alignas(64) int32_t sums[KQ_AMX_LAG + 1][2][16][16];   /* [step % 3][sub-block 2c, 2c + 1][hi t, lo M + t][row] */
    _Alignas(64) uint8_t sc[2][128], mn[2][128];            /* [block & 1] */
    __m512 d[2], dmin[2], part[8], total[8];
    for (int t = 0; t < M; t++) part[t] = total[t] = _mm512_setzero_ps();
    const int steps = 4 * nb;
    for (int i = -1; i < steps + KQ_AMX_LAG; i++) {
        if (i + 1 < steps)          /* step i + 1's weights, unpacked */
            kq_amx_unpack(grp, i + 1, wq[(i + 1) & 1], d, dmin, sc, mn, ahead);
        if (i >= 0 && i < steps) {  /* step i's products, into its pair of C tiles */
            const int8_t *a = stacked + 256 * (size_t)(i / 4) + 64 * (i % 4);
            _tile_loadd(KQS_B_0, wq[i & 1][0], 64);
            _tile_loadd(KQS_B_1, wq[i & 1][1], 64);
            _tile_loadd(KQS_A_0, a, K);
            _tile_loadd(KQS_A_1, a + 32, K);
            if (i & 1) {
                _tile_zero(KQS_C_2);
                _tile_zero(KQS_C_3);
                _tile_dpbsud(KQS_C_2, KQS_A_0, KQS_B_0);
                _tile_dpbsud(KQS_C_3, KQS_A_1, KQS_B_1);
            } else {
                _tile_zero(KQS_C_0);
                _tile_zero(KQS_C_1);
                _tile_dpbsud(KQS_C_0, KQS_A_0, KQS_B_0);
                _tile_dpbsud(KQS_C_1, KQS_A_1, KQS_B_1);
            }
        }
        if (i >= 1 && i <= steps) { /* step i - 1's sums stored */
            int32_t (*to)[16][16] = sums[(i - 1) % (KQ_AMX_LAG + 1)];
            if ((i - 1) & 1) {
                _tile_stored(KQS_C_2, to[0], 64);
                _tile_stored(KQS_C_3, to[1], 64);
            } else {
                _tile_stored(KQS_C_0, to[0], 64);
                _tile_stored(KQS_C_1, to[1], 64);
            }
        }
        const int p = i - KQ_AMX_LAG;
        if (p >= 0) {               /* step p's sums: kq_amx_group's float steps */
            const int b = p / 4, c = p % 4;
            int32_t (*in_sums)[16][16] = sums[p % (KQ_AMX_LAG + 1)];
            for (int n = 0; n < 2; n++)
                kq_amx_scale(M, b, 2 * c + n, in_sums[n], in_sums[n] + M, sc, mn, d, dmin, asums, part);
            if (c == 3)
#pragma GCC unroll 8
                for (int t = 0; t < M; t++) {
                    total[t] = _mm512_fmadd_ps(part[t], _mm512_set1_ps(adl[16 * b + t]), total[t]);
                    part[t] = _mm512_setzero_ps();
                }
        }
    }
    for (int t = 0; t < M; t++) _mm512_mask_storeu_ps(out + out_stride * t, (__mmask16)((1u << rows) - 1), total[t]);
}

#define KQ_STACKED_ARGS const uint8_t *grp, int nb, const int8_t *stacked, int K, const float *asums, const float *adl, \
    int ahead, float *out, ptrdiff_t out_stride, int rows
typedef void (*kq_stacked_fn)(KQ_STACKED_ARGS);
#define KQ_STACKED_M(M) TARGET_AMX static void kq_amx_stacked_##M(KQ_STACKED_ARGS) { \
    kq_amx_stacked(M, grp, nb, stacked, K, asums, adl, ahead, out, out_stride, rows); }
KQ_STACKED_M(1) KQ_STACKED_M(2) KQ_STACKED_M(3) KQ_STACKED_M(4) KQ_STACKED_M(5) KQ_STACKED_M(6) KQ_STACKED_M(7)
KQ_STACKED_M(8)
static const kq_stacked_fn KQ_AMX_STACKED[KQ_STACKED_MAX] = {kq_amx_stacked_1, kq_amx_stacked_2, kq_amx_stacked_3,
    kq_amx_stacked_4, kq_amx_stacked_5, kq_amx_stacked_6, kq_amx_stacked_7, kq_amx_stacked_8};

/* Tokens t0..t0+M-1's value sums per 32 [K/32][16] and d / 128 per block [K/256][16], a row of 16 each, out
   of the chunks (this thread's buffer, grown as needed; NULL if it cannot be). */
static float *kq_amx_acts(const kq_acts_t *acts, int t0, int M) {
    static __thread float *own;
    static __thread size_t own_floats;
    const int K = acts->K;
    const size_t floats = (size_t)16 * (K / 32 + K / 256);
    if (floats > own_floats) {
        free(own);
        own = aligned_alloc(64, (floats * 4 + 63) / 64 * 64);
        own_floats = own ? floats : 0;
        if (!own) return NULL;
    }
    for (int t = 0; t < M; t++) {
        const int u = t0 + t, chunk = u / KQ_CHUNK, lane = u % KQ_CHUNK;
        const float *sums = kq_sums(acts, chunk), *dl = kq_dl(acts, chunk);
        for (int j = 0; j < K / 32; j++) own[16 * j + t] = sums[KQ_CHUNK * j + lane];
        for (int b = 0; b < K / 256; b++) own[16 * (K / 32) + 16 * b + t] = dl[KQ_CHUNK * b + lane];
    }
    return own;
}

/* ---------------------------------------------------------------- AVX-VNNI: a half group (8 rows) x C tokens */
/* The kernels above at 256 bits, for the CPUs with the VEX vpdpbusd and no AVX-512: each 64-byte piece is two
   halves of 8 rows (bytes 32 * half ..), each half of a group runs its own pass over the group's blocks (the
   second reads them from cache), with the same integer sums and float steps per row (the same bits as the
   AVX-512 kernels: each row's lane sees the same operations in the same order).  16 ymm registers hold 4
   tokens' 4 sums at most, so the passes keep up to 2 tokens each. */

#define KQ_BCAST8(p) _mm256_set1_epi32(*(const int32_t *)(p))

/* The 8 scales and 8 mins of each of 16 rows of a Q4_K block, as q4k_unpack_scales' bytes (no ternary logic). */
TARGET_AVXVNNI static inline void q4k_unpack_scales8(const uint8_t *packed, uint8_t *sc, uint8_t *m) {
    const __m256i six = _mm256_set1_epi8(0x3F), four = _mm256_set1_epi8(0x0F), two_high = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        const __m256i z0 = _mm256_loadu_si256((const __m256i *)(packed + 32 * h));
        const __m256i z1 = _mm256_loadu_si256((const __m256i *)(packed + 64 + 32 * h));
        const __m256i z2 = _mm256_loadu_si256((const __m256i *)(packed + 128 + 32 * h));
        _mm256_store_si256((__m256i *)(sc + 32 * h), _mm256_and_si256(z0, six));
        _mm256_store_si256((__m256i *)(m + 32 * h), _mm256_and_si256(z1, six));
        _mm256_store_si256((__m256i *)(sc + 64 + 32 * h), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(z0, 2), two_high),
                                                                           _mm256_and_si256(z2, four)));
        _mm256_store_si256((__m256i *)(m + 64 + 32 * h), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(z1, 2), two_high),
                                                                          _mm256_and_si256(_mm256_srli_epi16(z2, 4), four)));
    }
}

/* q4k_sub_blocks for the 8 rows of `half` and C tokens. */
TARGET_AVXVNNI static inline __attribute__((always_inline)) void q4k_sub_blocks8(
    const int C, int c, int half, const uint8_t *blk, const uint8_t *sc, const uint8_t *mn, __m256 d, __m256 dmin,
    const int8_t *hi_at, const int8_t *lo_at, const float *sums_at, int ahead, __m256 *part) {
    const __m256i low = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8((char)0xF0);
    __m256i acc[KQ_CHUNK][4];
    for (int t = 0; t < C; t++)
        for (int i = 0; i < 4; i++) acc[t][i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int q = 0; q < 8; q++) {
        const __m256i v = _mm256_load_si256((const __m256i *)(blk + 64 * (8 * c + q) + 32 * half));
        const __m256i wl = _mm256_and_si256(v, low), wh = _mm256_and_si256(v, high);
        if (ahead) {
            PREFETCH(blk + AHEAD_NEAR * Q4K_GROUP_BLOCK + 64 * (9 * c + q));
            PREFETCH(blk + AHEAD_FAR * Q4K_GROUP_BLOCK + 64 * (9 * c + q));
        }
        if (ahead && q == 7) {
            PREFETCH(blk + AHEAD_NEAR * Q4K_GROUP_BLOCK + 64 * (9 * c + 8));
            PREFETCH(blk + AHEAD_FAR * Q4K_GROUP_BLOCK + 64 * (9 * c + 8));
        }
        for (int t = 0; t < C; t++) {
            const int at = PIECE * q + 4 * t;
            acc[t][0] = _mm256_dpbusd_avx_epi32(acc[t][0], wl, KQ_BCAST8(hi_at + at));
            acc[t][1] = _mm256_dpbusd_avx_epi32(acc[t][1], wl, KQ_BCAST8(lo_at + at));
            acc[t][2] = _mm256_dpbusd_avx_epi32(acc[t][2], wh, KQ_BCAST8(hi_at + 8 * PIECE + at));
            acc[t][3] = _mm256_dpbusd_avx_epi32(acc[t][3], wh, KQ_BCAST8(lo_at + 8 * PIECE + at));
        }
    }
    for (int n = 0; n < 2; n++) {
        const int j = 2 * c + n;
        const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 16 * j + 8 * half)))),
                                       n ? _mm256_mul_ps(d, _mm256_set1_ps(0.0625f)) : d);
        const __m256 mv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mn + 16 * j + 8 * half)))),
                                        dmin);
        for (int t = 0; t < C; t++) {
            const __m256i joined = _mm256_add_epi32(_mm256_slli_epi32(acc[t][2 * n], 7), acc[t][2 * n + 1]);
            part[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(joined), s, part[t]);
            part[t] = _mm256_fnmadd_ps(mv, _mm256_set1_ps(sums_at[KQ_CHUNK * n + t]), part[t]);
        }
    }
}

TARGET_AVXVNNI static inline __attribute__((always_inline)) void kq_store8(const int C, const __m256 *total, float *out,
                                                                          ptrdiff_t out_stride, int rows) {
    for (int t = 0; t < C; t++) {
        if (rows >= 8) {
            _mm256_storeu_ps(out + out_stride * t, total[t]);
        } else {
            _Alignas(32) float v[8];
            _mm256_store_ps(v, total[t]);
            for (int r = 0; r < rows; r++) out[out_stride * t + r] = v[r];
        }
    }
}

/* Tokens t0..t0+C-1 of chunk `chunk` for the 8 rows of `half`: out + t * out_stride, `rows` of them. */
TARGET_AVXVNNI static inline __attribute__((always_inline)) void q4k_tile8(
    const int C, const uint8_t *grp, int nb, const kq_acts_t *acts, int chunk, int t0, int half, float *out,
    ptrdiff_t out_stride, int rows) {
    __m256 total[KQ_CHUNK];
    for (int t = 0; t < C; t++) total[t] = _mm256_setzero_ps();
    _Alignas(32) uint8_t sc[128], mn[128];
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (size_t)Q4K_GROUP_BLOCK * b;
        const __m256 d = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(blk + Q4K_D + 16 * half)));
        const __m256 dmin = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(blk + Q4K_DMIN + 16 * half)));
        q4k_unpack_scales8(blk + Q4K_SCALES, sc, mn);
        __m256 part[KQ_CHUNK];
        for (int t = 0; t < C; t++) part[t] = _mm256_setzero_ps();
        const int8_t *hi = kq_hi(acts, chunk) + 64 * PIECE * b + 4 * t0, *lo = kq_lo(acts, chunk) + 64 * PIECE * b + 4 * t0;
        const float *sums = (const float *)kq_sums(acts, chunk) + 8 * KQ_CHUNK * b + t0;
#pragma GCC unroll 1
        for (int c = 0; c < 4; c++)
            q4k_sub_blocks8(C, c, half, blk, sc, mn, d, dmin, hi + 16 * PIECE * c, lo + 16 * PIECE * c, sums + 2 * KQ_CHUNK * c,
                            chunk == 0 && t0 == 0 && half == 0, part);
        for (int t = 0; t < C; t++)
            total[t] = _mm256_fmadd_ps(part[t], _mm256_set1_ps(kq_dl(acts, chunk)[KQ_CHUNK * b + t0 + t]), total[t]);
    }
    kq_store8(C, total, out, out_stride, rows);
}

/* q6k_groups for the 8 rows of `half` and C tokens. */
TARGET_AVXVNNI static inline __attribute__((always_inline)) void q6k_groups8(
    const int C, const int s2, int h, int half_g, int half, const uint8_t *blk, __m256 d, const int8_t *hi_at,
    const int8_t *lo_at, const int32_t *offsets_at, int ahead_, __m256 *part) {
    const __m256i low = _mm256_set1_epi8(0x0F), two_high = _mm256_set1_epi8(0x30);
    const int g0 = 8 * h + 2 * s2 + half_g;
    __m256i acc[KQ_CHUNK][4];
    for (int t = 0; t < C; t++) {
        acc[t][0] = acc[t][2] = _mm256_setzero_si256();
        acc[t][1] = _mm256_set1_epi32(offsets_at[t]), acc[t][3] = _mm256_set1_epi32(offsets_at[4 * KQ_CHUNK + t]);
    }
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) {
        const __m256i l = _mm256_load_si256((const __m256i *)(blk + 64 * (16 * h + 8 * s2 + 4 * half_g + q) + 32 * half));
        const __m256i hb = _mm256_load_si256((const __m256i *)(blk + Q6K_HIGH + 64 * (8 * h + 4 * half_g + q) + 32 * half));
        const __m256i w0 = _mm256_or_si256(_mm256_and_si256(s2 ? _mm256_slli_epi16(hb, 2) : _mm256_slli_epi16(hb, 4), two_high),
                                           _mm256_and_si256(l, low));
        const __m256i w1 = _mm256_or_si256(_mm256_and_si256(s2 ? _mm256_srli_epi16(hb, 2) : hb, two_high),
                                           _mm256_and_si256(_mm256_srli_epi16(l, 4), low));
        if (ahead_) {
            const uint8_t *lines = blk + 64 * (32 * h + 16 * half_g + 8 * s2 + 2 * q);
            PREFETCH(lines + AHEAD_NEAR * Q6K_GROUP_BLOCK);
            PREFETCH(lines + AHEAD_NEAR * Q6K_GROUP_BLOCK + 64);
            PREFETCH(lines + AHEAD_FAR * Q6K_GROUP_BLOCK);
            PREFETCH(lines + AHEAD_FAR * Q6K_GROUP_BLOCK + 64);
        }
        for (int t = 0; t < C; t++) {
            const int at = PIECE * q + 4 * t;
            acc[t][0] = _mm256_dpbusd_avx_epi32(acc[t][0], w0, KQ_BCAST8(hi_at + at));
            acc[t][1] = _mm256_dpbusd_avx_epi32(acc[t][1], w0, KQ_BCAST8(lo_at + at));
            acc[t][2] = _mm256_dpbusd_avx_epi32(acc[t][2], w1, KQ_BCAST8(hi_at + 16 * PIECE + at));
            acc[t][3] = _mm256_dpbusd_avx_epi32(acc[t][3], w1, KQ_BCAST8(lo_at + 16 * PIECE + at));
        }
    }
    for (int n = 0; n < 2; n++) {
        const __m256 sv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                            _mm_loadl_epi64((const __m128i *)(blk + Q6K_SCALES + 16 * (g0 + 4 * n) + 8 * half)))), d);
        for (int t = 0; t < C; t++) {
            const __m256i joined = _mm256_add_epi32(_mm256_slli_epi32(acc[t][2 * n], 7), acc[t][2 * n + 1]);
            part[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(joined), sv, part[t]);
        }
    }
}

TARGET_AVXVNNI static inline __attribute__((always_inline)) void q6k_tile8(
    const int C, const uint8_t *grp, int nb, const kq_acts_t *acts, int chunk, int t0, int half, float *out,
    ptrdiff_t out_stride, int rows) {
    __m256 total[KQ_CHUNK];
    for (int t = 0; t < C; t++) total[t] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (size_t)Q6K_GROUP_BLOCK * b;
        const __m256 d = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(blk + Q6K_D + 16 * half)));
        __m256 part[KQ_CHUNK];
        for (int t = 0; t < C; t++) part[t] = _mm256_setzero_ps();
        const int8_t *hi = kq_hi(acts, chunk) + 64 * PIECE * b + 4 * t0, *lo = kq_lo(acts, chunk) + 64 * PIECE * b + 4 * t0;
        const int32_t *offsets = (const int32_t *)kq_sums(acts, chunk) + 16 * KQ_CHUNK * b + t0;
#pragma GCC unroll 1
        for (int u = 0; u < 8; u++) {
            const int h = u >> 2, half_g = (u >> 1) & 1, g = 8 * h + 2 * (u & 1) + half_g;
            const int ahead = chunk == 0 && t0 == 0 && half == 0;
            if (u & 1)
                q6k_groups8(C, 1, h, half_g, half, blk, d, hi + 4 * PIECE * g, lo + 4 * PIECE * g, offsets + KQ_CHUNK * g, ahead, part);
            else
                q6k_groups8(C, 0, h, half_g, half, blk, d, hi + 4 * PIECE * g, lo + 4 * PIECE * g, offsets + KQ_CHUNK * g, ahead, part);
        }
        for (int t = 0; t < C; t++)
            total[t] = _mm256_fmadd_ps(part[t], _mm256_set1_ps(kq_dl(acts, chunk)[KQ_CHUNK * b + t0 + t]), total[t]);
    }
    kq_store8(C, total, out, out_stride, rows);
}

#define KQ_TILE8_ARGS const uint8_t *grp, int nb, const kq_acts_t *acts, int chunk, int t0, int half, float *out, \
    ptrdiff_t out_stride, int rows
typedef void (*kq_tile8_fn)(KQ_TILE8_ARGS);
#define KQ_TILE8(fmt, C) \
    TARGET_AVXVNNI static void fmt##_tile8_##C(KQ_TILE8_ARGS) { fmt##_tile8(C, grp, nb, acts, chunk, t0, half, out, out_stride, rows); }
KQ_TILE8(q4k, 1) KQ_TILE8(q4k, 2) KQ_TILE8(q6k, 1) KQ_TILE8(q6k, 2)

/* [Q4_K, Q6_K][tokens of the pass - 1] */
static const kq_tile8_fn KQ_TILES8[2][2] = {{q4k_tile8_1, q4k_tile8_2}, {q6k_tile8_1, q6k_tile8_2}};
#endif

void kq_rows(int fmt, int isa, const uint8_t *w, ptrdiff_t group_stride, int K, int N, int g0, int g1,
             const kq_acts_t *acts, float *out, ptrdiff_t out_stride) {
    const int nb = K / 256, T = acts->T;
#if KS_X86
    float *sums;
    if (acts->stacked && (sums = kq_amx_acts(acts, 0, T))) {
        /* every token at once on the stacked levels, a group at a time */
        amx_use(AMX_Q4_K_STACKED + T);
        for (int g = g0; g < g1; g++) {
            const int rows = N - KQ_ROWS * g < KQ_ROWS ? N - KQ_ROWS * g : KQ_ROWS;
            KQ_AMX_STACKED[T - 1](w + group_stride * g, nb, acts->stacked, K, sums, sums + 16 * (K / 32), 1,
                                  out + KQ_ROWS * g, out_stride, rows);
        }
        amx_done();
        return;
    }
    if (isa >= ISA_AMX && fmt == FMT_Q4_K_R16 && T >= ks_kq_amx_min_tokens && acts->rows && (sums = kq_amx_acts(acts, 0, 0))) {
        /* 16 tokens at a time on tiles, a group at a time: the groups from memory for the first 16 */
        for (int t0 = 0; t0 < T; t0 += 16) {
            const int M = T - t0 < 16 ? T - t0 : 16;
            sums = kq_amx_acts(acts, t0, M);
            amx_use(AMX_Q4_K + M);
            for (int g = g0; g < g1; g++) {
                const int rows = N - KQ_ROWS * g < KQ_ROWS ? N - KQ_ROWS * g : KQ_ROWS;
                KQ_AMX_GROUPS[M - 1](w + group_stride * g, nb, acts->rows + acts->row_stride * t0, acts->row_stride,
                                     acts->lo_offset, sums, sums + 16 * (K / 32), t0 == 0, out + out_stride * t0 + KQ_ROWS * g,
                                     out_stride, rows);
            }
        }
        amx_done();
        return;
    }
    if (isa >= ISA_AVX512VNNI) {
        /* a group at a time, all its tokens: its blocks come from memory on the first chunk's pass (with
           one group in flight the hardware and the prefetches keep ahead best) and from cache after.  No
           prefetch of the next group between passes: a run of them (a slice of the group's lines a pass)
           stalls on the line fill buffers before the pass starts, and cost more than the next group's
           first blocks from memory (one thread, 5 tokens: 1.9 against 2.9 ms a 12288 x 2048 Q4_K). */
        const kq_tile_fn *tiles = KQ_TILES[fmt == FMT_Q4_K_R16 ? 0 : 1];
        const int chunks = (T + KQ_CHUNK - 1) / KQ_CHUNK;
        for (int g = g0; g < g1; g++) {
            const int rows = N - KQ_ROWS * g < KQ_ROWS ? N - KQ_ROWS * g : KQ_ROWS;
            for (int c = 0; c < chunks; c++) {
                tiles[(T - KQ_CHUNK * c < KQ_CHUNK ? T - KQ_CHUNK * c : KQ_CHUNK) - 1](
                    w + group_stride * g, nb, acts, c, out + out_stride * KQ_CHUNK * c + KQ_ROWS * g, out_stride, rows);
            }
        }
        return;
    }
    if (isa == ISA_AVXVNNI) {
        /* a group at a time, each half of its rows (8) for every token, two tokens a pass */
        const kq_tile8_fn *tiles = KQ_TILES8[fmt == FMT_Q4_K_R16 ? 0 : 1];
        const int chunks = (T + KQ_CHUNK - 1) / KQ_CHUNK;
        for (int g = g0; g < g1; g++) {
            const int rows = N - KQ_ROWS * g < KQ_ROWS ? N - KQ_ROWS * g : KQ_ROWS;
            for (int half = 0; half < 2 && 8 * half < rows; half++)
                for (int c = 0; c < chunks; c++) {
                    const int in_chunk = T - KQ_CHUNK * c < KQ_CHUNK ? T - KQ_CHUNK * c : KQ_CHUNK;
                    for (int t0 = 0; t0 < in_chunk; t0 += 2)
                        tiles[(in_chunk - t0 < 2 ? in_chunk - t0 : 2) - 1](
                            w + group_stride * g, nb, acts, c, t0, half,
                            out + out_stride * (KQ_CHUNK * c + t0) + KQ_ROWS * g + 8 * half, out_stride, rows - 8 * half);
                }
        }
        return;
    }
#endif
    (void)isa;
    for (int g = g0; g < g1; g++) {
        const uint8_t *grp = w + group_stride * g;
        for (int r = 0; r < KQ_ROWS && KQ_ROWS * g + r < N; r++)
            for (int t = 0; t < T; t++) out[out_stride * t + KQ_ROWS * g + r] = kq_row_scalar(fmt, grp, r, nb, acts, t);
    }
}
