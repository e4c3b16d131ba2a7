"""The tile shapes of kernels_ptx/q8_mma.cu (int8 tensor-core GEMM) and which one a step gets.

A variant is BM tokens x BN weight rows per block, WARPS_M x WARPS_N warps, BK of K per pipeline
stage.  Kernel names are q8_mma_<BM>x<BN>[k<BK>][p<stages>c<chunk>[x2][b<blocks>]] (+ "_silu"): without p,
q8_mma.cu's double-buffered tiles; with p, q8_mma_pipe.cu's few-token tiles (a ring of that many
weight stages, x quantised once per `chunk` of a block's K run, x2: the next chunk loaded ahead,
registers capped for `blocks` per SM).
A variant is a tile and its K split: "16x32k256" or "16x32k256s4" (4 blocks per output tile, each a
quarter of the K stages, merged by the last to finish: the grid's z).  Pure Python: the emulated device and the bench read it without a
driver.
"""
from __future__ import annotations

import re
from typing import NamedTuple

MMA_MIN_TOKENS = 9      # up to 8 tokens the GEMV kernels stream the weights once; more go to tensor cores


class Tile(NamedTuple):
    tokens: int          # BM
    rows: int            # BN
    warps_m: int
    warps_n: int
    k_step: int = 64     # BK: K per pipeline stage
    stages: int = 2      # weight stages in the cp.async ring: 2 = q8_mma.cu's double buffer, more = q8_mma_pipe.cu
    x_chunk: int = 0     # q8_mma_pipe.cu: K of x quantised into shared memory at once
    min_blocks: int = 1  # q8_mma_pipe.cu: blocks per SM the registers are capped for (__launch_bounds__)
    x_ahead: int = 1     # q8_mma_pipe.cu: 2 = the next x chunk loaded into registers while one is multiplied

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def splits_k(self) -> bool:
        """Compiled with split K: q8_mma.cu's 16-token tiles (its SPLIT_K) and every q8_mma_pipe.cu tile."""
        return self.tokens == 16 or self.pipelined

    @property
    def pipelined(self) -> bool:
        """A q8_mma_pipe.cu tile (weights and their fp16 scales by cp.async)."""
        return self.stages > 2


TILES = {"16x64": Tile(16, 64, 1, 4), "16x64k128": Tile(16, 64, 1, 4, 128), "16x32k256": Tile(16, 32, 1, 4, 256),
         "16x32k128": Tile(16, 32, 1, 4, 128), "16x16k256": Tile(16, 16, 1, 2, 256),
         "32x64": Tile(32, 64, 2, 2), "32x64k128": Tile(32, 64, 2, 2, 128), "64x64": Tile(64, 64, 2, 2),
         "64x128": Tile(64, 128, 2, 4),
         # q8_mma_pipe.cu: few-token tiles with a deeper weight ring and x quantised once per chunk
         **{name: Tile(bm, bn, 1, warps, bk, stages, chunk, blocks, 2 if "x2" in name else 1)
            for name, (bm, bn, bk, stages, chunk, warps, blocks) in {
                "16x64k128p3c512": (16, 64, 128, 3, 512, 4, 1), "16x64k128p3c256b4": (16, 64, 128, 3, 256, 4, 4),
                "16x64k64p4c512": (16, 64, 64, 4, 512, 4, 1), "16x64k64p4c256b4": (16, 64, 64, 4, 256, 4, 4),
                "16x32k256p3c512": (16, 32, 256, 3, 512, 4, 1), "16x128k64p3c256": (16, 128, 64, 3, 256, 8, 1),
                "32x64k64p4c256": (32, 64, 64, 4, 256, 4, 1), "32x64k128p3c256": (32, 64, 128, 3, 256, 4, 1),
                "32x128k64p3c128": (32, 128, 64, 3, 128, 8, 1), "64x64k64p4c128": (64, 64, 64, 4, 128, 4, 1),
                "16x64k128p4c128x2": (16, 64, 128, 4, 128, 4, 1), "16x64k64p4c128x2b4": (16, 64, 64, 4, 128, 4, 4),
                "32x64k64p4c128x2": (32, 64, 64, 4, 128, 4, 1),
            }.items()}}


def kernel_name(tile: str, silu_pairs: bool) -> str:
    return f"q8_mma_{tile}" + ("_silu" if silu_pairs else "")


