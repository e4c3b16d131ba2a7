// A Q8_0 weight tile in shared memory, for the tensor-core GEMMs that expand it in registers
// (q8_gemm_f16.cu, q8_wgmma.cu): ROWS int8 rows of 64 of K (80-byte rows: the eight rows of an ldmatrix,
// or a half warp's 16-bit loads, hit distinct banks) and each row's fp16 scales of those 64.
//
// Scales: a row's 2 halves of a stage sit in the 2 aligned 4-byte words around them (its first scale is
// 2-byte aligned only when K / 32 is odd, or `scales` itself is 2 mod 4); Q8Scales::parity says where they
// start.  Words past the array are zero-filled.
#pragma once
#include "cp_async.cuh"

constexpr int Q8_TILE_K = 64, Q8_TILE_STRIDE = Q8_TILE_K + 16, Q8_TILE_SCALE_WORDS = 2;

// `scales` as aligned words: half index i of `scales` is half (i + shift) of `words`
struct Q8Scales {
    const unsigned int* words;
    int shift;
    long long word_count;

    __device__ __forceinline__ Q8Scales(const half_bits* scales, int N, int kblocks)
        : words((const unsigned int*)((unsigned long long)scales & ~3ull)),
          shift((int)(((unsigned long long)scales >> 1) & 1)),
          word_count(((long long)N * kblocks + shift + 1) >> 1) {}

    // where row `row`'s scales of the stage at 32-block kb0 start in its 2 words: 0 or 1
    __device__ __forceinline__ int parity(int row, int kblocks, int kb0) const {
        return (int)(((long long)row * kblocks + kb0 + shift) & 1);
    }
};

// cp.async of rows row0 .. row0 + ROWS - 1, K k0 .. k0 + 63 of the weight into `tile` (ROWS x 80 bytes)
// and their scale words into `scale_words` (ROWS x 8 bytes); rows past N and K past its end zero-filled
template <int ROWS, int THREADS>
__device__ __forceinline__ void q8_tile_issue(unsigned int tile, unsigned int scale_words, const int8* qs,
                                              const Q8Scales& sc, int row0, int k0, int N, int K, int kblocks,
                                              int tid) {
    constexpr int CHUNKS = ROWS * (Q8_TILE_K / 16), WORDS = ROWS * Q8_TILE_SCALE_WORDS;
#pragma unroll
    for (int j = 0; j < (CHUNKS + THREADS - 1) / THREADS; j++) {
        const int chunk = tid + j * THREADS;
        if (CHUNKS % THREADS != 0 && chunk >= CHUNKS) break;
        const int r = chunk / (Q8_TILE_K / 16), part = chunk % (Q8_TILE_K / 16), row = row0 + r, k = k0 + part * 16;
        cp_async16(tile + r * Q8_TILE_STRIDE + part * 16, qs + (long long)min(row, N - 1) * K + min(k, K - 16),
                   row < N && k < K);
    }
#pragma unroll
    for (int j = 0; j < (WORDS + THREADS - 1) / THREADS; j++) {
        const int w = tid + j * THREADS;
        if (WORDS % THREADS != 0 && w >= WORDS) break;
        const int r = w / Q8_TILE_SCALE_WORDS, row = row0 + r;
        const long long word = (((long long)row * kblocks + (k0 >> 5) + sc.shift) >> 1) + w % Q8_TILE_SCALE_WORDS;
        const bool valid = row < N && word < sc.word_count;
        cp_async4(scale_words + w * 4, sc.words + (valid ? word : 0), valid);
    }
}

// Two signed bytes of `biased` (each xor 0x80) picked by `selector`, as fp16 q * d (d2: d in both halves):
// 0x64uu is the fp16 1024 + u exactly, so (0x64uu - 1152) is the byte's value and one mul rounds q * d.
__device__ __forceinline__ unsigned int q8_dequant_pair(unsigned int biased, unsigned int selector, unsigned int d2) {
    unsigned int h = __byte_perm(biased, 0x64646464u, selector), q, r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(q) : "r"(h), "r"(0x64806480u));
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(q), "r"(d2));
    return r;
}
