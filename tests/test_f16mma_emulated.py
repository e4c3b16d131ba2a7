"""CI (no GPU): the fp16 tensor-core GEMM of prefill-sized steps without the dense path (kernels_ptx/q8_mma_f16_ws.cu) through its
numpy twin (fake_f16mma): its arithmetic, which steps get it, its tile table against the kernel source,
and gpu mode's prefill logits through it against the CPU engine."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import fake_cuda
import fake_f16mma
from hf_oracle import relative_error
from kernels_ptx import build
from kestrel_stream.cuda import mma_variants
from bench.synthetic import random_q8_weights
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.model.quant import quantize
from kestrel_stream.run.engine import Engine

QWEN3 = ModelConfig(arch="qwen3", hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=256,
                    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                    max_position_embeddings=512)
LLAMA = dataclasses.replace(QWEN3, arch="llama", rope_theta=500000.0, tie_word_embeddings=False)


def test_weights_round_once_to_fp16_and_products_sum_in_fp32():
    rng = np.random.default_rng(3)
    w = quantize(rng.standard_normal((96, 160)).astype(np.float32) / np.sqrt(160))
    w16 = fake_f16mma.f16_weights(w.qs, w.scales)
    assert w16.dtype == np.float16
    np.testing.assert_array_equal(w16, w.dequantize().astype(np.float16))   # the CPU engine's weight, rounded
    x = rng.standard_normal((130, 160)).astype(np.float32)
    got, want = fake_f16mma.f16mma_product(x, w.qs, w.scales), x @ w.dequantize().T
    assert got.dtype == np.float32 and got.shape == (130, 96)
    assert 1e-5 < relative_error(got, want) < 2e-3     # fp16 rounding shows, and stays small
    exact16 = x.astype(np.float16).astype(np.float64) @ w16.astype(np.float64).T
    assert relative_error(got, exact16) < 1e-6


def test_a_residual_stream_past_fp16_range_is_normed_before_rounding():
    """With inv_rms_in, x is scaled per token before it becomes fp16: a raw residual stream of 3e5
    (fp16 holds 65504) gives the normed product, not inf."""
    rng = np.random.default_rng(4)
    w = quantize(rng.standard_normal((64, 96)).astype(np.float32) / np.sqrt(96))
    x = rng.standard_normal((5, 96)).astype(np.float32)
    inv_rms = np.full(5, 1 / 3e5, np.float32)
    got = fake_f16mma.f16mma_product(x * np.float32(3e5), w.qs, w.scales, inv_rms)
    assert relative_error(got, x @ w.dequantize().T) < 2e-3


def test_tile_table_matches_the_kernel_source():
    """Every tile the launcher can pick is instantiated in q8_mma_f16_ws.cu with the same shape, warps, BK,
    stages and x ring (plain and _silu), with the dynamic shared memory the kernel lays out, min_blocks of
    them to an SM; choose_f16_tile picks only tiles of the table."""
    ws_source = (build.source_dir() / "q8_mma_f16_ws.cu").read_text()
    ws_pattern = r"^DEFINE_F16MMA_WS_PAIR\(" + ", ".join([r"(\d+)"] * 8) + r", (\w+)\)"
    ws_defined = {"f16_" + m[8]: mma_variants.F16Tile(int(m[0]), int(m[1]), int(m[3]), int(m[4]), k_step=int(m[2]),
                                                      stages=int(m[5]), min_blocks=int(m[7]), weights_in_shared=True,
                                                      x_async=m[6] == "1")
                  for m in re.findall(ws_pattern, ws_source, flags=re.M)}
    assert ws_defined == mma_variants.F16_WS_TILES == mma_variants.F16_TILES and len(ws_defined) >= 4
    assert "q8_mma_f16_ws.cu" in build.KERNEL_SOURCES
    for name, tile in mma_variants.F16_TILES.items():
        x_ring = tile.stages * tile.tokens * tile.k_step * 4 if tile.x_async else 0
        assert tile.shared_bytes == (tile.stages * tile.rows * tile.k_step + x_ring
                                     + 2 * (tile.rows + tile.tokens) * tile.k_step * 2), name
        assert ("_xa_" in name) == tile.x_async, name
        assert tile.k_step in (32, 64) and tile.min_blocks * tile.shared_bytes <= 227 * 1024, name
        assert tile.rows % (16 * tile.warps_n) == 0, (name, "B fragments come two n tiles per ldmatrix.x4")
        assert tile.tokens % (16 * tile.warps_m) == 0 and tile.rows % (8 * tile.warps_n) == 0, name
        for silu in (False, True):
            assert mma_variants.f16_parse(mma_variants.f16_kernel_name(name, silu)) == (tile, silu)
    for tokens in (128, 512, 2048):
        for rows, k in ((2048, 2048), (24576, 4096), (151936, 2048)):
            assert mma_variants.choose_f16_tile(tokens, rows, k=k) in mma_variants.F16_TILES


@pytest.mark.parametrize("tokens", [9, 64, 127, 128, 200, 511, 512, 513, 2048])
@pytest.mark.parametrize("rows", [96, 2048, 12288, 151936])
def test_steps_from_the_threshold_on_take_the_fp16_gemm(monkeypatch, tokens, rows):
    fake_cuda.install(monkeypatch)
    from kestrel_stream.cuda.kernels import KernelSet, QWeight, gemv_launch
    launch = gemv_launch(KernelSet(), QWeight(0, 0, rows, 64), 0, 64, 0, rows, tokens)
    if tokens >= mma_variants.F16_MIN_TOKENS:
        tile, silu = mma_variants.f16_parse(launch.name)
        assert launch.grid[:2] == (-(-rows // tile.rows), -(-tokens // tile.tokens)) and not silu
        assert launch.block[0] == tile.threads
    else:
        assert launch.name.startswith("q8_mma_" if tokens > 16 else "q8_hmma_t16_" if tokens > 8 else "q8_gemv_")
    forced = gemv_launch(KernelSet(), QWeight(0, 0, rows, 64), 0, 64, 0, rows, max(tokens, 9),
                         variant="f16_128x128k64_ws_s3", silu_pairs=True)
    assert forced.name == "q8_f16mma_128x128k64_ws_s3_silu"
    int8 = gemv_launch(KernelSet(), QWeight(0, 0, rows, 64), 0, 64, 0, rows, max(tokens, 9), variant="64x128")
    assert int8.name == "q8_mma_64x128", "an int8 tile asked for by name stays int8 at any token count"
    assert not set(mma_variants.F16_TILES) & set(mma_variants.TILES)


@pytest.fixture
def f16_calls(monkeypatch):
    """The emulated device with gpu mode's dense path off (as the device steps of gated and layers=N modes
    run: no dense scratch), and the (tokens, kernel) of every fp16 GEMM launch that ran."""
    from kestrel_stream.run.device import dense_path
    fake_cuda.install(monkeypatch, mode="deferred")
    monkeypatch.setattr(dense_path, "open_blas", lambda options, config, max_tokens: (None, None))
    calls = []
    twin = fake_f16mma.q8_f16mma

    def counting(launch, *args):
        calls.append((args[15], launch.name))
        twin(launch, *args)
    monkeypatch.setattr(fake_f16mma, "q8_f16mma", counting)
    return calls


def assert_same_argmax_where_decided(got, want, tolerance=2e-3):
    """Identical argmax on every row whose reference top two differ by more than twice the error bound
    (tolerance x max |logit|): over hundreds of rows of a random model a few are near-ties, which any
    arithmetic 2e-3 away from fp32 may order either way.  Nearly every row must be decided."""
    top2 = np.sort(want, axis=1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] > 2 * tolerance * np.abs(want).max()
    assert decided.mean() > 0.9, decided.mean()
    np.testing.assert_array_equal(got.argmax(axis=1)[decided], want.argmax(axis=1)[decided])


@pytest.mark.parametrize("cfg", [QWEN3, LLAMA], ids=["qwen3", "llama"])
def test_prefill_through_the_fp16_gemm_tracks_the_cpu_engine(f16_calls, cfg):
    """A 200-token prompt in one step (every projection and lm_head on the fp16 GEMM), then 130 more
    continuing it, then decodes on the int8 kernels: logits within 2e-3 of the CPU engine, the same argmax
    wherever the CPU engine's is not a near-tie."""
    weights = random_q8_weights(cfg, seed=11)
    cpu = Engine(weights, device="cpu", max_seq_len=400)
    # max_batch 256: logits buffered for 256 rows, so a prompt of 200 runs in one step, all rows wanted
    gpu = Engine(weights, device="cuda", mode="gpu", max_seq_len=400, max_batch=256)
    rng = np.random.default_rng(2)
    first, second = ([int(t) for t in rng.integers(1, 250, n)] for n in (200, 130))
    with cpu.new_session() as ref, gpu.new_session() as s:
        for chunk in (first, second):
            want, got = ref.prefill(chunk), s.prefill(chunk)
            assert relative_error(got, want) < 2e-3
            assert_same_argmax_where_decided(got, want)
        per_step = 4 * cfg.num_hidden_layers + 1          # qkv, o, gate_up, down per layer + lm_head
        assert sorted({tokens for tokens, _ in f16_calls}) == [130, 200], f16_calls
        assert len(f16_calls) == 2 * per_step, f16_calls
        assert any(name.endswith("_silu") for _, name in f16_calls)
        token = int(np.argmax(want[-1]))
        for _ in range(2):
            want, got = ref.decode(token), s.decode(token)
            assert relative_error(got, want) < 2e-3 and int(np.argmax(got)) == int(np.argmax(want))
            token = int(np.argmax(want))
        assert len(f16_calls) == 2 * per_step, "decode steps stay on the GEMV"


