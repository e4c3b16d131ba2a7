"""bench/spec_offload.py end to end with tiny random models and small numbers: on the CPU (no budgets), and
on the emulated device at two target residencies with the draft inside the budget, a stand-in llama-bench
and the pass-time curve; one JSON row a measurement."""
from __future__ import annotations

import json
import stat

import pytest

import fake_cuda
from bench import spec_offload


def bench_args(tiny_model, tmp_path, *extra):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox\n---\nOnce upon a time")
    return ["--target", str(tiny_model), "--draft", str(tiny_model), "--prompts", str(prompts), "-n", "6",
            "--repeats", "1", "--tree-nodes", "1,8", "--lookup", "--spec-policy", "always", "-c", "64",
            "--curve-preset", "tiny", "--curve-max", "8", *extra]


def test_the_bench_runs_on_the_cpu(tiny_model, tmp_path):
    rows = spec_offload.main(bench_args(tiny_model, tmp_path, "--device", "cpu", "--out", str(tmp_path / "out")))
    kinds = [r["kind"] for r in rows]
    assert kinds.count("load") == 1 and kinds.count("plain") == 2 and kinds.count("spec") == 6
    spec = [r for r in rows if r["kind"] == "spec"]
    assert all(r["same_tokens"] for r in spec) and {(r["draft"], r["tree_nodes"]) for r in spec} == {
        ("model", 1), ("model", 8), ("lookup", 8)}
    assert all(r["acceptance"] == 1.0 for r in spec if r["draft"] == "model")     # the target drafts for itself
    curve = [r for r in rows if r["kind"] == "pass_curve"]
    assert [r["tokens"] for r in curve] == [1, 2, 4, 8] and curve[0]["resident"] is None
    saved = json.loads(next((tmp_path / "out").glob("*-spec-offload.json")).read_text())
    assert saved["rows"] == rows


def test_the_bench_runs_on_the_emulated_device_with_llama_bench(tiny_model, tmp_path, monkeypatch):
    fake_cuda.install(monkeypatch, mode="deferred")
    llama = tmp_path / "llama-bench"
    llama.write_text("#!/bin/sh\necho '[{\"avg_ts\": 12.5, \"args\": \"'\"$*\"'\"}]'\n")
    llama.chmod(llama.stat().st_mode | stat.S_IEXEC)
    rows = spec_offload.main(bench_args(tiny_model, tmp_path, "--device", "cuda", "--resident", "0.5,0.25",
                                        "--llama-bench", str(llama)))
    loads = [r for r in rows if r["kind"] == "load"]
    assert [r["resident"] for r in loads] == [0.5, 0.25] and all(r["device"] == "cuda" for r in loads)
    assert all(r["same_tokens"] for r in rows if r["kind"] == "spec")
    llama_rows = [r for r in rows if r["kind"] == "llama-bench"]
    # llama.cpp gets the VRAM ours holds, the draft's included ("pair"): the draft is the target itself here,
    # whose bytes alone hold every weight of its 2 layers and output (-ngl 3, = L + 1) at both residencies; and
    # the target's share alone ("target"): one layer's bytes at 50 % (86 KB), half of one at 25 %; -ngl 1 (the
    # output layer alone, 18 KB: llama.cpp counts it first) fits both, -ngl 2 (a layer more, 104 KB) neither
    assert [(r["vram"], r["ngl"], r["tok_s"]) for r in llama_rows] == [
        ("pair", 3, 12.5), ("target", 1, 12.5), ("pair", 3, 12.5), ("target", 1, 12.5)], llama_rows
    assert "-ngl 3" in llama_rows[0]["command"]
    assert {r["resident"] for r in rows if r["kind"] == "pass_curve"} == {0.25}


def test_resident_1_is_everything_in_vram_and_auto_rows_carry_the_measured_curve(tiny_model, tmp_path,
                                                                                monkeypatch):
    """--resident 1: no budget (the pair all in VRAM), llama-bench at -ngl 99; under "auto" a row with the pass
    curve and the draft's time per token the policy measured and decided from."""
    fake_cuda.install(monkeypatch, mode="deferred")
    llama = tmp_path / "llama-bench"
    llama.write_text("#!/bin/sh\necho '[{\"avg_ts\": 40.0}]'\n")
    llama.chmod(llama.stat().st_mode | stat.S_IEXEC)
    args = bench_args(tiny_model, tmp_path, "--device", "cuda", "--resident", "1", "--mode", "gpu",
                      "--llama-bench", str(llama))
    args[args.index("always")] = "auto"
    at = args.index("--curve-preset")
    del args[at:at + 4]                             # no pass-time curve: its budgets are mode offload's
    rows = spec_offload.main(args)
    [load] = [r for r in rows if r["kind"] == "load"]
    assert load["resident"] == 1.0 and load["mode"] == "gpu" and "window" not in load["plan"]
    [llama_row] = [r for r in rows if r["kind"] == "llama-bench"]
    assert llama_row["ngl"] == 99 and "-ngl 99" in llama_row["command"]
    [curve] = [r for r in rows if r["kind"] == "measured_curve"]
    assert curve["resident"] == 1.0 and curve["tokens"][0] == 1 and len(curve["seconds"]) == len(curve["tokens"])
    assert curve["draft_s_per_token"] is not None and curve["draft_s_per_token"] >= 0


def test_llama_ngl_is_the_largest_that_fits_as_llama_cpp_counts_its_output_layer():
    """-ngl N holds N-1 layers and the output layer (-ngl 1: the output alone), every weight past L."""
    from kestrel_stream.loading.presets import PRESETS
    from scheduler import offload
    c = PRESETS["qwen3-1.7b"]
    per_layer, _, head = offload._layer_items(c)
    layer = sum(per_layer[0].values())
    assert spec_offload.llama_ngl(c, head - 1) == 0
    assert spec_offload.llama_ngl(c, head) == 1
    assert spec_offload.llama_ngl(c, head + 13 * layer) == 14
    assert spec_offload.llama_ngl(c, head + 13 * layer + layer - 1) == 14
    assert spec_offload.llama_ngl(c, 10 ** 12) == c.num_hidden_layers + 1
