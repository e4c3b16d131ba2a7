// Causal attention for steps of many query tokens per session (prefill chunks, several
// prompts in one step), on tensor cores: mma.sync m16n8k16 with f16 inputs and fp32
// accumulation for S = Q K^T and O = P V, an online softmax in fp32, K/V tiles streamed
// through shared memory by cp.async (two stages).  Reads gpu mode's paged f16 pool through
// each token's block-table row (kv_cache.cuh), like attention_paged_d*_f16.
//
// Rows of the mma M dimension are (query token, q head of the kv head's GQA group) pairs,
// row r = token (r / group), head (r % group): the group's q heads share every K/V tile.
// A block owns one kv head and FLASH_ROWS rows, i.e. FLASH_ROWS / group consecutive step
// tokens; each warp 16 rows.  The tokens of a block may belong to several sessions (one
// prompt ending, the next beginning): the block walks the runs of equal table rows in turn,
// each over that session's keys [min first key, max pos] of the run, every other row masked.
// Each query row sees keys first..pos[t] (first = pos - window + 1 with a sliding window; a token
// tree's rows less the slots of other branches: `tree`, kv_cache.cuh TreeRow, null without a tree),
// so a chunk continuing a cached prefix (pos > 0 at its first token) is causal as a whole.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 .f16; g = lane / 4, c = lane % 4):
//   A (16 x 16, row): a0 = (g, 2c..2c+1), a1 = (g+8, 2c..), a2 = (g, 2c+8..), a3 = (g+8, 2c+8..)
//   B (16 x 8, col):  b0 = (k 2c..2c+1, n g), b1 = (k 2c+8..2c+9, n g)
//   C (16 x 8):       c0,c1 = (g, 2c..2c+1), c2,c3 = (g+8, 2c..2c+1)
// Q K^T: B[k = dim][n = key] = K[key][dim], two adjacent dims of one key row: 32-bit loads
// from the row-major K tile.  P V: the score accumulators of two 8-key n tiles are exactly
// the A fragment of one 16-key k step (rounded to f16); B[k = key][n = dim] = V[key][dim]
// comes from the row-major V tile by ldmatrix .trans.
#include "common.cuh"
#include "kv_cache.cuh"

#define FLASH_WARPS 4
#define FLASH_ROWS (16 * FLASH_WARPS)   // (token, q head) rows per block; tokens = FLASH_ROWS / group

__device__ __forceinline__ unsigned int half2_bits(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));   // first source -> upper half
    return r;
}

// d += a * b over one 16 x 8 x 16 tile
__device__ __forceinline__ void mma_f16(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8 x 8 b16 matrices, transposed: lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int (&r)[4], const half_bits* smem) {
    unsigned int address = (unsigned int)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address) : "memory");
}

__device__ __forceinline__ void flash_cp_async16(half_bits* smem, const half_bits* gmem, bool valid) {
    unsigned int dst = (unsigned int)__cvta_generic_to_shared(smem);
    int bytes = valid ? 16 : 0;   // 0: zero-filled (keys past the run's last), never NaN garbage times p = 0
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(bytes) : "memory");
}

