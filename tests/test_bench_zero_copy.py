"""bench/zero_copy.py on a GPU: the copy engine's and a kernel's reads of pinned host memory, the device's
own memory for scale, and both beside the host's readers; rows written with their GB/s."""
from __future__ import annotations

import json

import pytest

from kestrel_stream.cuda import driver

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not driver.gpu_available(), reason="no GPU")]


def test_the_zero_copy_bench_reads_pinned_memory_in_place(tmp_path):
    from bench import zero_copy
    zero_copy.main(["--sizes-mb", "8", "--blocks", "1,4", "--threads", "2", "--out", str(tmp_path)])
    rows = {row["reader"]: row for row in json.loads(next(tmp_path.glob("*zero-copy.json")).read_text())["rows"]}
    pinned = [row for reader, row in rows.items() if reader.startswith("kernel, pinned") and "beside" not in reader]
    device = next(row for reader, row in rows.items() if reader.startswith("kernel, device memory"))
    assert len(pinned) == 2 and rows["copy engine"]["GBps_best"] > 1
    assert all(0 < row["GBps_median"] <= row["GBps_best"] for row in rows.values())
    assert all(row["GBps_best"] < device["GBps_best"] for row in pinned)      # PCIe, not HBM
    assert any("beside the host's readers" in reader for reader in rows)
