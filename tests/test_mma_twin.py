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
