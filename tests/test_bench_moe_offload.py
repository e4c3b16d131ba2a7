"""bench/moe_offload.py end to end on the emulated device (fake_cuda) with a tiny Qwen3-MoE GGUF: the row of
every expert in VRAM (gpu mode), the row of the experts outside VRAM but for a share (mode offload) with its
host roofline, the resident choices (uniform, frequency) with their hit rates, and llama-bench's rows (a
stand-in that echoes llama-bench's JSON) with -ngl 99 alone and -ngl 99 -ncmoe N."""
from __future__ import annotations

import json
import stat
import sys

import fake_cuda
from bench.make_gguf import write as write_gguf
from kestrel_stream.loading.presets import PRESETS

STAND_IN = """#!{python}
import json, sys
with open({log!r}, "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
args = sys.argv[1:]
prompt, new = int(args[args.index("-p") + 1]), int(args[args.index("-n") + 1])
print(json.dumps([{{"n_prompt": prompt, "n_gen": 0, "avg_ts": 1000.0}}, {{"n_prompt": 0, "n_gen": new, "avg_ts": 50.0}}]))
"""


def test_the_moe_bench_runs_every_row(tmp_path, monkeypatch):
    from bench import moe_offload
    fake_cuda.install(monkeypatch, mode="deferred")
    monkeypatch.setenv("KESTREL_MOE_MMA_MIN_TOKENS", "16")      # the prompt's step on the grouped GEMM
    path = tmp_path / "qwen3-moe-tiny.gguf"
    write_gguf(PRESETS["qwen3-moe-tiny"], None, str(path), seed=1)
    log = tmp_path / "llama-bench.log"
    stand_in = tmp_path / "llama-bench"
    stand_in.write_text(STAND_IN.format(python=sys.executable, log=str(log)))
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IEXEC)
    moe_offload.main([str(path), "--budgets", "all", "experts:0.25", "--threads", "1", "--new-tokens", "3",
                      "--prompt", "16", "--repeats", "1", "--max-seq-len", "128", "--max-batch", "4", "--sessions", "2",
                      "--residency", "--bias-router", "3", "--llama-bench", str(stand_in), "--out", str(tmp_path)])
    rows = json.loads(next(tmp_path.glob("*moe-offload.json")).read_text())["rows"]
    by_budget = {row["budget"]: row for row in rows}
    assert by_budget["all"]["mode"] == "gpu" and by_budget["all"]["ours_batch_tok_s"] > 0
    assert by_budget["all"]["pp_experts_kernels"] == "moe_mma_q8_0_16x64"
    offload = by_budget["experts:0.25"]
    assert offload["mode"] == "offload" and offload["host_roofline_tok_s"] > 0 and offload["ours_pp_tok_s"] > 0
    hits = {policy: by_budget[f"experts:0.25 resident by {policy}"]["hit_rate"] for policy in ("uniform", "frequency")}
    assert hits["frequency"] > hits["uniform"], hits
    ran = log.read_text().splitlines()
    layers = PRESETS["qwen3-moe-tiny"].num_hidden_layers
    assert [line.split(" -t ")[0].split(" -ngl ")[1] for line in ran] == \
        ["99", f"99 -ncmoe {layers}", f"99 -ncmoe {moe_offload.matching_ncmoe(PRESETS['qwen3-moe-tiny'], 0.25)}"]
    assert by_budget["llama.cpp -ngl 99"]["llama_tg_tok_s"] == 50.0


def test_the_moe_bench_reports_the_streamed_prompt_rows(tmp_path, monkeypatch):
    """--stream off on: each offload budget's row as today, then with the experts' ring (steps of up to
    --stream-chunk tokens): its ring, a prompt chunk's placement (E: experts streamed) and the bytes a prompt
    streamed.  Nine layers, eight routed: half of their experts leave room for the ring's two layers."""
    import dataclasses
    from bench import moe_offload
    fake_cuda.install(monkeypatch, mode="deferred")
    config = dataclasses.replace(PRESETS["qwen3-moe-tiny"], num_hidden_layers=9)
    path = tmp_path / "qwen3-moe-tiny-9.gguf"
    write_gguf(config, None, str(path), seed=1)
    moe_offload.main([str(path), "--budgets", "experts:0.5", "--stream", "off", "on", "--stream-chunk", "16",
                      "--threads", "1", "--new-tokens", "2", "--prompt", "16", "--repeats", "1", "--max-seq-len", "128",
                      "--max-batch", "4", "--sessions", "2", "--out", str(tmp_path)])
    rows = json.loads(next(tmp_path.glob("*moe-offload.json")).read_text())["rows"]
    by_budget = {row["budget"]: row for row in rows}
    today, ring = by_budget["experts:0.5"], by_budget["experts:0.5 ring on"]
    assert "experts_ring" not in today and today["ours_pp_tok_s"] > 0
    assert ring["experts_ring"].startswith("2 x ") and ring["pp_placement"].startswith("M=16 ")
    assert ring["pp_streamed_GB"] > 0 and ring["ours_pp_tok_s"] > 0 and ring["ours_batch_tok_s"] > 0


