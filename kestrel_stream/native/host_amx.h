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

/* A thread's tile configuration for the calls that follow (loaded unless it is the one loaded already):
   AMX_Q8_0 for amx_q8_0_rows, AMX_Q8_0_ONE for amx_q8_0_one, AMX_Q4_K + M for host_kquants.c's repacked
   Q4_K at M (1..16) tokens, AMX_Q4_K_STACKED + M for its stacked form at M (1..8); amx_done releases the tiles (at the end of a thread's part of a job). */
enum { AMX_NONE = 0, AMX_Q8_0 = 1, AMX_Q8_0_ONE = 2, AMX_Q4_K = 16, AMX_Q4_K_STACKED = 32 };
void amx_use(int config);
void amx_done(void);

/* The tile registers of AMX_Q4_K's configurations (host_kquants.c's kq_amx_group): C the int32 sums of
   sub-blocks 2c and 2c + 1, each level; A the tokens' 32 activations of one sub-block, one level (the pair's
   first, then its second); B a sub-block's 8 quads of nibbles (numbers, not an enum: the intrinsics paste
   them into the instruction). */
#define KQ_C_H0 0
#define KQ_C_L0 1
#define KQ_C_H1 2
#define KQ_C_L1 3
#define KQ_A_HI 4
#define KQ_A_LO 5
#define KQ_B_0 6
#define KQ_B_1 7

/* AMX_Q4_K_STACKED's (kq_amx_stacked): A both levels of the M tokens' 32 activations of sub-block 2c (A_0) and
   2c + 1 (A_1), [2M][32]; B as above; C their sums [2M][16], even steps in C_0 / C_1 and odd ones in C_2 / C_3,
   so a step's products go on while the step before has its sums stored */
#define KQS_A_0 0
#define KQS_A_1 1
#define KQS_B_0 2
#define KQS_B_1 3
#define KQS_C_0 4
#define KQS_C_1 5
#define KQS_C_2 6
#define KQS_C_3 7

#endif
