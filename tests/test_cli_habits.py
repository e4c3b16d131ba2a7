"""Command-line habits from llama.cpp: short flags, -n -1, --version, escapes in --stop, each verb's usage on its
errors, ranges checked before the model loads, serve --help under headings."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kestrel_stream import __version__
from kestrel_stream.cli.main import build_parser


def run_cli(*args):
    proc = subprocess.run([sys.executable, "-m", "kestrel_stream", *map(str, args)], capture_output=True, text=True,
                          env=dict(os.environ), timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def test_llama_cpp_short_flags_mean_what_they_mean_there(tiny_model):
    short = run_cli("generate", "-m", tiny_model, "-p", "hello", "-n", "5", "-c", "64", "-t", "1", "-s", "7",
                    "--temp", "0.8", "--json", "--device", "cpu")
    assert short.returncode == 0, short.stderr
    long = run_cli("generate", "--model", tiny_model, "--prompt", "hello", "--max-new-tokens", "5",
                   "--max-seq-len", "64", "--cpu-threads", "1", "--seed", "7", "--temp", "0.8", "--json",
                   "--device", "cpu")
    assert json.loads(short.stdout)["tokens"] == json.loads(long.stdout)["tokens"]
    assert len(json.loads(short.stdout)["tokens"]) == 5


def test_n_minus_one_runs_to_the_end_of_the_context(tiny_model):
    proc = run_cli("generate", "-m", tiny_model, "--prompt-ids", "1,2,3", "-n", "-1", "-c", "40", "--ignore-eos",
                   "--json", "--device", "cpu")
    report = json.loads(proc.stdout)
    assert len(report["tokens"]) == 40 - 3 + 1 and report["stop_reason"] == "length"
    default = json.loads(run_cli("generate", "-m", tiny_model, "--prompt-ids", "1,2,3", "-c", "24", "--json",
                                 "--device", "cpu").stdout)
    assert len(default["tokens"]) == 24 - 3 + 1         # -1 is the default: no more 16-token answers


def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"kestrel-stream {__version__}"


def test_stop_strings_read_escapes_as_llama_cpp_does():
    args = build_parser().parse_args(["generate", "-m", "M", "-p", "x", "--stop", r"\n\n", r"a\tb", r"c\\n", r"\q"])
    assert args.stop == ["\n\n", "a\tb", "c\\n", "\\q"]


@pytest.mark.parametrize("verb,flags,message", [
    ("generate", ["-p", "x", "--bogus"], "unrecognized arguments: --bogus"),
    ("chat", ["--prompt", "x"], "unrecognized arguments: --prompt x"),
    ("serve", ["--spin", "1", "--max-batchh", "2"], "unrecognized arguments"),
    ("generate", ["-p", "x", "--top-p", "2"], "argument --top-p: must be in (0, 1], got 2"),
    ("generate", ["-p", "x", "--temp", "-1"], "argument --temp: must be in 0..100, got -1"),
    ("chat", ["--min-p", "1.5"], "argument --min-p: must be in 0..1, got 1.5"),
    ("generate", ["-p", "x", "--temp", "nan"], "argument --temp: must be in 0..100, got nan"),
    ("generate", ["-p", "x", "-n", "0"], "argument -n/--max-new-tokens: must be >= 1, or -1"),
    ("generate", ["-p", "x", "-s", "-5"], "argument -s/--seed: must be in 0..2**64-1 (or -1: random), got -5"),
])
def test_errors_print_the_verbs_usage_before_anything_loads(tmp_path, verb, flags, message):
    proc = run_cli(verb, "-m", tmp_path / "no-model-here", *flags)      # never reached: the flags fail first
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert lines[0].startswith(f"usage: kestrel-stream {verb} ")
    assert message in lines[-1] and lines[-1].startswith(f"kestrel-stream {verb}: error:")
    assert "no such file" not in proc.stderr and "no GPU" not in proc.stderr


def test_a_check_that_needs_the_model_prints_the_verbs_usage_too(tiny_model):
    proc = run_cli("generate", "-m", tiny_model, "--prompt-ids", "1", "-n", "100000", "--device", "cpu")
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: kestrel-stream generate ")
    assert "need 100000 positions" in proc.stderr.splitlines()[-1]


def test_serve_help_puts_everyday_flags_first_and_tuning_and_limits_under_headings():
    out = run_cli("serve", "--help").stdout
    options, tuning, limits = (out.index(h) for h in ("\noptions:", "\ntuning and diagnostics:", "\nlimits:"))
    assert options < tuning < limits
    for flag in ("--model", "-hf", "--http HOST:PORT", "--api-key-file", "--socket", "--max-sessions MAX"):
        assert out.index(flag, options) < tuning, flag
    for flag in ("--spin-us", "--inline-max-ms", "--step-tokens", "--kv-dtype", "--prof"):
        assert out.index(flag, tuning) < limits, flag
    for flag in ("--max-connections", "--hello-timeout-s", "--http-max-requests", "--http-max-body-kb"):
        assert out.index(flag, limits), flag


def test_top_level_help_shows_gguf_chat_and_http_examples():
    out = run_cli("--help").stdout
    examples = out[out.index("examples:"):]
    assert "kestrel-stream chat -m " in examples and ".gguf" in examples and ":Q4_K_M" in examples
    assert "--chat " in examples and "--http 127.0.0.1:8080" in examples


def test_load_progress_shows_on_a_terminal_only(monkeypatch):
    import fcntl
    import io
    import pty
    import select
    import struct
    import termios
    import time
    from kestrel_stream.cli.engine_args import progress_bar
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))   # a terminal of 24 x 100
    seen = {}
    for name, stream in (("terminal", os.fdopen(slave, "w")), ("pipe", io.StringIO())):
        monkeypatch.setattr(sys, "stderr", stream)
        update = progress_bar("loading")
        update(0, 100)
        time.sleep(0.6)                         # a load that takes a moment (the bar waits 0.5 s to appear)
        update(50, 100, "layer 1")
        update(100, 100)
        stream.flush()
        if name == "terminal":
            seen[name] = os.read(master, 1 << 16).decode() if select.select([master], [], [], 5)[0] else ""
        else:
            seen[name] = stream.getvalue()
    os.close(master)
    assert "loading" in seen["terminal"] and "50" in seen["terminal"]
    assert seen["pipe"] == ""
