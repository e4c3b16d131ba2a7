/* What host_kernels.c calls of host_amx.c: Q8_0 matmuls on AMX tiles (AMX-INT8), the same
   integer sums as the AVX-512 VNNI lanes kernel and the same float steps after them. */
#ifndef KS_HOST_AMX_H
#define KS_HOST_AMX_H
#include <stddef.h>
#include <stdint.h>

/* Whether this CPU has AMX-INT8 and the kernel lets this process use its tile registers (asked once:
   Linux's ARCH_REQ_XCOMP_PERM). */
int amx_usable(void);

/* Q8_0: out[r][l] for 16 weight rows and 16 token lanes.  rows: 16 rows of int8 weights, row r at
   w + r * w_stride (K bytes each); scales [K/32][16] float (the rows' block scales); acts: the token
   group's levels as signed bytes [2][K/4][16][4] (hi, then lo; zero past the call's tokens) and d [K/32][16]
   (d / 128 per block and lane); next: the 16 rows after these (at the same stride) are this thread's next, and
   their first lines are prefetched as these end.  Each block's 128 * hi + lo is exact in int32; out accumulates
   cvt(sum) * (scale * d) with one FMA a block, in block order: the lanes kernel's float steps. */
void amx_q8_0_rows(const int8_t *w, ptrdiff_t w_stride, const float *scales, int K, const uint8_t *acts, const float *d,
                   int next, float out[16][16]);

/* One token: out[r] for the 16 rows, from its levels hi [K] and lo [K] as quantize_act wrote them and its
   block scales d [K/32] (not yet / 128): the numbers of amx_q8_0_rows' lane of that token, the rows in the
   lanes of one vector (one FMA a block for all 16, where the 16-lane kernel spends one a row). */
void amx_q8_0_one(const int8_t *w, ptrdiff_t w_stride, const float *scales, int K, const int8_t *hi, const int8_t *lo,
                  const float *d, int next, float out[16]);

/* Begin / end a thread's run of amx_q8_0_rows (amx_q8_0_one) calls: the tile configuration; its release. */
void amx_q8_0_begin(void);
void amx_q8_0_one_begin(void);
void amx_end(void);

#endif
