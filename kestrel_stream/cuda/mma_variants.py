"""The tile shapes of kernels_ptx/q8_mma.cu (int8 tensor-core GEMM) and which one a step gets.

A variant is BM tokens x BN weight rows per block, WARPS_M x WARPS_N warps.  Kernel names are
q8_mma_<BM>x<BN> (+ "_silu").  Pure Python: the emulated device and the bench read it without a driver.
"""
from __future__ import annotations

import re
from typing import NamedTuple

MMA_MIN_TOKENS = 9      # up to 8 tokens the GEMV kernels stream the weights once; more go to tensor cores
SM_COUNT_HINT = 132     # blocks that fill an H100/H200; the choice below only needs the order of magnitude


class Tile(NamedTuple):
    tokens: int          # BM
    rows: int            # BN
    warps_m: int
    warps_n: int

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n


TILES = {"16x64": Tile(16, 64, 1, 4), "32x64": Tile(32, 64, 2, 2), "64x64": Tile(64, 64, 2, 2),
         "64x128": Tile(64, 128, 2, 4)}


def kernel_name(tile: str, silu_pairs: bool) -> str:
    return f"q8_mma_{tile}" + ("_silu" if silu_pairs else "")


def parse(name: str) -> tuple[Tile, bool]:
    """(tile, silu_pairs) of a q8_mma kernel name."""
    match = re.fullmatch(r"q8_mma_(\d+x\d+)(_silu)?", name)
    assert match and match.group(1) in TILES, f"not a q8_mma kernel: {name}"
    return TILES[match.group(1)], match.group(2) is not None


def blocks(tile: Tile, tokens: int, rows: int) -> int:
    return -(-rows // tile.rows) * -(-tokens // tile.tokens)


def choose_tile(tokens: int, rows: int) -> str:
    """The tile for a tokens x rows output: the fewest tokens of padding, then the biggest tile that
    still gives every SM a block (weight tiles are re-read once per token block; small grids idle SMs)."""
    if tokens <= 16:
        return "16x64"
    if tokens <= 32:
        return "32x64"
    return "64x128" if blocks(TILES["64x128"], tokens, rows) >= SM_COUNT_HINT else "64x64"