template <int D>
__device__ __forceinline__ void flash_attention_body(
        const float* __restrict__ q, const unsigned long long* tables, const long long* table_row,
        const int* pos, float* __restrict__ out, int ntok, int layer, int n_layers, int n_heads, int n_kv,
        int window, float softmax_scale, int block_shift, const int* tree) {
    constexpr int BN = 4096 / D;             // keys per tile: both stages of K and V stay under 48 KiB
    constexpr int STRIDE = D + 8;            // halves per shared row: fragment loads free of bank conflicts
    constexpr int KSTEPS = D / 16;           // k steps of Q K^T
    constexpr int S_TILES = BN / 8;          // 8-key n tiles of S
    constexpr int O_TILES = D / 8;           // 8-dim n tiles of O
    constexpr int CHUNKS = BN * D / 8 / (FLASH_WARPS * 32);   // 16-byte chunks of a K (or V) tile per thread
    static_assert(D % 16 == 0 && BN % 16 == 0 && CHUNKS * FLASH_WARPS * 32 * 8 == BN * D, "tile shape");
    __shared__ __align__(16) half_bits k_tile[2][BN * STRIDE];
    __shared__ __align__(16) half_bits v_tile[2][BN * STRIDE];
    __shared__ long long tile_table[FLASH_ROWS];
    __shared__ int tile_pos[FLASH_ROWS];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int head_kv = blockIdx.x, group = n_heads / n_kv;
    const int tile_tokens = FLASH_ROWS / group;
    const int tok0 = blockIdx.y * tile_tokens;
    const int n_tok = min(tile_tokens, ntok - tok0);   // >= 1: the grid covers ntok exactly
    pdl_launch_dependents();
    pdl_wait();   // q and the KV rows of this step come from the previous kernel
    for (int i = tid; i < n_tok; i += FLASH_WARPS * 32) {
        tile_table[i] = table_row[tok0 + i];
        tile_pos[i] = pos[tok0 + i];
    }
    __syncthreads();

    // this thread's two fragment rows, warp * 16 + g and + 8
    int row_tok[2], row_head[2], row_pos[2], row_first[2];
    bool row_ok[2];
    TreeRow row_mask[2];   // a token tree's rows: the slots of other branches (kv_cache.cuh)
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int r = warp * 16 + g + 8 * i;
        row_tok[i] = r / group;
        row_head[i] = head_kv * group + r % group;
        row_ok[i] = row_tok[i] < n_tok;
        row_pos[i] = row_ok[i] ? tile_pos[row_tok[i]] : -1;
        row_first[i] = window > 0 ? max(row_pos[i] - window + 1, 0) : 0;
        row_mask[i] = tree_row(row_ok[i] ? tree : nullptr, tok0 + row_tok[i], row_pos[i]);
    }
    // Q (scaled) as f16 A fragments, for the whole walk over the keys
    unsigned int qa[KSTEPS][4];
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ks++) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float* src = q + ((long long)(tok0 + row_tok[i]) * n_heads + row_head[i]) * D + ks * 16 + 2 * c;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float2 v = row_ok[i] ? *reinterpret_cast<const float2*>(src + 8 * h) : make_float2(0.f, 0.f);
                qa[ks][i + 2 * h] = half2_bits(v.x * softmax_scale, v.y * softmax_scale);
            }
        }
    }
    float o[O_TILES][4];