def parse(name: str) -> tuple[Tile, bool]:
    """(tile, silu_pairs) of a q8_mma kernel name."""
    match = re.fullmatch(r"q8_mma_(\d+x\d+(?:k\d+)?(?:p\d+c\d+(?:x2)?(?:b\d+)?)?)(_silu)?", name)
    assert match and match.group(1) in TILES, f"not a q8_mma kernel: {name}"
    return TILES[match.group(1)], match.group(2) is not None


def choose_tile(tokens: int, rows: int) -> str:
    """The tile for a tokens x rows output, from bench/mma.py on the H200 (bench/results/*-mma.md).

    Up to 64 tokens (batched decode, short chunks) a step is latency-bound, one block per SM at most:
    16-token tiles win (a weight tile re-read per 16 tokens comes from L2), and for up to 4096 rows
    and 32 tokens the 32-row tile with 256-wide K stages, which doubles the blocks.  Prefill-sized
    steps want the 64 x 128 tile (least re-reading, most mma per load).
    """
    if tokens <= 32 and rows <= 4096:
        return "16x32k256"
    return "16x64" if tokens <= 64 else "64x128"


# Split K: up to 64 tokens a tile walks the whole K alone, and 2048 rows make 64 tiles for 132 SMs;
# splitting K gives enough blocks in flight.  Larger steps have tiles enough.
SPLIT_MAX_TOKENS = 64
# Blocks a split launch aims at, and the most splits: from bench/mma.py --sweep splits on the H200
# (bench/results/2026-12-01-h200-mma-split-winners.md): many short splits keep more weight bytes in
# flight than two waves of long ones (the 1.7B and 8B projections at 9..64 tokens: 20 % less time
# in all than a two-wave target, within 4 % of each shape's best split).
SPLIT_TARGET_BLOCKS = 12 * 132
MAX_SPLITS = 16
SMALL_STEP_TILES = ("16x32k256", "16x64", "16x64k128", "16x128k64p3c256")   # what choose_tile and split_tile give up to SPLIT_MAX_TOKENS


def variant_name(tile: str, splits: int) -> str:
    return tile if splits == 1 else f"{tile}s{splits}"


def parse_variant(name: str) -> tuple[str, int]:
    """(tile, splits) of a variant name: "16x32k256" -> ("16x32k256", 1), "16x32k256s4" -> (.., 4)."""
    match = re.fullmatch(r"(\d+x\d+(?:k\d+)?(?:p\d+c\d+(?:x2)?(?:b\d+)?)?)(?:s(\d+))?", name)
    if not match or match.group(1) not in TILES:
        raise ValueError(f"not a q8_mma variant: {name!r} (a tile of {', '.join(TILES)}, optionally + s<splits>)")
    return match.group(1), int(match.group(2) or 1)


