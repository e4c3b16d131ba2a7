"""tests/conftest.py's stop at a sticky GPU fault: a gpu test failing on one (CUDA_ERROR_MISALIGNED_ADDRESS)
ends the run there, naming the test and the fault; a gpu test failing otherwise, or a CPU test failing on the
same words, lets the run go on.  Checked in a pytest of its own over probe tests."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CONFTEST = f'''
import importlib.util
import pytest
spec = importlib.util.spec_from_file_location("project_conftest", {str(HERE / "conftest.py")!r})
project = importlib.util.module_from_spec(spec)
spec.loader.exec_module(project)
pytest_runtest_makereport = project.pytest_runtest_makereport


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: probe")
'''

PROBES = '''
import pytest


@pytest.mark.gpu
def test_1_gpu_plain_failure():
    assert 1 == 2


def test_2_cpu_failure_with_the_words():
    raise RuntimeError("cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS")


@pytest.mark.gpu
def test_3_gpu_sticky_fault():
    raise RuntimeError("cuStreamSynchronize failed: CUDA_ERROR_MISALIGNED_ADDRESS")


def test_4_after():
    pass
'''


def test_a_sticky_gpu_fault_ends_the_run_naming_the_test(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_probes.py").write_text(PROBES)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "no:randomly",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 3, out
    assert "test_probes.py::test_3_gpu_sticky_fault hit CUDA_ERROR_MISALIGNED_ADDRESS" in out
    assert "test_probes.py::test_1_gpu_plain_failure FAILED" in out            # ran on past a plain failure
    assert "test_probes.py::test_2_cpu_failure_with_the_words FAILED" in out    # and past a CPU test's
    assert "test_4_after" not in out and "2 failed" in out                      # stopped at the fault
