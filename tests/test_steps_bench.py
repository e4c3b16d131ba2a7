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
    args = argparse.Namespace(tokens="1,3,9,17", logits="last,all", repeats=1, context=4, pp="24", llama_bench=None)
    step_rows, pp_rows = steps.bench_file(str(path), args)
    assert [r["logits"] for r in step_rows] == ["last", "last (x 1-token step)", "all", "all (x 1-token step)"]
    assert all(r["1"] > 0 and r["17"] > 0 for r in step_rows[::2])
    assert step_rows[1]["1"] == 1.0
    assert [r["test"] for r in pp_rows] == ["pp24"] and pp_rows[0]["tok_s"] > 0
