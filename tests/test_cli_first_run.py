"""A first run as a new user makes it: help, the no-GPU notice, bad sizes, bench's files, serve's runtime dir."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kestrel_stream.cli.args import NO_GPU_NOTICE
from kestrel_stream.run.engine import gpu_status

NO_GPU = not gpu_status()[0]
needs_no_gpu = pytest.mark.skipif(not NO_GPU, reason="checks the CPU fallback's notice")


def run_cli(*args, env=None):
    proc = subprocess.run([sys.executable, "-m", "kestrel_stream", *map(str, args)], capture_output=True,
                          text=True, env=env or dict(os.environ), timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


def last_line(text: str) -> str:
    return text.splitlines()[-1] if text else ""


def test_bare_command_prints_the_help_with_examples_and_exits_2():
    proc = run_cli()
    assert proc.returncode == 2
    assert first_line(proc.stderr).startswith("usage: kestrel-stream")
    assert "examples:" in proc.stderr and "kestrel-stream demo" in proc.stderr
    assert "generate" in proc.stderr and "bench" in proc.stderr


def test_verb_help_shows_defaults():
    out = run_cli("generate", "--help").stdout
    assert "-1 (the default): until the end of generation" in " ".join(out.split()) and "(default: auto)" in out
    assert "default: 2048" in out and "512" in out            # --max-seq-len's default and the tiny preset's
    assert "(default: None)" not in out and "(default: False)" not in out
    bench = " ".join(run_cli("bench", "--help").stdout.split())
    assert "(default: 32)" in bench and "(default: 64)" in bench and "(default: 3)" in bench
    assert "~/.cache/kestrel-stream/models" in bench
    make = " ".join(run_cli("make-model", "--help").stdout.split())
    assert "random seed of the weights (default: 0)" in make and "(default: bf16)" in make   # 0 is shown too
    assert "llama3-tiny (Llama 3.x rope scaling" in make and "mistral-tiny (sliding window" in make
    serve = " ".join(run_cli("serve", "--help").stdout.split())
    assert "(0: never) (default: 600.0)" in serve


@needs_no_gpu
def test_no_gpu_notice_is_one_short_line_and_verbose_says_why(tiny_model):
    proc = run_cli("generate", "--model", tiny_model, "--prompt-ids", "1", "--max-new-tokens", "2")
    assert proc.returncode == 0
    assert proc.stderr.splitlines() == [NO_GPU_NOTICE]
    verbose = run_cli("generate", "--model", tiny_model, "--prompt-ids", "1", "--max-new-tokens", "2", "--verbose")
    assert first_line(verbose.stderr).startswith("kestrel-stream: no GPU found (")
    assert gpu_status()[1] in first_line(verbose.stderr)


@needs_no_gpu
def test_calibrate_without_a_gpu_says_so_in_short_and_verbose_says_why():
    proc = run_cli("calibrate")
    assert proc.returncode == 0 and proc.stderr == ""
    assert first_line(proc.stdout) == "no GPU found (details: --verbose); host figures only:"
    assert json.loads(proc.stdout.split("\n", 1)[1])["host_gflops"] > 0
    verbose = run_cli("calibrate", "--verbose")
    assert first_line(verbose.stdout) == f"no GPU found ({gpu_status()[1]}); host figures only:"


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"], ["plan", "--model", "TINY", "--mode", "cpu"]])
def test_output_into_a_pipe_closed_early_ends_without_a_traceback(tiny_model, args):
    """`kestrel-stream ... | head -0`: the reader is gone before the first line (closed as the process starts,
    so every write meets a closed pipe whatever the output's size)."""
    args = [str(tiny_model) if a == "TINY" else a for a in args]
    proc = subprocess.Popen([sys.executable, "-m", "kestrel_stream", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(60) in (0, 141), stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr and "Exception ignored" not in stderr, stderr


def test_no_notice_where_the_device_does_not_matter(tmp_path, tiny_model):
    missing = run_cli("generate", "--model", tmp_path / "nope", "--prompt-ids", "1")
    assert missing.returncode == 1
    assert missing.stderr.splitlines() == [f"kestrel-stream: error: {tmp_path / 'nope'}: no such file or directory"]
    assert run_cli("make-model", tmp_path / "m", "--preset", "tiny").stderr == ""
    assert run_cli("plan", "--model", tiny_model, "--mode", "cpu").stderr == ""
    assert run_cli("generate", "--model", tiny_model, "--prompt-ids", "1", "--device", "cpu").stderr == ""


@pytest.mark.parametrize("flags,message", [
    (["--http", "0.0.0.0:8080"], "--http 0.0.0.0:8080: a non-loopback address needs an API key"),
    (["--step-tokens", "0"], "--step-tokens must be in 1.."),
])
def test_bad_serve_flags_fail_before_the_notice_and_the_load(tiny_model, flags, message):
    env = {k: v for k, v in os.environ.items() if k != "KESTREL_API_KEY"}
    proc = run_cli("serve", "--model", tiny_model, *flags, env=env)
    assert proc.returncode == 1
    assert len(proc.stderr.splitlines()) == 1 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("flags,code,message", [
    (["--max-seq-len", "100000000"], 2, "--max-seq-len 100000000 exceeds this model's context of 512 positions"),
    (["--max-seq-len", "0"], 2, "argument -c/--max-seq-len: must be >= 1, got 0"),
    (["-c", "-3"], 2, "argument -c/--max-seq-len: must be >= 1, got -3"),
    (["--max-new-tokens", "100000"], 2, "need 100000 positions, more than a session's 512; 512 is this model's "
                                        "whole context"),
    (["--max-seq-len", "64", "--max-new-tokens", "100"], 2, "raise --max-seq-len (now 64; this model allows up "
                                                            "to 512)"),
    (["--max-new-tokens", "0"], 2, "argument -n/--max-new-tokens: must be >= 1, or -1 (until the end of "
                                   "generation), got 0"),
    (["-n", "-2"], 2, "argument -n/--max-new-tokens: must be >= 1, or -1 (until the end of generation), got -2"),
    (["--mode", "nonsense"], 2, "argument --mode: unknown mode 'nonsense'"),
])
def test_bad_sizes_and_modes_name_the_flag_and_the_limit(tiny_model, flags, code, message):
    ids = [] if "--prompt-ids" in flags else ["--prompt-ids", "1"]
    proc = run_cli("generate", "--model", tiny_model, *ids, *flags)
    assert proc.returncode == code
    assert message in last_line(proc.stderr)
    if "argument" in message:                      # argparse's own errors: the usage line first
        assert first_line(proc.stderr).startswith("usage: kestrel-stream generate")


def test_prompt_ids_negative_is_a_value_and_errors_say_the_flag_once(tiny_model):
    proc = run_cli("generate", "--model", tiny_model, "--prompt-ids", "-1,2")
    assert proc.returncode == 1
    assert "token id -1 at index 0 is outside the vocabulary 0..255" in last_line(proc.stderr)
    bad = run_cli("generate", "--model", tiny_model, "--prompt-ids", "1,x")
    assert bad.returncode == 2
    assert last_line(bad.stderr).endswith("argument --prompt-ids: expected comma-separated integers, got '1,x'")


def test_generate_json_reports_speeds_after_a_warm_up(tiny_model):
    report = json.loads(run_cli("generate", "--model", tiny_model, "--prompt-ids", "1,2,3", "--max-new-tokens",
                                "8", "--json", "--device", "cpu").stdout)
    assert report["warmup_s"] > 0 and report["decode_tok_s"] > 0 and len(report["tokens"]) == 8


def test_bench_writes_its_preset_once_saying_where_and_reports_its_model(tmp_path, tiny_model):
    env = dict(os.environ, KESTREL_CACHE_DIR=str(tmp_path))
    flags = ["--preset", "tiny", "--prompt-len", "4", "--new-tokens", "4", "--repeats", "2", "--device", "cpu"]
    first = run_cli("bench", *flags, env=env)
    assert first.returncode == 0, first.stderr
    assert first_line(first.stderr).startswith(f"bench: writing a random tiny checkpoint (0.")
    assert str(tmp_path / "models") in first.stderr
    assert "4-token prompt, 4 new tokens, median of 2 run(s) after a warm-up" in first.stdout
    again = run_cli("bench", *flags, "--json", env=env)
    assert first_line(again.stderr).startswith("bench: using the random tiny checkpoint in")
    assert json.loads(again.stdout)["preset"] == "tiny"
    own = json.loads(run_cli("bench", "--model", tiny_model, *flags[2:], "--json", env=env).stdout)
    assert own["model"] == str(tiny_model) and own["preset"] is None
    assert (own["prompt_len"], own["new_tokens"], own["repeats"]) == (4, 4, 2)
    repo = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0 and "KESTREL_COMMIT" not in os.environ:
        assert own["commit"] == head.stdout.strip()


def test_serve_without_xdg_runtime_dir_removes_the_fallback_dir_it_made(tmp_path, tiny_model):
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"} | {"TMPDIR": str(tmp_path)}
    runtime = tmp_path / f"kestrel-{os.getuid()}"
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kestrel_stream", "serve", "--model", str(tiny_model),
                                 "--device", "cpu"], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (runtime / "kestrel-stream.sock").exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert runtime.stat().st_mode & 0o777 == 0o700
        import kestrel_stream as ks
        with ks.Client(str(runtime / "kestrel-stream.sock")) as client:
            assert client.stats()["device"] == "cpu"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    assert not runtime.exists(), log.read_text()


def test_serve_leaves_a_runtime_dir_it_did_not_make(tmp_path, monkeypatch):
    from kestrel_stream.options import Environment
    from kestrel_stream.wire import protocol
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)       # gettempdir() caches; read $TMPDIR again
    unset = Environment.from_env({}).runtime_dir
    made = protocol.make_runtime_dir(unset)
    assert made == tmp_path / f"kestrel-{os.getuid()}" and made.is_dir()
    assert protocol.make_runtime_dir(unset) is None          # already there: not this call's to remove
    xdg = Environment.from_env({"XDG_RUNTIME_DIR": str(tmp_path)}).runtime_dir
    assert protocol.make_runtime_dir(xdg) is None and protocol.default_socket_path(xdg) == tmp_path / "kestrel-stream.sock"