@pytest.mark.parametrize("tile", list(mma_variants.F16_WS_TILES))
def test_weights_in_shared_tiles_launch_with_their_dynamic_shared_memory(monkeypatch, tile):
    """A _ws tile asked for by name runs q8_mma_f16_ws.cu's kernel with F16Tile.shared_bytes of dynamic
    shared memory, and the twin (which checks that byte count) gives fp16 x fp16 -> fp32 products."""
    fake_cuda.install(monkeypatch)
    from kestrel_stream.cuda import driver
    from kestrel_stream.cuda.kernels import KernelSet, QWeight, gemv_launch
    rng = np.random.default_rng(6)
    n, k, tokens = 160, 224, 130
    w = quantize(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k))
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    arena = driver.Arena(1 << 20)
    qs, scales, xd = (arena.alloc(a.nbytes) for a in (w.qs, w.scales, x))
    for ptr, a in ((qs, w.qs), (scales, w.scales), (xd, x)):
        driver.h2d_sync(ptr, a)
    y = arena.alloc(4 * tokens * n)
    launch = gemv_launch(KernelSet(), QWeight(qs, scales, n, k), xd, k, y, n, tokens, variant=tile)
    assert launch.name == "q8_f16mma_" + tile.removeprefix("f16_")
    assert launch.shared_bytes == mma_variants.F16_TILES[tile].shared_bytes > 0
    launch.enqueue(driver.Stream())
    np.testing.assert_allclose(fake_cuda.dev(y, 4 * tokens * n, np.float32).reshape(tokens, n),
                               fake_f16mma.f16mma_product(x, w.qs, w.scales), rtol=1e-6, atol=1e-6)


def test_dynamic_shared_memory_past_48_kib_is_opted_in_once_per_kernel(monkeypatch):
    """KernelSet.launch sets CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES for a launch past the static
    48 KiB (once per kernel and size), and never for one within it."""
    from kestrel_stream.cuda import kernels as kernels_module
    calls = []
    monkeypatch.setattr(kernels_module.cu, "cuFuncSetAttribute",
                        lambda fn, attribute, value: calls.append((fn, attribute, value)) or
                        (kernels_module.cu.CUresult.CUDA_SUCCESS,))
    monkeypatch.setattr(kernels_module, "Launch", lambda function, name, *rest: (function, name, rest[-1]))
    ks = object.__new__(kernels_module.KernelSet)
    ks._functions, ks._dynamic_shared = {"a": "fa", "b": "fb"}, {}
    big = mma_variants.F16_TILES["f16_128x128k64_ws_s3"].shared_bytes
    for _ in range(2):
        assert ks.launch("a", (1,), (256,), "", [], big) == ("fa", "a", big)
    ks.launch("b", (1,), (256,), "", [], 48 * 1024)
    ks.launch("b", (1,), (256,), "", [], 0)
    attribute = kernels_module.cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    assert calls == [("fa", attribute, big)]
