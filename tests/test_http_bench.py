"""bench/http_serve.py's staggered workload end to end on the tiny preset: the requests are planned from the seed
(the same for every server), and with fewer sessions than clients every request still completes (the admission
queue), none refused, none lost, one JSON row written (the clients in two processes)."""
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.http_load import completion_body, plan_requests, sampling_fields
from bench.daemon_metrics import histogram_percentile

ROOT = Path(__file__).resolve().parent.parent


def test_the_plan_is_the_seeds_and_stays_in_its_ranges():
    plan = plan_requests(200, 1000, (32, 2048), (16, 256), 16.0, seed=3)
    assert plan == plan_requests(200, 1000, (32, 2048), (16, 256), 16.0, seed=3)
    lengths = [len(p.prompt) for p in plan]
    assert min(lengths) >= 32 and max(lengths) <= 2048 and min(lengths) < 128 and max(lengths) > 1024
    assert all(16 <= p.max_tokens <= 256 for p in plan) and all(0 <= t < 1000 for p in plan for t in p.prompt)
    arrivals = [p.arrival_s for p in plan]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and 5 < arrivals[-1] < 25     # 200 at 16/s


def test_sampled_requests_carry_their_temperature_and_their_index_as_seed():
    plan = plan_requests(5, 1000, (8, 16), (4, 8), 16.0, seed=3)
    assert [p.index for p in plan] == list(range(5))
    greedy = completion_body("m", plan[2].prompt, plan[2].max_tokens, sampling_fields(0.0, plan[2].index))
    assert greedy["temperature"] == 0 and "seed" not in greedy
    sampled = completion_body("m", plan[2].prompt, plan[2].max_tokens, sampling_fields(0.8, plan[2].index))
    assert (sampled["temperature"], sampled["top_p"], sampled["seed"], sampled["ignore_eos"]) == (0.8, 0.95, 2, True)


def test_a_histograms_percentile_over_a_run_is_the_difference_of_two_scrapes():
    """Prometheus' histogram_quantile over (after - before): linear within the bucket the rank falls in, the last
    finite bound for a rank past it; nothing counted: None."""
    before = {0.01: 5.0, 0.02: 5.0, 0.05: 9.0, float("inf"): 10.0}        # the warm-up: slow prompts
    after = {0.01: 7.0, 0.02: 11.0, 0.05: 15.0, float("inf"): 16.0}       # the run: 2 + 4 + 0 + 0 prompts
    assert histogram_percentile(before, after, 0.5) == pytest.approx(0.01 + 0.01 * (3 - 2) / 4)
    assert histogram_percentile(before, after, 0.99) == pytest.approx(0.01 + 0.01 * (5.94 - 2) / 4)
    assert histogram_percentile({}, after, 0.5) == pytest.approx(0.01 + 0.01 * (8 - 7) / 4)
    assert histogram_percentile({}, after, 0.99) == 0.05                  # in the +Inf bucket
    assert histogram_percentile(after, after, 0.5) is None
    steps = {1.0: 10.0, 2.0: 14.0, 3.0: 20.0, float("inf"): 20.0}          # whole steps: a bucket is its bound
    assert histogram_percentile({}, steps, 0.5, whole=True) == 1.0
    assert histogram_percentile({}, steps, 0.99, whole=True) == 3.0


def test_staggered_requests_beyond_the_sessions_all_complete(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.http_serve", "--workload", "staggered", "--preset", "tiny",
                           "--clients", "6", "--max-sessions", "2", "--requests", "16", "--prompt-range", "8,96",
                           "--new-range", "4,12", "--rate", "50", "--client-processes", "2", "--out", str(tmp_path),
                           "--trace"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [result] = tmp_path.glob("*.json")
    [row] = json.loads(result.read_text())["rows"]
    assert (row["server"], row["requests"], row["completed"], row["refused"], row["lost"]) == (
        "kestrel-stream", 16, 16, 0, 0), row
    assert row["tok_s"] > 0 and row["ttft_p99_ms"] >= row["ttft_p50_ms"] > 0
    # the daemon's own step figures over the run, from /metrics
    assert row["steps"] > 0 and row["mean_step_ms"] > 0 and row["tokens_per_step"] >= 1, row
    assert row["daemon_ttft_p99_ms"] >= row["daemon_ttft_p50_ms"] > 0, row
    # ... over the run's prompts alone (the daemon's histograms, two scrapes apart): the warm-up's are not in them
    assert row["daemon_prompts"] == 16 and row["daemon_ttft_steps_p99"] >= row["daemon_ttft_steps_p50"] >= 1, row
    # the app's own time to first token (its access log) lies inside each request's as the client saw it
    assert 0 < row["server_ttft_p50_ms"] <= row["ttft_p50_ms"], row
    assert 0 <= row["server_queue_p50_ms"] <= row["server_ttft_p50_ms"], row
    assert json.loads(proc.stdout.splitlines()[-2]) == row      # the row printed as one JSON line
    # every request as the client saw it, a line each, and the daemon's log (its access lines) beside
    [requests] = tmp_path.glob("requests-*.jsonl")
    lines = [json.loads(line) for line in requests.read_text().splitlines()]
    assert sorted(r["index"] for r in lines) == list(range(16))
    assert all(r["kind"] == "completed" and 8 <= r["prompt_tokens"] <= 96 and r["ttft_ms"] > 0
               and r["finished_ms"] >= r["sent_ms"] + r["ttft_ms"] - 1 for r in lines), lines
    log = requests.with_name(requests.stem + "-daemon.log").read_text()
    assert log.count('"POST /v1/completions" 200') >= 16
    # --trace: the daemon's trace of the run, with each call on its step thread and how long it waited there
    [trace] = tmp_path.glob("trace-*.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    opens = [e for e in events if e.get("name") == "call open_prefilling"]
    assert len(opens) == 16 and all(e["args"]["waited_ms"] >= 0 and e["dur"] > 0 for e in opens), opens[:2]
    assert sum(e.get("name") == "step" for e in events) == row["steps"]


def test_devices_sets_run_one_daemon_each_with_the_same_requests(tmp_path):
    """``--devices cpu cpu,cpu``: one engine, then two replicas (on a GPU host: --devices 0 0,1), one row each."""
    proc = subprocess.run([sys.executable, "-m", "bench.http_serve", "--preset", "tiny", "--devices", "cpu", "cpu,cpu",
                           "--clients", "3", "--prompt-tokens", "8", "--new-tokens", "4", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [result] = tmp_path.glob("*devices-cpu-cpu+cpu.json")
    rows = json.loads(result.read_text())["rows"]
    assert [(r["devices"], r["clients"], r["tokens"], r["short_streams"]) for r in rows] == [
        ("cpu", 3, 12, 0), ("cpu,cpu", 3, 12, 0)]
    assert rows[0]["speedup"] == 1.0 and rows[1]["speedup"] == round(rows[1]["tok_s"] / rows[0]["tok_s"], 3)
    assert "| devices |" in result.with_suffix(".md").read_text()
    bad = subprocess.run([sys.executable, "-m", "bench.http_serve", "--devices", "0,0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "cuda:0 is named twice" in bad.stderr
