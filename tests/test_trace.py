"""Tracing as a user turns it on: a CPU generate traced to a file, read back, validated and summarized."""
from __future__ import annotations

import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

import kestrel_stream as ks
from kestrel_stream.obs import trace
from kestrel_stream.obs import trace_summary
from trace_checks import covered_us, gpu_shaped_trace, validate


@pytest.fixture(scope="module")
def cpu_trace(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "cpu.json.gz"
    trace.start(path)
    engine = ks.load(tiny_model, device="cpu", mode="cpu")
    engine.generate([1, 2, 3, 4], 8)
    engine.close()
    assert trace.stop() == path and trace.active is None
    return trace_summary.load(path)


def test_cpu_trace_follows_the_event_format(cpu_trace):
    validate(cpu_trace)
    steps = [e for e in cpu_trace if e["ph"] == "X" and e["name"] == "step"]
    assert [e["args"]["step"] for e in steps] == list(range(8))
    assert [e["args"]["tokens"] for e in steps] == [4] + [1] * 7
    qkv = [e for e in cpu_trace if e["ph"] == "X" and e["name"] == "qkv"]
    assert len(qkv) == 8 * 2 and all({"op", "layer", "flops", "bytes", "step"} <= e["args"].keys() for e in qkv)
    assert {e["cat"] for e in cpu_trace if e["ph"] == "X"} == {"host"}
    assert {e["pid"] for e in cpu_trace} == {trace.HOST_PID}, "CPU mode has host rows only"
    assert any(e["ph"] == "C" for e in cpu_trace)


def test_device_api_gives_stream_rows_flows_and_counters(tmp_path):
    events = gpu_shaped_trace(tmp_path / "gpu.json")
    validate(events)
    threads = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"main", "compute", "copy h2d", "copy d2h"} <= threads
    processes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes == {"host", "cuda:0 synthetic"}
    assert {e["cat"] for e in events if e["ph"] == "X"} == {"host", "kernel", "memcpy", "sync"}
    flows = [e for e in events if e["ph"] == "s"]
    assert len(flows) == 4 * (3 * 2 + 1), "one arrow per timed launch and copy, none for the untimed one"
    kernel = next(e for e in events if e["ph"] == "X" and e["cat"] == "kernel")
    assert kernel["args"] == {"op": "qkv", "layer": 0, "flops": 4096, "bytes": 1 << 20, "segment": "stream",
                              "step": 0}


def independent_summary(events):
    """The summary's numbers, recomputed by a sweep over the raw events."""
    slices = [e for e in events if e["ph"] == "X"]
    begin = min(e["ts"] for e in slices)
    window = max(e["ts"] + e["dur"] for e in slices) - begin
    by_row = defaultdict(list)
    for e in slices:
        by_row[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    busy = sorted(100.0 * covered_us([v]) / window for v in by_row.values())
    dev = [e for e in slices if e["pid"] != trace.HOST_PID]
    copies = [(e["ts"], e["ts"] + e["dur"]) for e in dev if e["cat"] == "memcpy"]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in dev if e["cat"] == "kernel"]
    overlap = covered_us([copies, kernels], need=lambda c: c[0] > 0 and c[1] > 0)
    tokens = sum(e["args"]["tokens"] for e in slices if e["name"] == "step")
    host_op_us = defaultdict(float)
    for e in slices:
        if e["pid"] == trace.HOST_PID and "op" in e["args"]:
            host_op_us[e["name"]] += e["dur"]
    device_op_us = defaultdict(float)
    for e in dev:
        device_op_us[e["name"]] += e["dur"]
    return {"busy": busy, "overlap_us": overlap, "tokens": tokens, "host_op_us": host_op_us,
            "device_op_us": device_op_us,
            "syncs_per_token": sum(e["cat"] == "sync" for e in slices) / tokens,
            "launches_per_token": sum(e["name"].startswith("launch ") for e in slices) / tokens,
            "waits": sum(e["ph"] == "i" and e["name"].startswith("wait ") for e in events)}


@pytest.mark.parametrize("which", ["cpu-engine", "device-api"])
def test_summary_equals_numbers_from_raw_events(which, cpu_trace, tmp_path):
    events = cpu_trace if which == "cpu-engine" else gpu_shaped_trace(tmp_path / "gpu.json.gz")
    summary = trace_summary.summarize(events)
    want = independent_summary(events)
    assert sorted(s["busy_pct"] for s in summary["streams"].values()) == pytest.approx(want["busy"])
    assert summary["tokens"] == want["tokens"]
    assert summary["host_syncs_per_token"] == pytest.approx(want["syncs_per_token"])
    assert summary["launches_per_token"] == pytest.approx(want["launches_per_token"])
    assert summary["stream_waits"] == want["waits"]
    for key, want_us in (("top_host_ops", want["host_op_us"]), ("top_device_ops", want["device_op_us"])):
        assert {op["name"]: op["total_us"] for op in summary[key]} == pytest.approx(dict(want_us))
        assert [op["total_us"] for op in summary[key]] == sorted(want_us.values(), reverse=True)
    overlap = sum(d["overlap_us"] for d in summary["devices"].values())
    assert overlap == pytest.approx(want["overlap_us"])
    if which == "device-api":
        assert summary["launches"] == 4 * 3 + 1, "the untimed launch after the last step counts too"
        assert summary["host_syncs_per_token"] == 1
        assert overlap == pytest.approx(4 * 3 * 10.0, rel=1e-3), "each copy overlaps its kernel by 10 us"