def stages(k: int, tile: Tile) -> int:
    return -(-k // tile.k_step)


def split_is_valid(k: int, tile: Tile, splits: int) -> bool:
    """Every one of `splits` runs of ceil(stages / splits) K stages is non-empty (the kernel's split rule),
    on a tile compiled with split K."""
    total = stages(k, tile)
    return splits == 1 or (tile.splits_k and splits <= total and (splits - 1) * -(-total // splits) < total)


def blocks_per_split(k: int, tile: Tile, splits: int) -> int:
    """Q8_0 blocks (32 of K) each split walks (the last may walk fewer)."""
    return -(-stages(k, tile) // splits) * (tile.k_step // 32)


def choose_splits(tokens: int, rows: int, k: int, tile_name: str) -> int:
    """K splits for a tokens x rows x k step on `tile_name`: enough blocks for SPLIT_TARGET_BLOCKS, each
    split at least two K stages (the double buffer's depth), none empty; 1 beyond SPLIT_MAX_TOKENS."""
    tile = TILES[tile_name]
    tiles = -(-rows // tile.rows) * -(-tokens // tile.tokens)
    if tile.pipelined:
        return _pipelined_splits(tokens, tiles, k, tile)
    if tokens > SPLIT_MAX_TOKENS or tiles >= SPLIT_TARGET_BLOCKS:
        return 1
    splits = min(-(-SPLIT_TARGET_BLOCKS // tiles), max(stages(k, tile) // 2, 1), MAX_SPLITS)
    per_split = -(-stages(k, tile) // splits)
    return -(-stages(k, tile) // per_split)        # the same runs, none left empty


# The pipelined tile of few-token steps of up to PIPE_MAX_ROWS rows (qkv, o, down), and the blocks its
# splits aim at: from bench/mma.py --sweep splits on the H200 (bench/results/2026-12-01-h200-mma-split-
# winners-pipelined.md): each split a power-of-two share of the x chunks, about two waves of blocks --
# within 5 % of the best split of each qwen3-1.7b projection at 9..64 tokens, 10-20 % under the
# double-buffered tiles' best.
PIPE_TILE = "16x128k64p3c256"
PIPE_MAX_ROWS = 8192
PIPE_TARGET_BLOCKS = 256


def _pipelined_splits(tokens: int, tiles: int, k: int, tile: Tile) -> int:
    if tokens > SPLIT_MAX_TOKENS or tiles >= PIPE_TARGET_BLOCKS:
        return 1
    chunks = -(-k // tile.x_chunk)
    splits = 1
    while splits * 2 <= min(PIPE_TARGET_BLOCKS // tiles, chunks, MAX_SPLITS) and split_is_valid(k, tile, splits * 2):
        splits *= 2
    return splits


def split_tile(tokens: int, rows: int) -> str:
    """The tile of a step that may split K: up to PIPE_MAX_ROWS rows the pipelined PIPE_TILE; wider
    (gate_up, lm_head) up to 32 tokens the 16 x 64 tile with 128-wide K stages, up to 64 the 16 x 64
    one; choose_tile's beyond SPLIT_MAX_TOKENS."""
    if tokens > SPLIT_MAX_TOKENS:
        return choose_tile(tokens, rows)
    if rows <= PIPE_MAX_ROWS:
        return PIPE_TILE
    return "16x64k128" if tokens <= 32 else "16x64"


def choose_variant(tokens: int, rows: int, k: int) -> str:
    """split_tile's tile with choose_splits' split count."""
    tile = split_tile(tokens, rows)
    return variant_name(tile, choose_splits(tokens, rows, k, tile))


def grid(tokens: int, rows: int, tile_name: str, splits: int) -> tuple[int, int, int]:
    tile = TILES[tile_name]
    return -(-rows // tile.rows), -(-tokens // tile.tokens), splits


def scratch_floats(tokens: int, rows: int, tile_name: str, splits: int) -> tuple[int, int]:
    """(partial floats, tickets) a split launch needs: a BM x BN tile per block, a ticket per tile."""
    if splits == 1:
        return 0, 0
    gx, gy, _ = grid(tokens, rows, tile_name, splits)
    tile = TILES[tile_name]
    return gx * gy * splits * tile.tokens * tile.rows, gx * gy


def scratch_bound(max_tokens: int) -> tuple[int, int]:
    """(partial floats, tickets) enough for every choose_variant launch of up to `max_tokens` tokens, of any
    row count or K: a split launch has fewer than SPLIT_TARGET_BLOCKS tiles and, splitting them, fewer than
    2 x SPLIT_TARGET_BLOCKS blocks."""
    if max_tokens < MMA_MIN_TOKENS:
        return 0, 0
    area = max(TILES[name].tokens * TILES[name].rows for name in SMALL_STEP_TILES)
    return 2 * SPLIT_TARGET_BLOCKS * area, SPLIT_TARGET_BLOCKS


class SplitScratch(NamedTuple):
    """Device memory of split launches: float32 partial tiles and zeroed uint32 tickets (each launch's last
    split resets the ones it took)."""
    partials: int
    partial_floats: int
    tickets: int
    ticket_count: int


# ---- fp16 tensor-core tiles for prefill-sized steps without the dense path: kernels_ptx/q8_mma_f16_ws.cu ------
# (gpu mode's steps of 128+ tokens take the dense path, cuda/dense_gemm.py; these serve the device steps of
# gated and layers=N modes, which have no dense scratch)

F16_MIN_TOKENS = 128    # steps of this many tokens or more take the fp16 GEMM (bench/mma.py sweeps it)


class F16Tile(NamedTuple):
    tokens: int          # BM
    rows: int            # BN
    warps_m: int
    warps_n: int
    k_step: int = 32     # BK: K per pipeline stage
    stages: int = 4      # weight tiles in flight (cp.async ring)
    min_blocks: int = 1  # blocks per SM the registers are capped for (__launch_bounds__)
    # the weight tile dequantised once per block into fp16 shared memory, fragments by ldmatrix (dynamic
    # shared memory, shared_bytes): every tile of q8_mma_f16_ws.cu
    weights_in_shared: bool = True
    x_async: bool = False    # x by cp.async into a `stages`-deep fp32 ring, not registers (_xa)

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory a launch passes: the int8 ring (stages x BN x BK), with x_async the fp32 x
        ring (stages x BM x BK floats), and two fp16 weight and x tiles ((BN + BM) x BK halves each)."""
        x_ring = self.stages * self.tokens * self.k_step * 4 if self.x_async else 0
        return self.stages * self.rows * self.k_step + x_ring + 2 * (self.rows + self.tokens) * self.k_step * 2


# the tiles of q8_mma_f16_ws.cu (weights_in_shared): q8_f16mma_<BM>x<BN>[k<BK>]_ws[_xa]_s<stages>[_b<min_blocks>];
# the f16_ prefix keeps gemv_launch's variant names apart from TILES'.  choose_f16_tile picks the first three.
F16_WS_TILES = {"f16_64x64k64_ws_xa_s3_b2": F16Tile(64, 64, 2, 2, 64, stages=3, min_blocks=2, weights_in_shared=True,
                                                    x_async=True),
                "f16_128x256_ws_xa_s4": F16Tile(128, 256, 2, 4, 32, stages=4, weights_in_shared=True, x_async=True),
                "f16_64x128k64_ws_s4_b2": F16Tile(64, 128, 2, 4, 64, stages=4, min_blocks=2, weights_in_shared=True),
                "f16_128x128k64_ws_s3": F16Tile(128, 128, 2, 4, 64, stages=3, weights_in_shared=True),
                "f16_128x128_ws_xa_s3_b2": F16Tile(128, 128, 2, 4, 32, stages=3, min_blocks=2, weights_in_shared=True,
                                                   x_async=True)}
F16_TILES = dict(F16_WS_TILES)


def f16_kernel_name(tile: str, silu_pairs: bool) -> str:
    return "q8_f16mma_" + tile.removeprefix("f16_") + ("_silu" if silu_pairs else "")


def f16_parse(name: str) -> tuple[F16Tile, bool]:
    """(tile, silu_pairs) of a q8_f16mma kernel name."""
    match = re.fullmatch(r"q8_f16mma_(\d+x\d+(?:k\d+)?(?:w\d+)?(?:_ws)?(?:_xa)?(?:_s\d+)?(?:_x\d+)?(?:_b\d+)?)(_silu)?", name)
    assert match and "f16_" + match.group(1) in F16_TILES, f"not a q8_f16mma kernel: {name}"
    return F16_TILES["f16_" + match.group(1)], match.group(2) is not None


def uses_f16(tokens: int, variant: str | None = None) -> bool:
    """Whether a GEMM of `tokens` rows of x runs q8_mma_f16_ws.cu: a tile of F16_TILES asked for by name,
    or by default every step of F16_MIN_TOKENS tokens and more."""
    return variant in F16_TILES if variant is not None else tokens >= F16_MIN_TOKENS


def choose_f16_tile(tokens: int, rows: int, sm_count: int = 132, k: int = 0) -> str:
    """The fp16 tile for a tokens x rows (x k) output, from bench/mma_prefill.py on the H200
    (bench/results/2026-12-01-h200-mma-prefill-ws.md; within 3 % in all of every qwen3-1.7b/8b layer
    shape's best at 128..2048 tokens): the weight-in-shared-memory tiles -- 64 x 64 while 64 x 128 tiles
    would not give every SM a block, 128 x 256 for the largest steps (2,048 tokens, or K of 4,096 and
    more with two waves of such tiles), else 64 x 128 with 64-wide K stages."""
    for name in ("f16_64x64k64_ws_xa_s3_b2", "f16_128x256_ws_xa_s4", "f16_64x128k64_ws_s4_b2"):
        assert name in F16_TILES, name
    if -(-rows // 128) * -(-tokens // 64) <= sm_count:
        return "f16_64x64k64_ws_xa_s3_b2"
    if tokens >= 2048 or (k >= 4096 and -(-rows // 256) * -(-tokens // 128) >= 2 * sm_count):
        return "f16_128x256_ws_xa_s4"
    return "f16_64x128k64_ws_s4_b2"
