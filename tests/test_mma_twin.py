"""CI (no GPU): the numpy twin of the tensor-core GEMM (fake_kernels.mma_product) computes what
kernels_ptx/q8_mma.cu is specified to, and the tile choice covers every shape."""
import numpy as np
import pytest

from fake_kernels import mma_product, quantize_rows_q8
from kestrel_stream.cuda import mma_variants
from kestrel_stream.model.quant import quantize


def test_two_level_activations_reconstruct_to_a_256th_of_a_level():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((9, 96)) * np.array([1e-3, 1.0, 30.0])[:, None].repeat(32, 1).reshape(1, -1)
         ).astype(np.float32)
    x[3, 32:64] = 0.0
    hi, lo, d = quantize_rows_q8(x)
    assert hi.dtype == lo.dtype == np.int8 and d.shape == (9, 3)
    assert np.abs(hi).max() == 127 and np.abs(lo).max() <= 64      # lo holds what hi rounded away
    back = (128 * hi.astype(np.float64) + lo) * (d[:, :, None] / 128)
    error = np.abs(back - x.reshape(9, 3, 32))
    assert (error <= d[:, :, None] / 256 * 1.001 + 1e-12).all()
    assert d[3, 1] == 0 and not hi[3, 1].any() and not lo[3, 1].any()


@pytest.mark.parametrize("tokens,n,k", [(9, 96, 160), (65, 64, 544), (200, 288, 96)])
def test_mma_product_matches_fp32_activations(tokens, n, k):
    """Within 1e-4 of dequantise-then-multiply in fp32 (the CPU engine's arithmetic)."""
    rng = np.random.default_rng(tokens + n)
    w = quantize(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k))
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    want = x @ w.dequantize().T
    got = mma_product(x, w.qs, w.scales)
    assert got.dtype == np.float32 and got.shape == (tokens, n)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


