"""The single-token q8 GEMV variants of kernels_ptx/q8_gemv.cu and which one each shape gets.

A variant is THREADS x ROWS x UNROLL: a block of THREADS threads owns ROWS weight rows
and each thread keeps ROWS*UNROLL 16-byte weight loads in flight.  Kernel names are
q8_gemv_m1 + suffix (+ "_silu"); "" is the 128 x 2 x 2 kernel that also serves M = 2..8.
Pure Python: the emulated executor tests and the bench read it without a driver.
"""
from __future__ import annotations

from typing import NamedTuple


class Variant(NamedTuple):
    threads: int
    rows: int
    unroll: int


VARIANTS = {"": Variant(128, 2, 2), "r4": Variant(128, 4, 2), "w32r2u4": Variant(32, 2, 4),
            "w32r4u2": Variant(32, 4, 2), "w32r2u2": Variant(32, 2, 2), "w64r2u4": Variant(64, 2, 4),
            "w64r4u2": Variant(64, 4, 2), "w128r2u4": Variant(128, 2, 4), "w32r4u4": Variant(32, 4, 4),
            "w64r8u2": Variant(64, 8, 2), "w128r4u3": Variant(128, 4, 3), "w128r2u3": Variant(128, 2, 3)}

MULTI_TOKEN = VARIANTS[""]   # q8_gemv_m2..m8
# 2..8 tokens: the 128 x 2 x 2 kernel, or row-outer layouts (one row's weights in registers at a time,
# x re-read from L1 per row) that keep more warps resident
MULTI_VARIANTS = {"": MULTI_TOKEN, "o64r4u2": Variant(64, 4, 2), "o128r4u1": Variant(128, 4, 1)}


def multi_variant(tokens: int, forced: str | None = None, rows: int | None = None) -> str:
    """The layout suffix for a GEMV over 2..8 tokens; `forced` (Options.gemv_mn, KESTREL_GEMV_MN) wins.
    Given the weight's `rows`, from HMMA_MIN_TOKENS tokens the tensor-core layout of hmma_variant (a key of
    HMMA_VARIANTS); otherwise the fp32 layouts below.

    Measured on the H200 at the qwen3-1.7b shapes (bench/results/2026-11-30-h200-gpu-kernels.md, M = 2, 4, 8):
    both row-outer layouts take about half the time of the 128 x 2 x 2 kernel; 64 x 4 x 2 is the faster at 2
    and 8 tokens, 128 x 4 x 1 at 4 (whole decode step: batch 4 2.16 vs 2.31 ms, batch 8 3.66 vs 4.07 ms).
    """
    if forced is not None:
        return forced
    if rows is not None and tokens >= HMMA_MIN_TOKENS:
        return hmma_variant(rows)
    return "o128r4u1" if 3 <= tokens <= 5 else "o64r4u2"


# 2..16 tokens on fp16 tensor cores (kernels_ptx/q8_gemv_hmma.cu): each weight byte read once for every
# token of the step.  "hk<W>u<U>[r<R>]": blocks of 16 R rows, W warps splitting K, U Q8_0 blocks' loads in flight;
# kernel q8_hmma_t8_k<W>u<U> for up to 8 tokens, q8_hmma_t16_... for 9..16.  threads / rows / unroll as above.
# A trailing "p": two steps' loads in flight a warp (the next step's while this one computes; the same sums in the
# same order), for layouts whose warps take several steps.
HMMA_VARIANTS = {"hk8u4": Variant(256, 16, 4), "hk16u4": Variant(512, 16, 4), "hk8u4r2": Variant(256, 32, 4),
                 "hk4u4r2": Variant(128, 32, 4), "hk8u4p": Variant(256, 16, 4), "hk4u4p": Variant(128, 16, 4),
                 "hk4u4r2p": Variant(128, 32, 4), "hk2u4r2p": Variant(64, 32, 4)}
HMMA_MAX_TOKENS = 16
# at 2 tokens the fp32 row-outer layout still wins (H200: qwen3-8b Q8_0 step 4.41 against 5.02 ms; qwen3-1.7b
# gate_up 12.9 against 15.6 µs); from 3 the tensor cores (1.7B step 1.62 against 2.05 ms)
HMMA_MIN_TOKENS = 3


