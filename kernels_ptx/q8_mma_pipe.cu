// Q8_0 x int8 tensor cores for few-token steps (9..64 tokens: batched decode), with q8_mma.cu's
// arithmetic, arguments, epilogues and split-K ticket protocol, and a deeper pipeline.
//
// q8_mma.cu keeps one weight stage in flight per block and quantises x per stage from registers:
// a stage costs a load latency plus the quantisation, and a short split (two stages) is two
// latencies end to end.  Here:
//  - weights AND their fp16 scales arrive by cp.async in a ring of STAGES stages (STAGES - 1 in
//    flight while one is multiplied), issued before pdl_wait for the first STAGES - 1;
//  - x is quantised once per XC-wide chunk of the block's K run (hi, lo int8 and d / 128 in shared
//    memory), all of a chunk's loads issued at once: a split of up to XC of K quantises x once,
//    and its weight ring runs without waiting on x;
//    X_AHEAD tiles load the next chunk into registers as soon as one is quantised (short chunks:
//    a long K run does not wait on x at every chunk);
//  - BM = 32 tiles give each warp two m16 fragments that share every weight fragment it reads;
//  - the last split of a tile reads eight splits' partials at once (q8_mma.cu one split after the other);
//  - the last block's 1/rms reads y as float4, a row of the tile per unrolled load, and sums the
//    block's warps in shared memory (q8_mma.cu walks the rows one warp each, scalar loads).
// Scales by cp.async: a row's KB fp16 scales of a stage start at half index row * kblocks + k0/32
// (+ 1 where `scales` itself is 2 mod 4: indices count from the aligned word below it), 2-byte aligned
// only; the block copies the KB / 2 + 1 aligned 4-byte words around them (a word past the end of the
// array zero-filled) and reads each row at its parity.  Scales beyond K (the tail of the last stage)
// are the next row's, finite, and meet zero-filled weights and zero x.
#include "common.cuh"
#include "mma_epilogue.cuh"
#include "q8_mma.cuh"

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, int bytes) {
    unsigned int dst = (unsigned int)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(gmem), "r"(bytes));
}