def test_the_moe_bench_times_the_link_share(tmp_path, monkeypatch):
    """--link-experts 0 1 --host-nodes 1 0: the ring-off offload row once per value, with the GPU reading one of
    a token's host-side choices over the link (run/device/expert_link.py), and without a share once as one
    graph with host items and once segment by segment."""
    import pytest
    from bench import moe_offload
    from kestrel_stream import native
    from kestrel_stream.options import Options
    if native.load(Options.from_env({})) is None:
        pytest.skip("no native host kernels (no C compiler): no host items, no link share")
    fake_cuda.install(monkeypatch, mode="deferred")
    path = tmp_path / "qwen3-moe-tiny.gguf"
    write_gguf(PRESETS["qwen3-moe-tiny"], None, str(path), seed=1)
    moe_offload.main([str(path), "--budgets", "experts:0.25", "--stream", "off", "--link-experts", "0", "1", "auto", "defer",
                      "--host-nodes", "1", "0", "--host-reads-images", "0", "1",
                      "--threads", "1", "--new-tokens", "4", "--prompt", "16", "--repeats", "1", "--max-seq-len", "48",
                      "--max-batch", "4", "--sessions", "0", "--out", str(tmp_path)])
    rows = json.loads(next(tmp_path.glob("*moe-offload.json")).read_text())["rows"]
    assert [row["budget"] for row in rows] == ["experts:0.25", "experts:0.25 segment by segment",
                                               "experts:0.25 link 1", "experts:0.25 link 1 host reads images",
                                               "experts:0.25 link auto", "experts:0.25 link auto host reads images",
                                               "experts:0.25 link defer"]
    assert all(row["mode"] == "offload" and row["ours_tg_tok_s"] > 0 for row in rows)
    assert all(row["host_experts_us"] > 0 for row in rows)          # the host's experts op a layer, timed
    assert [("link_wait_us" in row) for row in rows] == [False, False] + [True] * 5     # only armed calls wait
    assert [("link_kept" in row) for row in rows] == [False, False, False, False, True, True, False]
    assert [("images_build_s" in row) for row in rows] == [False, False, True, True, True, True, False]   # defer: none
    graphed = [row for row in rows if "segment by segment" not in row["budget"]]
    assert all(row["host_items_ms"] > 0 and row["device_waits_ms"] > 0 for row in graphed)   # one graph a step
    assert "host_items_ms" not in rows[1]                                 # segment by segment: no host items


def test_the_moe_trace_sums_a_decode_token_by_kernel(tmp_path, monkeypatch):
    """bench/moe_trace.py: a trace's GPU slices and host spans summed by name per token and per call; end to end
    on the emulated device (which times nothing: one step span a token, launched eagerly, no graph replay)."""
    from bench import moe_trace
    events = [{"ph": "X", "pid": 100, "tid": 1, "cat": "kernel", "name": "moe_route", "ts": 0, "dur": 25.0},
              {"ph": "X", "pid": 100, "tid": 1, "cat": "kernel", "name": "moe_route", "ts": 30, "dur": 27.0},
              {"ph": "X", "pid": 100, "tid": 1, "cat": "kernel", "name": "moe_combine", "ts": 60, "dur": 15.0},
              {"ph": "X", "pid": 1, "tid": 1, "cat": "host", "name": "step", "ts": 0, "dur": 100.0},
              {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "host"}}]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    tables = moe_trace.summed(tmp_path / "t.json", steps=2)
    assert tables["gpu"][0] == {"cat": "kernel", "name": "moe_route", "calls_a_token": 1.0, "us_a_token": 26.0,
                                "us_a_call": 26.0}
    assert [r["name"] for r in tables["gpu"]] == ["moe_route", "moe_combine"] and tables["host"][0]["us_a_token"] == 50.0
    fake_cuda.install(monkeypatch, mode="deferred")
    path = tmp_path / "qwen3-moe-tiny.gguf"
    write_gguf(PRESETS["qwen3-moe-tiny"], None, str(path), seed=1)
    tables = moe_trace.main([str(path), "--budgets", "all", "--steps", "2", "--threads", "1", "--max-seq-len", "64",
                             "--out", str(tmp_path / "out")])
    names = {r["name"]: r["calls_a_token"] for r in tables["all"]["host"]}
    assert names["step"] == 1.0 and "graph replay" not in names
    assert (tmp_path / "out" / "moe-trace.json").exists() and list((tmp_path / "out").glob("trace-all.json.gz"))


