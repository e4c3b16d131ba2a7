"""Load stages (obs/load_stages.py): ks.load of a GGUF file and gpu mode's build record where time went,
and --prof prints them."""
from __future__ import annotations

import fake_cuda
import kestrel_stream as ks
from gguf_export import export_gguf
from kestrel_stream.loading.presets import PRESETS
from bench.synthetic import random_q8_weights
from kestrel_stream.obs import load_stages
from kestrel_stream.run.engine import Engine
from test_cli import run_cli


def test_a_gguf_load_records_its_stages(tmp_path):
    path = export_gguf(random_q8_weights(PRESETS["tiny"], seed=0), tmp_path / "tiny.gguf")
    load_stages.reset()
    engine = ks.load(path, device="cpu", max_seq_len=32)
    assert "tokenizer (built on first use)" not in load_stages.snapshot()      # not part of the load
    assert engine.tokenizer is None          # the exported file carries none; looking is the first use
    engine.close()
    stages = load_stages.snapshot()
    for name in ("weights: read, split, fuse", "  GGUF metadata and mmap", "  Q8_0 blocks: views of the mmap",
                 "engine: executor", "tokenizer (built on first use)"):
        assert name in stages and stages[name]["s"] >= 0
    assert stages["  Q8_0 blocks: views of the mmap"]["count"] >= 7         # one per Q8_0 tensor
    assert not any("split" in name and "qs/scales" in name for name in stages)   # the CPU engine splits nothing
    assert "  GGUF metadata and mmap" in load_stages.report()


def test_gpu_mode_records_kernels_arena_weights_kv_and_capture(monkeypatch):
    fake_cuda.install(monkeypatch, mode="deferred")
    load_stages.reset()
    engine = Engine(random_q8_weights(PRESETS["tiny"], seed=0), device="cuda", mode="gpu", max_seq_len=32)
    with engine.new_session() as s:
        s.decode(1)
    stages = load_stages.snapshot()
    for name in ("  kernels: NVRTC or disk cache, module load", "  arena", "  weights: pinned images",
                 "  weights: H2D", "  KV pool and block tables", "graph capture"):
        assert name in stages, sorted(stages)
    engine.close()


def test_prof_prints_the_load_stages(tiny_model):
    proc = run_cli("generate", "--model", str(tiny_model), "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
                   "--device", "cpu", "--prof")
    assert "load stages" in proc.stderr and "weights: read, split, fuse" in proc.stderr


def test_the_preload_through_small_staging_buffers_uploads_every_weight(monkeypatch):
    """Many staging rounds under the deferred stream policy: a buffer rewritten before its upload ran
    would corrupt a weight, and the logits would differ from the CPU engine's."""
    import numpy as np
    from hf_oracle import relative_error
    from kestrel_stream.run.device import weight_window as window
    fake_cuda.install(monkeypatch, mode="deferred")
    monkeypatch.setattr(window, "PRELOAD_CHUNK_BYTES", 4096)
    weights = random_q8_weights(PRESETS["tiny"], seed=4)
    gpu = Engine(weights, device="cuda", mode="gpu", max_seq_len=32)
    cpu = Engine(weights, device="cpu", max_seq_len=32)
    with gpu.new_session() as s, cpu.new_session() as ref:
        got, expected = s.prefill([3, 1, 4, 1, 5]), ref.prefill([3, 1, 4, 1, 5])
    assert relative_error(got, expected) < 2e-3
    np.testing.assert_array_equal(got.argmax(axis=1), expected.argmax(axis=1))
    gpu.close()