def hmma_variant(rows: int) -> str:
    """The hmma layout for a weight of `rows` rows: few rows take more warps along K (so the SMs still hold
    enough loads in flight), many rows fewer warps, and from 8192 rows each warp two row tiles.
    Measured on the H200 at qwen3-1.7b's shapes, 2..8 / 16 tokens (bench/results/2026-12-04-h200-hmma-steps.md):
    2048 rows k16u4 (o 3.9 / 4.9 µs; down 11.1 / 12.2 against k8u4's 15.2 / 22.1), 4096 k16u4 (5.7 / 9.5),
    6144 k8u4 (8.3 / 10.5), 12288 k4u4r2 (15.7 / 17.9 against k8u4's 16.2 / 20.3), the vocabulary k4u4r2."""
    if rows >= 8192:
        return "hk4u4r2"
    return "hk8u4" if rows >= 5000 else "hk16u4"


# Q4_K and Q6_K weights of one format on the same tensor cores (kernels_ptx/q4k_gemv_hmma.cu, q6k_gemv_hmma.cu):
# "hk<W>[r<R>]": blocks of 16 R rows, W warps splitting K by whole super-blocks (256 elements); kernel
# <q4k|q6k>_hmma_t8_k<W>[r<R>] for up to 8 tokens, ..._t16_... for 9..16.  unroll: unused (1).
# A trailing "p" as in HMMA_VARIANTS: two super-blocks' loads in flight a warp.
HMMA_BLOCK_VARIANTS = {"Q4_K": {"hk8": Variant(256, 16, 1), "hk4": Variant(128, 16, 1), "hk4r2": Variant(128, 32, 1),
                                "hk2r2": Variant(64, 32, 1), "hk4p": Variant(128, 16, 1), "hk4r2p": Variant(128, 32, 1),
                                "hk2r2p": Variant(64, 32, 1), "hk2p": Variant(64, 16, 1)},
                       "Q6_K": {"hk8": Variant(256, 16, 1), "hk4": Variant(128, 16, 1), "hk4r2": Variant(128, 32, 1),
                                "hk4p": Variant(128, 16, 1), "hk4r2p": Variant(128, 32, 1), "hk2r2p": Variant(64, 32, 1)}}
HMMA_Q4K_MIN_TOKENS = 2   # asked for by name; by default hmma_q4k_takes


def hmma_q4k_takes(rows: int, cols: int, tokens: int, fmt: str = "Q4_K") -> bool:
    """Whether a Q4_K or Q6_K step of `tokens` takes the tensor-core GEMV by default rather than the GEMVs (up to
    5 tokens) or the int8 GEMM (from 6).  Measured on the H200 at the qwen3-1.7b and qwen3-8b shapes
    (bench/results/2026-12-04-h200-q4k-hmma.md): at 2 tokens the GEMV wins everywhere; Q4_K at 3 tokens loses
    from 6144 rows (8B qkv 12.1 against 16.2 µs) and wins below (8B o 12.2 against 12.7), at 4 from 4096 rows;
    Q6_K at 3..4 tokens only from 8192 rows (the vocabulary: 171 against 188 µs; 8B down at 4 tokens 47.7
    against 42.0); from 5 tokens the tensor cores win (8B down, 8 tokens: Q4_K 35.4 against the GEMM's 55.4,
    Q6_K 47.9 against 54.0) except on few rows with a long K, where a block's eight warps hold too little of the
    row (1.7B down, 2048 x 6144: Q4_K 17.5 against 15.0, Q6_K 20.1 against 14.4)."""
    if not 3 <= tokens <= HMMA_MAX_TOKENS:
        return False
    if tokens <= 4:
        return rows >= (8192 if fmt == "Q6_K" else 6144 if tokens == 3 else 4096)
    return not (rows <= 2048 and cols >= 4096)


