"""CI (no GPU): bench/steps.py's table on the emulated device, for a small Q4_K_M file."""
from __future__ import annotations

import argparse
import dataclasses

import fake_cuda
from bench import steps
from bench.make_gguf import write as write_gguf
from test_quant4 import CFG


def test_step_and_pp_rows_for_a_q4_k_m_file(tmp_path, monkeypatch):
    cfg = dataclasses.replace(CFG, hidden_size=512, intermediate_size=1024, num_attention_heads=8)
    path = tmp_path / "m.gguf"
    write_gguf(cfg, None, str(path), seed=3, mix="q4_k_m")
    fake_cuda.install(monkeypatch, mode="deferred")
    args = argparse.Namespace(tokens="1,3,9,17", logits="last,all", repeats=1, context=4, pp="24", llama_bench=None,
                              step_graphs="0,1")
    step_rows, pp_rows = steps.bench_file(str(path), args)
    assert [(r["logits"], r["step_graphs"]) for r in step_rows] == [
        ("last", 0), ("last (x 1-token step)", 0), ("last", 1), ("last (x 1-token step)", 1),
        ("all", 0), ("all (x 1-token step)", 0), ("all", 1), ("all (x 1-token step)", 1)]
    assert all(r["1"] > 0 and r["17"] > 0 for r in step_rows[::2])
    assert step_rows[1]["1"] == 1.0 and step_rows[1]["bar"].startswith(("met", "missed ("))
    assert [r["test"] for r in pp_rows] == ["pp24"] and pp_rows[0]["tok_s"] > 0


def test_the_bar_of_issue_39():
    assert steps.bar({1: 1.0, 2: 1.1, 16: 1.3, 64: 2.0}) == "met"
    assert steps.bar({1: 1.0, 8: 1.4, 11: 1.2, 64: 2.5}) == "missed (8: 1.4x, 64: 2.5x, 8 > 11)"
