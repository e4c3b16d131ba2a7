"""Speculative decoding from the command line: `generate -md` / `--spec lookup` print the same tokens as plain
decoding and report the acceptance in --json; `chat -md` answers as plain chat does, turn after turn."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from http_helpers import chat_model


def run(*args, stdin=None):
    proc = subprocess.run([sys.executable, "-m", "kestrel_stream", *args], input=stdin, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return proc


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("spec-chat"))


def test_generate_json_reports_acceptance_and_keeps_the_tokens(model):
    common = ("generate", "-m", str(model), "--device", "cpu", "-p", "abcabcabc", "-n", "24", "--json")
    plain = json.loads(run(*common).stdout)
    assert "spec_acceptance" not in plain
    for flags in (("-md", str(model), "--spec-policy", "always"),
                  ("--spec", "lookup", "--draft-max", "4", "--spec-policy", "always")):
        report = json.loads(run(*common, *flags).stdout)
        assert report["tokens"] == plain["tokens"], flags
        assert 0.0 <= report["spec_acceptance"] <= 1.0 and report["spec_tokens_per_pass"] >= 1.0
    assert json.loads(run(*common, "-md", str(model), "--spec-policy", "always").stdout)["spec_acceptance"] == 1.0


def test_chat_with_a_draft_answers_as_plain_chat(model):
    stdin = "hello\nsecond question\n/reset\nagain\n"
    flags = ("chat", "-m", str(model), "--device", "cpu", "-n", "12")
    plain = run(*flags, stdin=stdin)
    speculative = run(*flags, "-md", str(model), stdin=stdin)
    assert speculative.stdout == plain.stdout
    lookup = run(*flags, "--spec", "lookup", stdin=stdin)
    assert lookup.stdout == plain.stdout
    # a stop string inside a kept run: the KV keeps the answer only, so the next turn goes on as plain chat's
    cut = run(*flags, "--stop", "*", stdin=stdin)
    assert "; stop]" in cut.stderr
    assert run(*flags, "--stop", "*", "-md", str(model), stdin=stdin).stdout == cut.stdout


def test_generate_json_has_the_draft_length_and_the_trace_a_draft_row(model, tmp_path):
    trace_file = tmp_path / "spec.json"
    report = json.loads(run("generate", "-m", str(model), "--device", "cpu", "-p", "abcabcabc", "-n", "16", "--json",
                            "-md", str(model), "--spec-policy", "always", "--trace", str(trace_file)).stdout)
    assert report["spec_draft_length"] > 1 and report["spec_plain_passes"] == 0
    assert report["spec_policy"] == "always" and report["spec_pass_curve"] is None
    auto = json.loads(run("generate", "-m", str(model), "--device", "cpu", "-p", "abcabcabc", "-n", "8", "--json",
                          "--spec", "lookup").stdout)
    assert auto["spec_policy"] == "auto" and auto["spec_pass_curve"]["tokens"][0] == 1
    events = json.loads(trace_file.read_text())["traceEvents"]
    rows = {e["tid"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
            and e["args"]["name"] == "draft"}
    assert len(rows) == 1
    drafts = [e for e in events if e.get("ph") == "X" and e.get("tid") in rows]
    assert drafts and all(e["name"] == "draft" and e["args"]["k"] >= 1 for e in drafts)


def test_plan_says_what_speculation_would_do_on_the_placement(model):
    plain = run("plan", "-m", str(model)).stdout
    assert "speculation" not in plain
    cpu = run("plan", "-m", str(model), "-md", str(model)).stdout.splitlines()[-1]
    assert cpu.startswith(f"speculation: draft model {model} (qwen3, 2 layers), chains of up to 8, policy auto")
    assert "pass time (tokens: ms) 1:" in cpu and cpu.endswith("(speculation off)")
    offload = json.loads(run("plan", "-m", str(model), "--spec", "lookup", "--draft-max", "4", "--mode", "gpu",
                             "--profile", "h200", "--json").stdout)["speculation"]
    assert offload["pass_curve"]["tokens"][0] == 1 and offload["draft_length_at_batch_1"] in range(0, 5)
    assert "prompt lookup" in offload["text"]