def hmma_q4k_variant(rows: int, cols: int, tokens: int = 8, fmt: str = "Q4_K") -> str:
    """The layout for a `fmt` weight of `rows` x `cols`: as many warps along K as there are super-blocks to
    share (up to 8); from 8192 rows two row tiles a warp (Q6_K: at 9..16 tokens; at up to 8 four warps of one,
    the vocabulary at 8 tokens 183 against 212 µs); at 9..16 tokens four warps from 5000 rows (8B qkv: 18.3
    against 25.4 µs; on fewer rows eight stay faster, 8B o 13.9 against 18.2)."""
    supers = cols // 256
    if rows >= 8192:
        if fmt == "Q6_K":
            return "hk4r2" if tokens > 8 else "hk4"
        return "hk4r2" if supers >= 4 else "hk2r2"
    if rows >= 5000 and tokens > 8:
        return "hk4"
    return "hk8" if supers >= 8 else "hk4"


def hmma_block_kernel_name(fmt: str, tokens: int, suffix: str, silu: bool) -> str:
    prefix = {"Q4_K": "q4k", "Q6_K": "q6k"}[fmt]
    return f"{prefix}_hmma_t{8 if tokens <= 8 else 16}_{suffix[1:]}" + ("_silu" if silu else "")


def parse_hmma_block(name: str) -> tuple[str, int, Variant, bool]:
    """(format, most tokens, variant, silu) of a q4k_hmma / q6k_hmma kernel name."""
    silu = name.endswith("_silu")
    core = name[:-len("_silu")] if silu else name
    fmt = {"q4k": "Q4_K", "q6k": "Q6_K"}[core[:3]]
    head, _, suffix = core[len("q4k_hmma_t"):].partition("_")
    return fmt, int(head), HMMA_BLOCK_VARIANTS[fmt]["h" + suffix], silu


def hmma_kernel_name(tokens: int, suffix: str, silu: bool) -> str:
    return f"q8_hmma_t{8 if tokens <= 8 else 16}_{suffix[1:]}" + ("_silu" if silu else "")


def parse_hmma(name: str) -> tuple[int, Variant, bool]:
    """(most tokens, variant, silu) of a q8_hmma kernel name."""
    silu = name.endswith("_silu")
    core = name[:-len("_silu")] if silu else name
    head, _, suffix = core[len("q8_hmma_t"):].partition("_")
    return int(head), HMMA_VARIANTS["h" + suffix], silu


def m1_variant(rows: int, cols: int, forced: str | None = None) -> str:
    """The variant suffix for a single-token GEMV of a rows x cols weight.

    `forced` (Options.gemv_m1: KESTREL_GEMV_M1=<suffix>, or KESTREL_GEMV_M1_ROWS=4 / 2, the older
    switch, meaning "r4" / "") wins.  Otherwise the layout measured fastest at the model shapes on the H200 with
    programmatic launch (bench/gpu_kernels.py, bench/results/2026-11-30-h200-gpu-kernels.md):
    long rows (K >= 4096) want 128 threads per row and 12 loads in flight each; the vocabulary
    projection one warp and four rows per block (a long grid of small blocks); tall K = 2048
    matrices two warps and eight rows, one pass over the row (4096 rows: four); few rows (2048)
    the 128 x 4 blocks.
    """
    if forced is not None:
        return forced
    if cols >= 4096:
        return "w128r4u3"     # K = 6144: 128 threads x 3 chunks cover a row in one pass
    if rows >= 65536:
        return "w32r4u4"
    if rows >= 6144:
        return "w64r8u2"
    if rows >= 4096:
        return "w64r4u2"
    return "r4"


def kernel_name(tokens: int, suffix: str, silu: bool) -> str:
    name = f"q8_gemv_m{tokens}" + (f"_{suffix}" if suffix else "")
    return name + ("_silu" if silu else "")


def parse(name: str) -> tuple[int, Variant, bool]:
    """(tokens, variant, silu) of a q8_gemv kernel name."""
    silu = name.endswith("_silu")
    core = name[:-len("_silu")] if silu else name
    head, _, suffix = core[len("q8_gemv_m"):].partition("_")
    tokens = int(head)
    return tokens, (VARIANTS if tokens == 1 else MULTI_VARIANTS)[suffix], silu
