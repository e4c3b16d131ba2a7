"""CI (no GPU): bench/mixed_steps.py on the emulated device (gpu mode) and on the CPU engine, a small Q8_0 file:
each chunk length's row, the decodes' context the same in every repeat."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

import fake_cuda
from bench import mixed_steps
from bench.make_gguf import write as write_gguf
from test_quant4 import CFG


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_chunk_beside_decodes_against_each_alone(tmp_path, monkeypatch, device):
    cfg = dataclasses.replace(CFG, hidden_size=256, intermediate_size=512, num_attention_heads=4)
    path = tmp_path / "m.gguf"
    write_gguf(cfg, None, str(path), seed=5, mix="q8_0")
    if device == "cuda":
        fake_cuda.install(monkeypatch, mode="deferred")
    args = argparse.Namespace(device=device, decodes=3, context=6, chunks="4,20", repeats=2)
    rows = mixed_steps.bench(str(path), args)
    assert [(r["chunk"], r["decodes"], r["context"], r["device"]) for r in rows] == [(4, 3, 6, device), (20, 3, 6, device)]
    for r in rows:
        assert r["decode_ms"] > 0 and r["alone_ms"] > 0 and r["mixed_ms"] > 0, r
        assert r["extra_ms"] == pytest.approx(r["mixed_ms"] - r["decode_ms"], abs=2e-3), r
        assert r["split_ms"] == pytest.approx(r["decode_ms"] + r["alone_ms"], abs=2e-3), r
        assert r["alone_tok_s"] == pytest.approx(r["chunk"] / r["alone_ms"] * 1e3, rel=1e-2), r
    assert rows[0]["decode_ms"] == rows[1]["decode_ms"]      # one decode figure for the run
