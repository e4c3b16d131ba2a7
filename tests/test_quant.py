"""Q8_0 quantization: error bounds, and byte equality with the gguf package's reference."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from kestrel_stream.model.quant import GROUP, QTensor, quantize


def awkward_matrix(rng, rows=64, cols=256):
    """Random rows at many magnitudes, plus all-zero, tie-breaking and single-spike groups."""
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x *= np.float32(10.0) ** rng.integers(-6, 4, size=(rows, 1)).astype(np.float32)
    x[0, :GROUP] = 0                                  # d == 0: ggml stores 0 and q = 0
    x[1, :GROUP] = np.arange(GROUP) - 15.5            # halves: roundf goes away from zero
    x[2, :GROUP] = 0
    x[2, 7] = -3.0                                    # one spike: it alone maps to -127
    x[3, :GROUP] = 127 * (np.arange(GROUP) % 5 - 2) / 2 + 0.5   # exact .5 multiples of d
    return x


def test_quantize_matches_gguf_reference_byte_for_byte():
    x = awkward_matrix(np.random.default_rng(0))
    ours = quantize(x).to_blocks()
    reference = gguf_quants.quantize(x, GGMLQuantizationType.Q8_0)
    assert ours.dtype == reference.dtype == np.uint8
    assert np.array_equal(ours, reference)


def test_quantize_in_row_chunks_equals_whole():
    x = awkward_matrix(np.random.default_rng(1), rows=100)
    whole, chunked = quantize(x), quantize(x, rows_per_chunk=7)
    assert np.array_equal(whole.qs, chunked.qs)
    assert np.array_equal(whole.scales.view(np.uint16), chunked.scales.view(np.uint16))


def test_dequantize_matches_gguf_reference():
    x = awkward_matrix(np.random.default_rng(2))
    q = quantize(x)
    reference = gguf_quants.dequantize(q.to_blocks(), GGMLQuantizationType.Q8_0)
    assert np.array_equal(q.dequantize(), reference.reshape(x.shape))


def test_round_trip_error_is_half_a_step_when_the_scale_is_exact_in_fp16():
    # max|x| = 127 * 2^e makes d a power of two, so fp16(d) == d and the bound is exactly d/2.
    rng = np.random.default_rng(3)
    x = rng.uniform(-1, 1, size=(32, 128)).astype(np.float32)
    groups = x.reshape(32, -1, GROUP)
    exponents = rng.integers(-10, 3, size=groups.shape[:2])
    d = np.ldexp(np.float32(1), exponents).astype(np.float32)
    groups *= (127 * d / np.abs(groups).max(axis=2))[:, :, None]
    q = quantize(x)
    scale = np.repeat(q.scales.astype(np.float32), GROUP, axis=1)
    assert np.array_equal(q.scales.astype(np.float32), d)
    assert np.all(np.abs(x - q.dequantize()) <= scale / 2)


def test_round_trip_error_bound_in_general():
    # |x - q*d| <= d/2 with the float32 d ggml computes; storing d as fp16 adds at most
    # 127 * |fp16(d) - d| (q is at most 127 in magnitude).
    x = awkward_matrix(np.random.default_rng(4))
    q = quantize(x)
    d32 = np.abs(x.reshape(x.shape[0], -1, GROUP)).max(axis=2) / np.float32(127)
    scale = q.scales.astype(np.float32)
    step = np.repeat(d32, GROUP, axis=1)
    bound = np.repeat(scale / 2 + 127 * np.abs(scale - d32), GROUP, axis=1)
    assert np.all(np.abs(x - q.qs * step) <= step / 2 * (1 + 1e-6))
    assert np.all(np.abs(x - q.dequantize()) <= bound * (1 + 1e-6))
    assert np.all(np.abs(q.qs.astype(np.int32)) <= 127)


def test_blocks_round_trip_is_lossless():
    q = quantize(awkward_matrix(np.random.default_rng(5)))
    back = QTensor.from_blocks(q.to_blocks(), q.shape)
    assert np.array_equal(back.qs, q.qs)
    assert np.array_equal(back.scales.view(np.uint16), q.scales.view(np.uint16))


@pytest.mark.parametrize("cols", [32, 96])
def test_concat_is_rowwise_and_exact(cols):
    rng = np.random.default_rng(6)
    parts = [rng.standard_normal((n, cols)).astype(np.float32) for n in (3, 5, 2)]
    fused = QTensor.concat([quantize(p) for p in parts])
    whole = quantize(np.concatenate(parts))
    assert np.array_equal(fused.qs, whole.qs)
    assert np.array_equal(fused.scales.view(np.uint16), whole.scales.view(np.uint16))
