"""bench/zero_copy.py on a GPU: the copy engine's and a kernel's reads of pinned host memory, the device's
own memory for scale, and both beside the host's readers; rows written with their GB/s.  The bench runs in
its own process: a kernel fault is sticky for a process's context and would fail every GPU test after it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kestrel_stream.cuda import driver

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not driver.gpu_available(), reason="no GPU")]


def test_the_zero_copy_bench_reads_pinned_memory_in_place(tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "bench.zero_copy", "--sizes-mb", "8", "--blocks", "1,4",
                           "--threads", "2", "--out", str(tmp_path)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {row["reader"]: row for row in json.loads(next(tmp_path.glob("*zero-copy.json")).read_text())["rows"]}
    pinned = [row for reader, row in rows.items() if reader.startswith("kernel, pinned") and "beside" not in reader]
    device = next(row for reader, row in rows.items() if reader.startswith("kernel, device memory"))
    assert len(pinned) == 2 and rows["copy engine"]["GBps_best"] > 1
    assert all(0 < row["GBps_median"] <= row["GBps_best"] for row in rows.values())
    assert all(row["GBps_best"] < device["GBps_best"] for row in pinned)      # PCIe, not HBM
    assert any("beside the host's readers" in reader for reader in rows)
