"""The command line as a user runs it: make-model, generate --json, bench, demo, bad flags."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run_cli(*args, env_extra=None, check=True):
    env = dict(os.environ, **(env_extra or {}))
    proc = subprocess.run([sys.executable, "-m", "kestrel_stream", *args], capture_output=True, text=True,
                          env=env, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_make_model_then_generate_json(tmp_path):
    model = tmp_path / "m"
    made = run_cli("make-model", str(model), "--preset", "tiny")
    assert "wrote tiny" in made.stdout and (model / "config.json").exists()
    proc = run_cli("generate", "--model", str(model), "--prompt-ids", "1,2,3", "--max-new-tokens", "16", "--json")
    report = json.loads(proc.stdout)
    for key in ("tokens", "decode_tok_s", "prefill_tok_s", "syncs_per_token", "mode", "device"):
        assert key in report
    assert len(report["tokens"]) == 16 and all(0 <= t < 256 for t in report["tokens"])
    assert report["device"] == "cpu" and report["mode"] == "cpu"
    again = json.loads(run_cli("generate", "--model", str(model), "--prompt-ids", "1,2,3",
                               "--max-new-tokens", "16", "--json", "--device", "cpu").stdout)
    assert again["tokens"] == report["tokens"]


def test_auto_device_says_once_that_it_uses_the_cpu(tiny_model):
    proc = run_cli("generate", "--model", str(tiny_model), "--prompt-ids", "1", "--max-new-tokens", "2")
    from kestrel_stream.run.engine import gpu_status
    if not gpu_status()[0]:
        assert proc.stderr.count("using the CPU engine") == 1


@pytest.mark.parametrize("args,message", [
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", "1,999999"], "outside the vocabulary"),
    (["--prompt-ids", "1", "--mode", "warp"], "unknown mode"),
])
def test_generate_bad_input_is_a_clear_error(tiny_model, args, message):
    proc = run_cli("generate", "--model", str(tiny_model), *args, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_model_is_a_clear_error(tmp_path):
    proc = run_cli("generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1", check=False)
    assert proc.returncode != 0 and "nope" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_json(tiny_model):
    proc = run_cli("bench", "--model", str(tiny_model), "--new-tokens", "8", "--prompt-len", "4",
                   "--repeats", "1", "--json", "--device", "cpu")
    result = json.loads(proc.stdout)
    assert result["decode_tok_s"] > 0 and result["prefill_tok_s"] > 0
    assert result["commit"] and result["date"]


def test_demo_runs_the_daemon_and_writes_a_timeline(tmp_path):
    proc = run_cli("demo", "--dir", str(tmp_path), "--device", "cpu")
    assert "session A: 12 greedy tokens" in proc.stdout and "session B: 12 greedy tokens" in proc.stdout
    assert "exit code 0" in proc.stdout
    assert "  as text: '" in proc.stdout                        # the generated ids through the tokenizer
    assert "batching: " in proc.stdout and "mean_batch" in proc.stdout and "2.0: both sessions" in proc.stdout
    assert (tmp_path / "tiny" / "config.json").exists()
    html = (tmp_path / "demo-timeline.html").read_text()
    assert "<svg" in html and 'src="http' not in html and 'href="http' not in html
    from kestrel_stream.obs import trace_summary
    events = trace_summary.load(tmp_path / "demo-trace.json.gz")
    assert any(e.get("name") == "qkv" for e in events)
