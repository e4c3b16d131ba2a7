"""Split-K q8_mma launches inside whole steps, on the numpy device emulation (fake_cuda): gpu mode's
captured bucket graphs and layers=N's device segment build them through DeviceOps over the shared
DeviceState scratch; batched decode of 11 sessions and a 12-token prefill give the CPU engine's
logits (2e-3, same argmax), and replays find the tickets reset (the twin asserts it at launch)."""
from __future__ import annotations

import numpy as np
import pytest

import fake_cuda
from hf_oracle import relative_error
from bench.synthetic import random_q8_weights
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.run.engine import Engine
from kestrel_stream.run.compat import HybridExecutor

# down's K (the intermediate size) spans 8 K stages of the 16x32k256 tile: its few row tiles get split
CONFIG = ModelConfig(arch="qwen3", hidden_size=256, intermediate_size=2048, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=384,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                     max_position_embeddings=512)
MAX_SEQ_LEN, MAX_BATCH = 32, 16
PROMPTS = [[1 + i, 2, 3 + i] for i in range(11)]
LONG_PROMPT = [5, 3, 200, 17, 42, 8, 1, 99, 250, 7, 64, 31]


@pytest.fixture(scope="module")
def weights():
    return random_q8_weights(CONFIG, seed=5)


@pytest.fixture
def emulated(monkeypatch):
    fake_cuda.install(monkeypatch, mode="deferred")
    # steps of 9..16 tokens take q8_gemv_hmma.cu by default; the fp32 few-token layouts keep q8_mma there
    monkeypatch.setenv("KESTREL_GEMV_MN", "o64r4u2")


def two_batched_steps(engine):
    """Logits of a 12-token prefill, then of two decode steps of 11 sessions at once."""
    long = engine.new_session()
    out = [long.prefill(LONG_PROMPT)]
    sessions = [engine.new_session() for _ in PROMPTS]
    for s, prompt in zip(sessions, PROMPTS):
        s.prefill(prompt)
    for token in (11, 12):
        out.append(engine.decode_batch([(s, token) for s in sessions]))
    return out


def split_launches(launches) -> list:
    return [launch for launch in launches if launch.name.startswith("q8_mma_") and launch.grid[2] > 1]


@pytest.fixture(scope="module")
def reference(weights):
    return two_batched_steps(Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH))


def assert_matches(ours, reference):
    for step, (got, want) in enumerate(zip(ours, reference)):
        for row, (g, w) in enumerate(zip(got, want)):
            assert relative_error(g, w) < 2e-3, f"step {step}, row {row}"
        np.testing.assert_array_equal(got.argmax(axis=1), want.argmax(axis=1))


def test_gpu_mode_batched_decode_runs_split_k(weights, reference, emulated):
    engine = Engine(weights, device="cuda", mode="gpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    assert_matches(two_batched_steps(engine), reference)
    split = split_launches(engine.executor.steps.step_launches(16))
    assert {launch.labels["op"] for launch in split} == {"down"}, [launch.name for launch in split]
    assert len(split) == CONFIG.num_hidden_layers
    assert engine.executor.stats["graph_replays"] >= 2, "the bucket-16 graph ran twice"
    engine.close()


def test_layers_mode_runs_split_k_on_its_device_segment(weights, reference, emulated):
    engine = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    engine.device, engine.mode = "cuda", "layers=1"
    engine.executor = HybridExecutor(weights, "layers=1", None, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    assert_matches(two_batched_steps(engine), reference)
    split = split_launches(engine.executor.steps.prepared_launches())
    assert split and all(launch.labels["op"].endswith("down") for launch in split), [l.labels for l in split]
    engine.close()


def test_split_bench_sweeps_every_valid_split_and_marks_one_winner(emulated, monkeypatch):
    """bench/mma.py's split sweep on the emulated device (timings meaningless, the bookkeeping not)."""
    from bench import mma as bench_mma
    from kestrel_stream.cuda import mma_variants
    monkeypatch.setattr(bench_mma, "KernelSet", fake_cuda.FakeKernelSet)
    monkeypatch.setattr(bench_mma, "SPLIT_SHAPES", {("toy", "down"): (96, 1056), ("toy", "gate_up"): (192, 512)})
    monkeypatch.setattr(bench_mma, "SPLIT_TOKENS", (9, 17))
    monkeypatch.setattr(mma_variants, "SPLIT_TARGET_BLOCKS", 8)   # tiles of 16 or 32 rows fill it alone: unsplit
    rows, winners = bench_mma.sweep_splits(bench_mma.Bench(repeats=2, arena_bytes=64 << 20))
    for (model, op), (n, k) in bench_mma.SPLIT_SHAPES.items():
        for tokens in bench_mma.SPLIT_TOKENS:
            mine = [r for r in rows if (r["op"], r["tokens"]) == (op, tokens)]
            want = {mma_variants.variant_name(tile, s) for tile, shape in mma_variants.TILES.items()
                    if shape.splits_k for s in bench_mma.SPLIT_COUNTS if mma_variants.split_is_valid(k, shape, s)
                    and (s == 1 or -(-n // shape.rows) * -(-tokens // shape.tokens) < 8)}
            assert any(r["splits"] > 1 for r in mine) and any(r["variant"] == "16x16k256" for r in mine)
            if op == "gate_up":    # 12 tiles of 16 rows: the 16x16 tile is swept unsplit only
                assert not any(r["variant"].startswith("16x16k256s") for r in mine)
            assert {r["variant"] for r in mine} == want | {mma_variants.choose_variant(tokens, n, k)}
            assert sum(r["best"] for r in mine) >= 1 and sum(r["default"] for r in mine) == 1
            (winner,) = [w for w in winners if (w["op"], w["tokens"]) == (op, tokens)]
            assert winner["default"] == mma_variants.choose_variant(tokens, n, k)
            assert winner["best"] in {r["variant"] for r in mine if r["best"]}
            assert min(winner["best_double_buffered_us"], winner["best_pipelined_us"]) == winner["best_us"]
            assert mma_variants.TILES[mma_variants.parse_variant(winner["best_pipelined"])[0]].pipelined
