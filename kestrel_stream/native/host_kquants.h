/* What host_kernels.c calls of host_kquants.c: Q4_K and Q6_K weights repacked 16 rows together (a row
   group) and their matmul over a range of row groups. */
#ifndef KS_HOST_KQUANTS_H
#define KS_HOST_KQUANTS_H
#include <stddef.h>
#include <stdint.h>

#define KQ_ROWS 16      /* rows of a group: one 512-bit vector holds a 4-byte piece of each */

#define KQ_CHUNK 4      /* tokens side by side in the activations' layout */

/* A call's activations as the repacked kernels read them, in chunks of 4 tokens (the last one's missing
   tokens unwritten, never read):
   chunk c at base + c * chunk_bytes holds its tokens' int8 levels (quantize_act's, q8_K) hi, then lo, in
   4-value pieces side by side ([K/4][4 tokens][4], 4K bytes each), the block scales d / 128 [K/256][4],
   and Q4_K: the joined value sums 128 * hi + lo per 32 values, float [K/32][4]; Q6_K: -32 times them per
   16, int32 [K/16][4]. */
typedef struct {
    uint8_t *base;
    size_t chunk_bytes;
    int K, T;
    /* the same levels as quantize_act wrote them, a token a row (NULL: not given): hi of token t at
       rows + t * row_stride [K], lo lo_offset bytes after it; AMX reads them in place */
    const int8_t *rows;
    ptrdiff_t row_stride, lo_offset;
    /* a call of 8 tokens or fewer on AMX (kq_stacks): both levels' rows stacked [2T][K], hi of token t at row t
       and its lo at row T + t (NULL: none), so one tile holds both levels of every token */
    int8_t *stacked;
} kq_acts_t;

/* Tokens from which repacked Q4_K runs on AMX tiles (ISA amx): below, the VNNI kernel's 4-token chunks. */
extern int ks_kq_amx_min_tokens;

/* Whether a call of T tokens over weights of `fmt` on `isa` runs on the stacked levels (kq_acts_t.stacked). */
int kq_stacks(int fmt, int isa, int T);

/* Bytes of kq_acts_t's chunks for T tokens of K values (and, `stacked`, the stacked levels after them), and
   those laid out in `buf` (64-aligned). */
size_t kq_acts_bytes(int K, int T, int stacked);
kq_acts_t kq_acts_at(uint8_t *buf, int K, int T, int stacked);

static inline int8_t *kq_hi(const kq_acts_t *a, int chunk) { return (int8_t *)(a->base + a->chunk_bytes * chunk); }
static inline int8_t *kq_lo(const kq_acts_t *a, int chunk) { return kq_hi(a, chunk) + 4 * (size_t)a->K; }
static inline float *kq_dl(const kq_acts_t *a, int chunk) { return (float *)(kq_hi(a, chunk) + 8 * (size_t)a->K); }
static inline void *kq_sums(const kq_acts_t *a, int chunk) { return kq_dl(a, chunk) + a->K / 256 * KQ_CHUNK; }

/* Token t's quantized activations (both levels [K], d [K/256], each level's bsums [K/16]) into `acts`. */
void kq_token(int fmt, const int8_t *hi, const int8_t *lo, const float *d, const int16_t *bsums,
              const int16_t *bsums_lo, int t, const kq_acts_t *acts);

/* out[t, r] for the rows of groups g0..g1-1 (rows past N left alone) and every token: w is the
   repacked weight (ks_repack), group g at w + g * group_stride.  fmt: FMT_Q4_K_R16 or FMT_Q6_K_R16. */
void kq_rows(int fmt, int isa, const uint8_t *w, ptrdiff_t group_stride, int K, int N, int g0, int g1,
             const kq_acts_t *acts, float *out, ptrdiff_t out_stride);
#endif