def test_auto_link_rows_tune_the_sessions_step_on_fresh_sessions(tmp_path, monkeypatch):
    """--link-experts auto with --sessions: the sessions' step size tunes its share before it is timed, round by
    round on fresh sessions (one long warm-up once ran the 30B shape's KV pool out mid-bench), and is kept."""
    import pytest
    from bench import moe_offload
    from kestrel_stream import native
    from kestrel_stream.options import Options
    if native.load(Options.from_env({})) is None:
        pytest.skip("no native host kernels (no C compiler): no link share")
    fake_cuda.install(monkeypatch, mode="deferred")
    path = tmp_path / "qwen3-moe-tiny.gguf"
    write_gguf(PRESETS["qwen3-moe-tiny"], None, str(path), seed=1)
    moe_offload.main([str(path), "--budgets", "experts:0.5", "--stream", "off", "--link-experts", "auto",
                      "--threads", "1", "--new-tokens", "4", "--prompt", "16", "--repeats", "1", "--max-seq-len", "96",
                      "--max-batch", "4", "--sessions", "2", "--out", str(tmp_path)])
    (row,) = json.loads(next(tmp_path.glob("*moe-offload.json")).read_text())["rows"]
    assert row["budget"] == "experts:0.5 link auto" and row["ours_batch_tok_s"] > 0
    kept = dict(item.split(":") for item in row["link_kept"].split())
    assert "2" in kept and not kept["2"].endswith("?"), row["link_kept"]     # the sessions' size settled first


def test_a_ring_row_with_a_link_share(tmp_path, monkeypatch):
    """--stream on --link-experts 2: the ring's row with the share beside it (its images the ring's): prompts
    streamed, decode replays sharing, the host's wait for the link timed."""
    import pytest
    from bench import moe_offload
    from kestrel_stream import native
    from kestrel_stream.options import Options
    if native.load(Options.from_env({})) is None:
        pytest.skip("no native host kernels (no C compiler): no host items, no link share")
    import dataclasses
    fake_cuda.install(monkeypatch, mode="deferred")
    config = dataclasses.replace(PRESETS["qwen3-moe-tiny"], num_hidden_layers=9)    # room for the ring's layers
    path = tmp_path / "qwen3-moe-tiny-9.gguf"
    write_gguf(config, None, str(path), seed=1)
    moe_offload.main([str(path), "--budgets", "experts:0.5", "--stream", "on", "--link-experts", "2",
                      "--threads", "1", "--new-tokens", "4", "--prompt", "16", "--repeats", "1", "--max-seq-len", "128",
                      "--max-batch", "4", "--stream-chunk", "16", "--sessions", "0", "--out", str(tmp_path)])
    (row,) = json.loads(next(tmp_path.glob("*moe-offload.json")).read_text())["rows"]
    assert row["budget"] == "experts:0.5 ring on link 2" and row["ours_tg_tok_s"] > 0
    assert row["experts_ring"] != "none" and row["pp_streamed_GB"] > 0 and "link_wait_us" in row


def test_budgets_none_runs_llama_cpp_alone(tmp_path, monkeypatch):
    """--budgets none: no row of ours (no engine loads), llama-bench once per --ncmoe."""
    from bench import moe_offload
    fake_cuda.install(monkeypatch, mode="deferred")
    path = tmp_path / "qwen3-moe-tiny.gguf"
    write_gguf(PRESETS["qwen3-moe-tiny"], None, str(path), seed=1)
    log, stand_in = tmp_path / "llama-bench.log", tmp_path / "llama-bench"
    stand_in.write_text(STAND_IN.format(python=sys.executable, log=str(log)))
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IEXEC)
    moe_offload.main([str(path), "--budgets", "none", "--llama-bench", str(stand_in), "--ncmoe", "3", "1",
                      "--threads", "1", "--sessions", "0", "--out", str(tmp_path)])
    rows = json.loads(next(tmp_path.glob("*moe-offload.json")).read_text())["rows"]
    assert [row["budget"] for row in rows] == ["llama.cpp -ngl 99 -ncmoe 3", "llama.cpp -ngl 99 -ncmoe 1"]
    assert len(log.read_text().splitlines()) == 2