def test_steps_select_whole_steps_and_keep_flows_closed(cpu_trace, tmp_path):
    picked = trace_summary.select_steps(cpu_trace, 1, 4)
    validate(picked)
    assert sorted({e["args"]["step"] for e in picked if e["ph"] == "X"}) == [1, 2, 3]
    gpu = trace_summary.select_steps(gpu_shaped_trace(tmp_path / "g.json"), 2, None)
    validate(gpu)
    assert trace_summary.summarize(gpu)["steps"] == 2
    with pytest.raises(ValueError, match="no events"):
        trace_summary.select_steps(cpu_trace, 50, 60)


def best_per_call_s(body, calls: int = 20_000, repeats: int = 5) -> float:
    """Fastest of a few timed batches: a loaded machine only ever slows a batch down."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        body(calls)
        times.append((time.perf_counter() - start) / calls)
    return min(times)


def test_tracing_off_adds_nothing_measurable(tiny_model, cpu_trace):
    """Off, the linear ops pay one attribute check and the other hooks a shared null context.

    The off cost of one step is those per-hook costs times the hooks a traced
    step shows, compared with the step's own time.
    """
    assert trace.active is None
    step3 = [e for e in cpu_trace if e["ph"] == "X" and e["args"].get("step") == 3]
    checks = sum(1 for e in step3 if "flops" in e["args"])           # linear ops: `if trace.active is None`
    spans = len(step3) - checks                                     # step, embed, attention: `with trace.span`

    def off_spans(n):
        for _ in range(n):
            with trace.span("attention", op="attention", layer=0):
                pass

    def off_checks(n):
        for _ in range(n):
            if trace.active is not None:
                raise AssertionError

    span_s, check_s = best_per_call_s(off_spans), best_per_call_s(off_checks)
    engine = ks.load(tiny_model, device="cpu", mode="cpu")
    session = engine.new_session()
    session.prefill([1, 2, 3])
    step_s = []
    for token in range(30):
        start = time.perf_counter()
        session.decode(token)
        step_s.append(time.perf_counter() - start)
    engine.close()
    # relative to the step measured on the same machine at the same time, not an absolute figure: a loaded CI
    # machine slows both alike
    off_cost_s = spans * span_s + checks * check_s
    assert off_cost_s < 0.02 * statistics.median(step_s), (spans, span_s, checks, check_s, step_s)


def run_cli(*args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    proc = subprocess.run([sys.executable, "-m", "kestrel_stream", *args], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_cli_trace_flag_env_var_and_timeline(tiny_model, tmp_path):
    flag = tmp_path / "flag.json"
    run_cli("generate", "--model", str(tiny_model), "--prompt-ids", "1,2", "--max-new-tokens", "4",
            "--device", "cpu", "--trace", str(flag))
    validate(json.loads(flag.read_text())["traceEvents"])
    env_trace = tmp_path / "env.json.gz"
    run_cli("bench", "--model", str(tiny_model), "--device", "cpu", "--prompt-len", "4", "--new-tokens", "4",
            "--repeats", "1", env_extra={"KESTREL_TRACE": str(env_trace)})
    data = json.loads(gzip.decompress(env_trace.read_bytes()))
    validate(data["traceEvents"])
    assert data["otherData"]["mode"] == "cpu"
    html = tmp_path / "out.html"
    proc = run_cli("timeline", str(env_trace), "-o", str(html), "--steps", "1:4")
    assert "3 steps, 3 tokens" in proc.stdout and "busy per stream" in proc.stdout and "top host ops" in proc.stdout
    assert html.read_text().count("<rect") > 10


def test_committed_traces_follow_the_event_format():
    results = Path(__file__).resolve().parent.parent / "bench" / "results"
    traces = sorted(results.glob("*trace*.json.gz"))
    for path in traces:
        validate(trace_summary.load(path))


def test_gpu_times_a_rounding_apart_do_not_straddle(tmp_path):
    rec = trace.start(tmp_path / "r.json")
    rec.set_reference(0)
    rec.gpu_span("compute", "a", 0.0, 0.0100)
    rec.gpu_span("compute", "b", 0.0098, 0.0200)     # 0.2 us "before" a ends: timer rounding
    rec.gpu_span("compute", "c", 0.0300, 0.0400)
    trace.stop()
    events = trace_summary.load(tmp_path / "r.json")
    validate(events)
    a, b, c = (e for e in events if e["ph"] == "X")
    assert b["ts"] == pytest.approx(a["ts"] + a["dur"]) and b["ts"] + b["dur"] == pytest.approx(a["ts"] + 20.0)
    assert c["dur"] == pytest.approx(10.0)