#pragma unroll
    for (int n = 0; n < O_TILES; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
    const long long v_offset = (long long)n_kv * D;   // a position's V row follows its K row

    for (int run_begin = 0; run_begin < n_tok;) {   // every thread walks the same runs (shared memory)
        const long long run_table = tile_table[run_begin];
        int run_end = run_begin, key_lo = 0x7fffffff, key_hi = 0;
        for (; run_end < n_tok && tile_table[run_end] == run_table; run_end++) {
            const int p = tile_pos[run_end];
            key_hi = max(key_hi, p + 1);
            key_lo = min(key_lo, window > 0 ? max(p - window + 1, 0) : 0);
        }
        bool in_run[2];
#pragma unroll
        for (int i = 0; i < 2; i++) in_run[i] = row_ok[i] && row_tok[i] >= run_begin && row_tok[i] < run_end;
        const bool warp_busy = __any_sync(0xffffffffu, in_run[0] || in_run[1]);
        PagedRows<half_bits> rows{tables + run_table, (long long)layer * 2 * n_kv * D + (long long)head_kv * D,
                                  (long long)n_layers * 2 * n_kv * D, block_shift};
        auto issue = [&](int stage, int k0) {
#pragma unroll
            for (int j = 0; j < CHUNKS; j++) {
                const int chunk = tid + j * FLASH_WARPS * 32, key = chunk / (D / 8), part = chunk % (D / 8);
                const bool valid = k0 + key < key_hi;
                const half_bits* src = rows.row(valid ? k0 + key : key_lo) + part * 8;
                flash_cp_async16(&k_tile[stage][key * STRIDE + part * 8], src, valid);
                flash_cp_async16(&v_tile[stage][key * STRIDE + part * 8], src + v_offset, valid);
            }
            asm volatile("cp.async.commit_group;" ::: "memory");
        };
        const int n_tiles = (key_hi - key_lo + BN - 1) / BN;
        issue(0, key_lo);
        for (int it = 0; it < n_tiles; it++) {
            const int stage = it & 1, k0 = key_lo + it * BN;
            if (it + 1 < n_tiles) {
                issue(stage ^ 1, k0 + BN);   // its stage was last read in iteration it - 1, before the barrier
                asm volatile("cp.async.wait_group 1;" ::: "memory");
            } else {
                asm volatile("cp.async.wait_group 0;" ::: "memory");
            }
            __syncthreads();
            if (warp_busy) {
                const half_bits* ks_tile = k_tile[stage];
                const half_bits* vs_tile = v_tile[stage];
                float s[S_TILES][4];
#pragma unroll
                for (int n = 0; n < S_TILES; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
                for (int ks = 0; ks < KSTEPS; ks++) {
#pragma unroll
                    for (int n = 0; n < S_TILES; n++) {
                        const half_bits* kr = ks_tile + (n * 8 + g) * STRIDE + ks * 16 + 2 * c;
                        mma_f16(s[n], qa[ks], *reinterpret_cast<const unsigned int*>(kr),
                                *reinterpret_cast<const unsigned int*>(kr + 8));
                    }
                }
                // mask (other sessions' rows, the future, outside the window), then the tile's row maxima
                float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
                for (int n = 0; n < S_TILES; n++) {
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int i = e >> 1, key = k0 + n * 8 + 2 * c + (e & 1);
                        const bool seen = in_run[i] && key <= row_pos[i] && key >= row_first[i]
                                          && row_mask[i].sees(key);
                        s[n][e] = seen ? s[n][e] : -INFINITY;
                        tile_max[i] = fmaxf(tile_max[i], s[n][e]);
                    }
                }
                float m_use[2], rescale[2];
#pragma unroll
                for (int i = 0; i < 2; i++) {   // the four threads of a row hold its 8-key columns 2c, 2c+1
                    tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
                    tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
                    const float new_max = fmaxf(row_max[i], tile_max[i]);
                    m_use[i] = new_max == -INFINITY ? 0.f : new_max;   // a row that saw no key yet stays at 0
                    rescale[i] = expf(row_max[i] - m_use[i]);
                    row_max[i] = new_max;
                }
                unsigned int pa[BN / 16][4];
                float tile_sum[2] = {0.f, 0.f};
#pragma unroll
                for (int n = 0; n < S_TILES; n++) {
                    const float p0 = expf(s[n][0] - m_use[0]), p1 = expf(s[n][1] - m_use[0]);
                    const float p2 = expf(s[n][2] - m_use[1]), p3 = expf(s[n][3] - m_use[1]);
                    tile_sum[0] += p0 + p1;
                    tile_sum[1] += p2 + p3;
                    pa[n >> 1][2 * (n & 1)] = half2_bits(p0, p1);       // row g, keys 2c.. of the k step
                    pa[n >> 1][2 * (n & 1) + 1] = half2_bits(p2, p3);   // row g + 8
                }
#pragma unroll
                for (int i = 0; i < 2; i++) row_sum[i] = row_sum[i] * rescale[i] + tile_sum[i];
#pragma unroll
                for (int n = 0; n < O_TILES; n++) {
                    o[n][0] *= rescale[0]; o[n][1] *= rescale[0];
                    o[n][2] *= rescale[1]; o[n][3] *= rescale[1];
                }
#pragma unroll
                for (int kk = 0; kk < BN / 16; kk++) {
#pragma unroll
                    for (int n = 0; n < O_TILES / 2; n++) {   // two 8-dim tiles per ldmatrix.x4
                        unsigned int b[4];
                        ldmatrix_x4_trans(b, vs_tile + (kk * 16 + (lane & 15)) * STRIDE + n * 16 + (lane >> 4) * 8);
                        mma_f16(o[2 * n], pa[kk], b[0], b[1]);
                        mma_f16(o[2 * n + 1], pa[kk], b[2], b[3]);
                    }
                }
            }
            __syncthreads();   // every warp is done with this stage before it is refilled
        }
        run_begin = run_end;
    }

#pragma unroll
    for (int i = 0; i < 2; i++) {
        row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
        row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
        if (!row_ok[i]) continue;
        const float inv = 1.f / row_sum[i];   // > 0: a row always sees its own position
        float* dst = out + ((long long)(tok0 + row_tok[i]) * n_heads + row_head[i]) * D + 2 * c;
#pragma unroll
        for (int n = 0; n < O_TILES; n++)
            *reinterpret_cast<float2*>(dst + n * 8) = make_float2(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
    }
}

// grid (n_kv, ceil(ntok / (FLASH_ROWS / group))), FLASH_WARPS * 32 threads
#define DEFINE_FLASH_ATTENTION(D)                                                                  \
    extern "C" __global__ void __launch_bounds__(FLASH_WARPS * 32) flash_attention_paged_d##D##_f16( \
            const float* q, const unsigned long long* tables, const long long* table_row, const int* pos, \
            float* out, int ntok, int layer, int n_layers, int n_heads, int n_kv, int window,           \
            float softmax_scale, int block_shift, const int* tree) {                                    \
        flash_attention_body<D>(q, tables, table_row, pos, out, ntok, layer, n_layers, n_heads, n_kv,   \
                                window, softmax_scale, block_shift, tree);                              \
    }
// kestrel_stream.cuda.flash_attention.FLASH_HEAD_DIMS
DEFINE_FLASH_ATTENTION(64)
DEFINE_FLASH_ATTENTION(128)