@pytest.mark.parametrize("tokens", [9, 16, 17, 32, 33, 63, 64, 65, 200, 511])
@pytest.mark.parametrize("rows", [96, 2048, 6144, 151936])
def test_tile_choice_pads_at_most_a_tile(tokens, rows):
    tile = mma_variants.TILES[mma_variants.choose_tile(tokens, rows)]
    padded = -(-tokens // tile.tokens) * tile.tokens
    assert padded - tokens < tile.tokens
    assert tokens > 64 or tile.tokens == 16, "decode batches of 9..64 sessions get a 16-token tile"
    name = mma_variants.kernel_name(mma_variants.choose_tile(tokens, rows), True)
    assert mma_variants.parse(name) == (tile, True)


@pytest.mark.parametrize("blocks_per_split", [1, 3, 8])
def test_split_product_sums_runs_of_blocks_in_order(blocks_per_split):
    """Split K changes only where the fp32 sums break: each run of blocks summed alone, the runs added in
    order -- the unsplit product of each run's slice of K, then added."""
    rng = np.random.default_rng(blocks_per_split)
    tokens, n, k = 17, 64, 32 * 11
    w = quantize(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k))
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    got = mma_product(x, w.qs, w.scales, blocks_per_split)
    runs = [mma_product(x[:, 32 * b:32 * (b + blocks_per_split)], w.qs[:, 32 * b:32 * (b + blocks_per_split)],
                        w.scales[:, b:b + blocks_per_split]) for b in range(0, k // 32, blocks_per_split)]
    want = runs[0]
    for run in runs[1:]:
        want = want + run
    np.testing.assert_array_equal(got, want)
    unsplit = mma_product(x, w.qs, w.scales)
    assert np.abs(got - unsplit).max() / np.abs(unsplit).max() < 1e-5


@pytest.mark.parametrize("tokens", [9, 16, 17, 32, 33, 63, 64, 65, 128, 512])
@pytest.mark.parametrize("rows,k", [(4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144), (6144, 4096),
                                    (4096, 12288), (24576, 4096), (151936, 2048), (1024, 2048), (96, 96),
                                    (288, 1056)])
def test_chosen_split_fills_the_sms_and_fits_the_scratch_bound(tokens, rows, k):
    variant = mma_variants.choose_variant(tokens, rows, k)
    tile_name, splits = mma_variants.parse_variant(variant)
    tile = mma_variants.TILES[tile_name]
    assert tile_name == mma_variants.split_tile(tokens, rows)
    assert splits <= mma_variants.MAX_SPLITS
    assert mma_variants.split_is_valid(k, tile, splits), variant
    gx, gy, gz = mma_variants.grid(tokens, rows, tile_name, splits)
    if tile.pipelined:               # a power of two of x chunks per split, up to about PIPE_TARGET_BLOCKS blocks
        assert splits & (splits - 1) == 0 and gx * gy * splits <= max(gx * gy, mma_variants.PIPE_TARGET_BLOCKS), variant
        doubled = 2 * splits
        assert (tokens > mma_variants.SPLIT_MAX_TOKENS or gx * gy * doubled > mma_variants.PIPE_TARGET_BLOCKS
                or doubled > -(-k // tile.x_chunk) or doubled > mma_variants.MAX_SPLITS
                or not mma_variants.split_is_valid(k, tile, doubled)), variant
    elif tokens > mma_variants.SPLIT_MAX_TOKENS or gx * gy >= mma_variants.SPLIT_TARGET_BLOCKS:
        assert splits == 1, variant
    else:   # the target's blocks but for the rounding to runs of equal length, or the most splits, or the
            # shortest runs (two K stages: the double buffer's depth)
        total = mma_variants.stages(k, tile)
        per_split = -(-total // splits)
        shortest = -(-total // max(total // 2, 1))
        assert (gx * gy * gz * per_split >= mma_variants.SPLIT_TARGET_BLOCKS * (per_split - 1)
                or splits == mma_variants.MAX_SPLITS or per_split == shortest), variant
        assert splits == 1 or per_split >= 2, variant
    floats, tickets = mma_variants.scratch_floats(tokens, rows, tile_name, splits)
    bound_floats, bound_tickets = mma_variants.scratch_bound(max(tokens, 64))
    assert floats <= bound_floats and tickets <= bound_tickets, (variant, floats, tickets)
    assert (floats == 0) == (splits == 1)


def test_variant_names_round_trip_and_bad_ones_say_what():
    assert mma_variants.parse_variant("16x32k256") == ("16x32k256", 1)
    assert mma_variants.parse_variant("16x32k256s4") == ("16x32k256", 4)
    assert mma_variants.variant_name("64x128", 1) == "64x128" and mma_variants.variant_name("16x64", 3) == "16x64s3"
    for bad in ("16x48", "16x64s", "s4", "16x64k128x2"):
        with pytest.raises(ValueError, match="q8_mma variant"):
            mma_variants.parse_variant(bad)
    assert not mma_variants.split_is_valid(2048, mma_variants.TILES["16x32k256"], 9), "8 stages: 9 splits"
    assert not mma_variants.split_is_valid(1024, mma_variants.TILES["16x64"], 7), "16 stages in runs of 3: 6 used"
    assert mma_variants.scratch_bound(8) == (0, 0), "steps of up to 8 tokens run the GEMV"
    for name, tile in mma_variants.TILES.items():   # prefill-sized tiles are compiled without split K
        assert mma_variants.split_is_valid(4096, tile, 2) == (tile.tokens == 16 or tile.stages > 2), name
    assert set(mma_variants.SMALL_STEP_TILES) <= {name for name, tile in mma_variants.TILES.items() if tile.splits_k}


def test_pipelined_tiles_match_the_kernel_source():
    """Every q8_mma_pipe.cu kernel is a TILES entry with the same BM x BN, BK, stages, x chunk, warps and
    register cap, and every pipelined TILES entry is defined there; each fits 48 KB of static shared memory."""
    import re
    from kernels_ptx.build import source_dir
    text = (source_dir() / "q8_mma_pipe.cu").read_text()
    defined = {m.group(9): (*(int(v) for v in m.groups()[:5]), m.group(6) == "true", int(m.group(7)), int(m.group(8)))
               for m in re.finditer(r"^DEFINE_PIPE_PAIR\((\d+), (\d+), (\d+), (\d+), (\d+), (true|false), (\d+), "
                                    r"(\d+), (\w+)\)", text, re.M)}
    pipelined = {name: tile for name, tile in mma_variants.TILES.items() if tile.pipelined}
    assert set(defined) == set(pipelined) and len(defined) >= 4
    for name, (bm, bn, bk, stages, chunk, ahead, warps, blocks) in defined.items():
        tile = pipelined[name]
        assert (tile.tokens, tile.rows, tile.k_step, tile.stages, tile.x_chunk, tile.x_ahead, tile.warps_m,
                tile.warps_n, tile.min_blocks) == (bm, bn, bk, stages, chunk, 2 if ahead else 1, 1, warps, blocks), name
        assert chunk % bk == 0 and name == (f"{bm}x{bn}k{bk}p{stages}c{chunk}" + ("x2" if ahead else "")
                                            + (f"b{blocks}" if blocks > 1 else ""))
        shared = (stages * bn * (bk + 16) + 4 * stages * bn * (bk // 64 + 1) + 2 * bm * (chunk + 16)
                  + 4 * bm * (chunk // 32) + 4 * warps * bm)
        assert shared <= 48 << 10 and blocks * shared <= 228 << 10, (name, shared)
        assert mma_variants.parse(mma_variants.kernel_name(name, True)) == (tile, True)
        assert mma_variants.parse_variant(name + "s4") == (name, 4)