template <int BM, int BN, int BK, int STAGES, int XC, bool X_AHEAD, int WARPS_N, bool SILU_PAIRS>
__device__ __forceinline__ void q8_mma_pipe_body(
        const int8* __restrict__ qs, const half_bits* __restrict__ scales, const float* x, int ldx,
        const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out, float* xn_out,
        float* inv_rms_out, unsigned int* counter, float eps, int N, int K, int ntok, float* partials,
        unsigned int* tickets) {
    constexpr int THREADS = 32 * WARPS_N;
    constexpr int FM = BM / 16, FN = BN / 8 / WARPS_N;   // mma tiles per warp: every warp has all BM tokens
    constexpr int KB = BK / 32;                          // Q8_0 blocks per stage
    constexpr int W_STRIDE = BK + 16, X_STRIDE = XC + 16;   // bytes per shared row: no bank conflicts
    constexpr int SW = KB / 2 + 1;                       // 4-byte words of fp16 scales per row and stage
    constexpr int W_LOADS = BN * (BK / 16) / THREADS;    // 16-byte weight chunks per thread and stage
    constexpr int X_LOADS = BM * (XC / 4) / THREADS;     // float4 of x per thread and chunk
    static_assert(FM >= 1 && FN >= 1 && W_LOADS >= 1 && X_LOADS >= 1 && STAGES >= 2, "tile");
    static_assert(BK % 64 == 0 && XC % BK == 0 && (XC / 4) % 8 == 0, "stages, chunks, 32-blocks");
    static_assert(BN * (BK / 16) % THREADS == 0 && BM * (XC / 4) % THREADS == 0, "tile shape");

    __shared__ __align__(16) unsigned char w_tile[STAGES][BN * W_STRIDE];
    __shared__ __align__(16) unsigned int w_scale_words[STAGES][BN * SW];
    __shared__ __align__(16) unsigned char x_tile[2][BM * X_STRIDE];   // [hi|lo] of the current chunk
    __shared__ float x_scale[XC / 32][BM];                            // d / 128 per block and token
    __shared__ float row_sq[WARPS_N][BM];
    __shared__ bool is_last_block, is_last_split;
    pdl_launch_dependents();

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tok0 = blockIdx.y * BM, row0 = blockIdx.x * BN;
    const int kblocks = K >> 5;
    // fp16 scales as 4-byte words from the aligned word at or below `scales` (half index `scale_shift`)
    const unsigned int* scale_words = reinterpret_cast<const unsigned int*>((unsigned long long)scales & ~3ull);
    const int scale_shift = ((unsigned long long)scales & 2) ? 1 : 0;
    const long long scale_bytes = 2LL * ((long long)N * kblocks + scale_shift);
    const int splits = gridDim.z, stages_all = (K + BK - 1) / BK, stages_per_split = (stages_all + splits - 1) / splits;
    const int stage_begin = blockIdx.z * stages_per_split, stage_end = min(stages_all, stage_begin + stages_per_split);
    const int n_stages = stage_end - stage_begin, k_begin = stage_begin * BK;

    auto issue_stage = [&](int slot, int k0) {   // constant weights and scales: safe before pdl_wait
#pragma unroll
        for (int j = 0; j < W_LOADS; j++) {
            int c = tid + j * THREADS, r = c / (BK / 16), part = c % (BK / 16);
            int row = min(row0 + r, N - 1);
            int k = k0 + part * 16;
            cp_async16(&w_tile[slot][r * W_STRIDE + part * 16], qs + (long long)row * K + min(k, K - 16), k < K);
        }
        for (int c = tid; c < BN * SW; c += THREADS) {
            const int r = c / SW, row = min(row0 + r, N - 1);
            const long long word = (((long long)row * kblocks + (k0 >> 5) + scale_shift) >> 1) + c % SW;
            const long long left = scale_bytes - 4 * word;
            const int bytes = left >= 4 ? 4 : left > 0 ? (int)left : 0;
            cp_async4(&w_scale_words[slot][c], scale_words + (bytes ? word : 0), bytes);
        }
        asm volatile("cp.async.commit_group;");
    };
    // x[tok0 .., kc .. kc + XC) -> hi, lo, d / 128 in shared memory; zeros from k_end on (the split's
    // K run ends there: a short split reads only its own x)
    const int k_end = min(K, stage_end * BK);
    float4 v[X_LOADS];
    auto fetch_chunk = [&](int kc) {
#pragma unroll
        for (int j = 0; j < X_LOADS; j++) {
            int f = tid + j * THREADS, r = f / (XC / 4), k = kc + (f % (XC / 4)) * 4;
            int tok = tok0 + r;
            v[j] = (tok < ntok && k < k_end) ? *(const float4*)(x + (long long)tok * ldx + k)
                                             : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    auto store_chunk = [&]() {
#pragma unroll
        for (int j = 0; j < X_LOADS; j++) {
            int f = tid + j * THREADS, r = f / (XC / 4), c4 = f % (XC / 4);
            float amax = fmaxf(fmaxf(fabsf(v[j].x), fabsf(v[j].y)), fmaxf(fabsf(v[j].z), fabsf(v[j].w)));
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            float d = amax / 127.0f;
            float inv = d != 0.f ? 1.0f / d : 0.f;
            unsigned int hi, lo;
            quantise4(v[j], d, inv, hi, lo);
            *(unsigned int*)&x_tile[0][r * X_STRIDE + c4 * 4] = hi;
            *(unsigned int*)&x_tile[1][r * X_STRIDE + c4 * 4] = lo;
            if ((c4 & 7) == 0) x_scale[c4 >> 3][r] = d * (1.0f / 128.0f);
        }
    };
    // a weight row's scale of block b of the stage in `slot` (row_in_tile as issue_stage clamped it)
    auto weight_scale = [&](int slot, int row_in_tile, int b) -> float {
        const int row = min(row0 + row_in_tile, N - 1);
        const int parity = (int)(((long long)row * kblocks + scale_shift) & 1);   // k0 / 32 is even: BK % 64 == 0
        const half_bits* h = reinterpret_cast<const half_bits*>(&w_scale_words[slot][row_in_tile * SW]);
        return half_to_float(h[parity + b]);
    };

    float acc[FM][FN][4];
#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int j = 0; j < FN; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[i][j][c] = 0.f;

#pragma unroll
    for (int i = 0; i < STAGES - 1; i++) {
        if (i < n_stages) issue_stage(i, (stage_begin + i) * BK);
        else asm volatile("cp.async.commit_group;");   // empty: every iteration waits on the same count
    }
    pdl_wait();   // x is written by the previous kernel
    if (X_AHEAD) fetch_chunk(k_begin);
    for (int s = 0; s < n_stages; s++) {
        const int kx = (s * BK) % XC;   // this stage's offset in the x chunk
        if (kx == 0) {
            if (s) __syncthreads();     // every warp is done with the last chunk
            if (!X_AHEAD) fetch_chunk(k_begin + s * BK);
            store_chunk();
            // X_AHEAD: the next chunk's loads in flight while this one is multiplied
            if (X_AHEAD && k_begin + s * BK + XC < k_end) fetch_chunk(k_begin + s * BK + XC);
        }
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");
        __syncthreads();   // stage s and the chunk visible; every warp done with stage s - 1's slot
        if (s + STAGES - 1 < n_stages) issue_stage((s + STAGES - 1) % STAGES, (stage_begin + s + STAGES - 1) * BK);
        else asm volatile("cp.async.commit_group;");
        const int slot = s % STAGES;
        const unsigned char* wt = w_tile[slot];
#pragma unroll
        for (int b = 0; b < KB; b++) {
            unsigned int a[FM][4], a_lo[FM][4], bw[FN][2];
            float ws0[FN], ws1[FN];
#pragma unroll
            for (int i = 0; i < FM; i++) {
                const int at = (i * 16 + g) * X_STRIDE + kx + b * 32 + t * 4;
#pragma unroll
                for (int level = 0; level < 2; level++) {
                    const unsigned char* p = x_tile[level] + at;
                    unsigned int (&frag)[4] = level ? a_lo[i] : a[i];
                    frag[0] = *(const unsigned int*)p;
                    frag[1] = *(const unsigned int*)(p + 8 * X_STRIDE);
                    frag[2] = *(const unsigned int*)(p + 16);
                    frag[3] = *(const unsigned int*)(p + 8 * X_STRIDE + 16);
                }
            }
#pragma unroll
            for (int j = 0; j < FN; j++) {
                const int n = warp * FN * 8 + j * 8;
                const unsigned char* p = wt + (n + g) * W_STRIDE + b * 32 + t * 4;
                bw[j][0] = *(const unsigned int*)p;
                bw[j][1] = *(const unsigned int*)(p + 16);
                ws0[j] = weight_scale(slot, n + t * 2, b);
                ws1[j] = weight_scale(slot, n + t * 2 + 1, b);
            }
#pragma unroll
            for (int i = 0; i < FM; i++) {
                const int m = i * 16 + g;
                const float xs0 = x_scale[(kx >> 5) + b][m], xs1 = x_scale[(kx >> 5) + b][m + 8];
#pragma unroll
                for (int j = 0; j < FN; j++) {
                    const int zero[4] = {0, 0, 0, 0};
                    int hi[4], d[4];
                    mma_s8(hi, a[i], bw[j], zero);
#pragma unroll
                    for (int c = 0; c < 4; c++) hi[c] <<= 7;   // |hi| <= 32 * 127 * 127: no overflow
                    mma_s8(d, a_lo[i], bw[j], hi);
                    acc[i][j][0] = fmaf((float)d[0], xs0 * ws0[j], acc[i][j][0]);
                    acc[i][j][1] = fmaf((float)d[1], xs0 * ws1[j], acc[i][j][1]);
                    acc[i][j][2] = fmaf((float)d[2], xs1 * ws0[j], acc[i][j][2]);
                    acc[i][j][3] = fmaf((float)d[3], xs1 * ws1[j], acc[i][j][3]);
                }
            }
        }
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");   // no copy outlives the block

    if (splits > 1) {   // q8_mma.cu's protocol: partials in fragment order, the last split sums 0..z-1
        const int tile = blockIdx.y * gridDim.x + blockIdx.x;
        float4* tile_partials = reinterpret_cast<float4*>(partials) + (long long)tile * splits * (FM * FN * THREADS);
        float4* mine = tile_partials + blockIdx.z * (FM * FN * THREADS);
#pragma unroll
        for (int i = 0; i < FM; i++)
#pragma unroll
            for (int j = 0; j < FN; j++)
                __stcg(mine + (i * FN + j) * THREADS + tid,
                       make_float4(acc[i][j][0], acc[i][j][1], acc[i][j][2], acc[i][j][3]));
        __threadfence();
        __syncthreads();
        if (tid == 0) is_last_split = atomicAdd(tickets + tile, 1u) == (unsigned int)splits - 1;
        __syncthreads();
        if (!is_last_split) return;
        __threadfence();
        // unrolled: eight splits' loads in flight at once (one L2 latency per eight splits, not per split);
        // the adds stay in split order
        const float4* part = tile_partials + tid;
#pragma unroll 8
        for (int z = 0; z < splits; z++, part += FM * FN * THREADS)
#pragma unroll
            for (int i = 0; i < FM; i++)
#pragma unroll
                for (int j = 0; j < FN; j++) {
                    const float4 v = __ldcg(part + (i * FN + j) * THREADS);
                    if (z == 0) {
                        acc[i][j][0] = v.x; acc[i][j][1] = v.y; acc[i][j][2] = v.z; acc[i][j][3] = v.w;
                    } else {
                        acc[i][j][0] += v.x; acc[i][j][1] += v.y; acc[i][j][2] += v.z; acc[i][j][3] += v.w;
                    }
                }
        if (tid == 0) tickets[tile] = 0u;
    }

#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int tok = tok0 + i * 16 + g + 8 * h;
            if (tok >= ntok) continue;
            const float scale = inv_rms_in ? inv_rms_in[tok] : 1.0f;
#pragma unroll
            for (int j = 0; j < FN; j++) {
                const int row = row0 + warp * FN * 8 + j * 8 + t * 2;   // even: a (gate, up) pair
                const float v0 = acc[i][j][2 * h] * scale, v1 = acc[i][j][2 * h + 1] * scale;
                mma_store_pair<SILU_PAIRS>(tok, row, v0, v1, N, ldy, y, res, normw_out, xn_out);
            }
        }
    if (inv_rms_out == nullptr) return;

    // q8_mma.cu's tickets (one per row of token blocks up to 8 rows, counter[0..7]; else one)
    const bool ticket_per_row = gridDim.y <= 8;
    unsigned int* ticket = counter + (ticket_per_row ? blockIdx.y : 0);
    const unsigned int blocks_in_ticket = ticket_per_row ? gridDim.x : gridDim.x * gridDim.y;
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last_block = atomicAdd(ticket, 1u) == blocks_in_ticket - 1;
    __syncthreads();
    if (!is_last_block) return;
    __threadfence();
    if (ticket_per_row && ((N | ldy) & 3) == 0 && ((unsigned long long)y & 15) == 0) {
        // every thread a float4 column of each of the tile's rows per pass: BM loads in flight at once
        float sq[BM];
#pragma unroll
        for (int i = 0; i < BM; i++) sq[i] = 0.f;
        for (int k = tid * 4; k < N; k += THREADS * 4)
#pragma unroll
            for (int i = 0; i < BM; i++)
                if (tok0 + i < ntok) {
                    const float4 v = __ldcg(reinterpret_cast<const float4*>(y + (long long)(tok0 + i) * ldy + k));
                    sq[i] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
                }
#pragma unroll
        for (int i = 0; i < BM; i++) {
            const float total = warp_sum(sq[i]);
            if (lane == 0) row_sq[warp][i] = total;
        }
        __syncthreads();
        if (tid < BM && tok0 + tid < ntok) {
            float total = 0.f;
#pragma unroll
            for (int w = 0; w < WARPS_N; w++) total += row_sq[w][tid];
            inv_rms_out[tok0 + tid] = 1.0f / sqrtf(total / (float)N + eps);
        }
    } else {
        const int m_end = ticket_per_row ? min(tok0 + BM, ntok) : ntok;
        for (int m = (ticket_per_row ? tok0 : 0) + warp; m < m_end; m += WARPS_N) {
            const float* row = y + (long long)m * ldy;
            float sq = 0.f;
            for (int k = lane; k < N; k += 32) { float v = __ldcg(row + k); sq += v * v; }
            sq = warp_sum(sq);
            if (lane == 0) inv_rms_out[m] = 1.0f / sqrtf(sq / (float)N + eps);
        }
    }
    if (tid == 0) *ticket = 0u;
}

// q8_mma_<BM>x<BN>k<BK>p<STAGES>c<XC>[x2][b<MINB>] (+ _silu): the pipelined tiles of
// kestrel_stream/cuda/mma_variants.py (Tile.stages > 2), XC the x chunk (what fits the 48 KB of static
// shared memory), x2 the next chunk loaded ahead (XA), MINB the blocks per SM the registers are capped
// for (1: uncapped)
#define DEFINE_PIPE(BM, BN, BK, STAGES, XC, XA, WN, MINB, SILU, NAME)                            \
    extern "C" __global__ void __launch_bounds__(32 * WN, MINB) NAME(                            \
            const int8* qs, const half_bits* scales, const float* x, int ldx,                    \
            const float* inv_rms_in, float* y, int ldy, const float* res, const float* normw_out,\
            float* xn_out, float* inv_rms_out, unsigned int* counter, float eps, int N, int K,   \
            int ntok, float* partials, unsigned int* tickets) {                                  \
        q8_mma_pipe_body<BM, BN, BK, STAGES, XC, XA, WN, SILU>(qs, scales, x, ldx, inv_rms_in, y, ldy, res,\
                normw_out, xn_out, inv_rms_out, counter, eps, N, K, ntok, partials, tickets);    \
    }
#define DEFINE_PIPE_PAIR(BM, BN, BK, STAGES, XC, XA, WN, MINB, SUFFIX)                  \
    DEFINE_PIPE(BM, BN, BK, STAGES, XC, XA, WN, MINB, false, q8_mma_##SUFFIX)           \
    DEFINE_PIPE(BM, BN, BK, STAGES, XC, XA, WN, MINB, true, q8_mma_##SUFFIX##_silu)
DEFINE_PIPE_PAIR(16, 64, 128, 3, 512, false, 4, 1, 16x64k128p3c512)
DEFINE_PIPE_PAIR(16, 64, 128, 3, 256, false, 4, 4, 16x64k128p3c256b4)
DEFINE_PIPE_PAIR(16, 64, 64, 4, 512, false, 4, 1, 16x64k64p4c512)
DEFINE_PIPE_PAIR(16, 64, 64, 4, 256, false, 4, 4, 16x64k64p4c256b4)
DEFINE_PIPE_PAIR(16, 32, 256, 3, 512, false, 4, 1, 16x32k256p3c512)
DEFINE_PIPE_PAIR(16, 128, 64, 3, 256, false, 8, 1, 16x128k64p3c256)
DEFINE_PIPE_PAIR(32, 64, 64, 4, 256, false, 4, 1, 32x64k64p4c256)
DEFINE_PIPE_PAIR(32, 64, 128, 3, 256, false, 4, 1, 32x64k128p3c256)
DEFINE_PIPE_PAIR(32, 128, 64, 3, 128, false, 8, 1, 32x128k64p3c128)
DEFINE_PIPE_PAIR(64, 64, 64, 4, 128, false, 4, 1, 64x64k64p4c128)
DEFINE_PIPE_PAIR(16, 64, 128, 4, 128, true, 4, 1, 16x64k128p4c128x2)
DEFINE_PIPE_PAIR(16, 64, 64, 4, 128, true, 4, 4, 16x64k64p4c128x2b4)
DEFINE_PIPE_PAIR(32, 64, 64, 4, 128, true, 4, 1, 32x64k64p4c128x2)
