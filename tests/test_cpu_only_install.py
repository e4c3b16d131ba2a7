"""A CPU-only install: the CUDA wheels are Linux-only, and every CPU path runs without cuda.bindings.

The resolution itself needs the network, so it is a documented command (README, Dependencies), not a test:
pip evaluates markers for the running interpreter even with --platform, so the check is uv's
``uv pip install --dry-run --python-platform ... --only-binary :all: .``, which evaluates them for the target.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")        # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
CUDA_WHEELS = {"cuda-python", "nvidia-cuda-nvrtc"}


def requirements_on(sys_platform: str, machine: str) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = {"sys_platform": sys_platform, "platform_machine": machine, "python_version": "3.11",
           "platform_system": {"linux": "Linux", "darwin": "Darwin", "win32": "Windows"}[sys_platform],
           "os_name": "nt" if sys_platform == "win32" else "posix", "extra": ""}
    return {Requirement(d).name for d in project["dependencies"]
            if Requirement(d).marker is None or Requirement(d).marker.evaluate(env)}


@pytest.mark.parametrize("sys_platform,machine", [("darwin", "arm64"), ("darwin", "x86_64"), ("win32", "AMD64")])
def test_cpu_only_platforms_get_no_cuda_wheels(sys_platform, machine):
    wanted = requirements_on(sys_platform, machine)
    assert not wanted & CUDA_WHEELS
    assert {"numpy", "safetensors", "anyio", "gguf", "tqdm"} <= wanted


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_linux_still_gets_the_cuda_wheels(machine):
    assert CUDA_WHEELS <= requirements_on("linux", machine)


BLOCK_CUDA = """\
import sys
sys.modules["cuda"] = None      # `import cuda.bindings` now fails as where the wheels are not installed
"""


def test_cpu_engine_runs_without_cuda_bindings(tmp_path, tiny_model):
    """make-model, generate, bench, plan, calibrate and the demo (daemon, client, timeline) with cuda
    unimportable."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCK_CUDA)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT)]))

    def run(*args):
        proc = subprocess.run([sys.executable, "-m", "kestrel_stream", *map(str, args)], capture_output=True,
                              text=True, env=env, timeout=300)
        assert "Traceback" not in proc.stderr, proc.stderr
        return proc

    blocked = subprocess.run([sys.executable, "-c", "import cuda.bindings"], env=env, capture_output=True)
    assert blocked.returncode != 0           # the block works
    assert run("make-model", tmp_path / "m", "--preset", "llama-tiny").returncode == 0
    report = json.loads(run("generate", "--model", tiny_model, "--prompt-ids", "1,2", "-n", "16", "--json").stdout)
    assert report["device"] == "cpu" and len(report["tokens"]) == 16
    bench = run("bench", "--model", tiny_model, "--prompt-len", "4", "--new-tokens", "4", "--repeats", "1", "--json")
    assert json.loads(bench.stdout)["decode_tok_s"] > 0
    assert run("plan", "--model", tiny_model, "--mode", "gated").returncode == 0
    assert run("calibrate").returncode == 0
    cuda = run("generate", "--model", tiny_model, "--prompt-ids", "1", "--device", "cuda")
    assert cuda.returncode == 1 and "no usable GPU: CUDA layer unavailable" in cuda.stderr
    demo = run("demo", "--dir", tmp_path / "demo")
    assert demo.returncode == 0 and "exit code 0" in demo.stdout
