"""bench/expert_images.py end to end on the emulated device, small shapes: the host's experts op on its own
copies and on both kinds of images (the same numbers: each layout's call on one input gives one output),
rows written with the images' build times."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import fake_cuda

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (no native host kernels)")


def test_the_bench_times_each_layout_and_their_calls_agree(tmp_path, monkeypatch):
    from bench import expert_images
    fake_cuda.install(monkeypatch, mode="deferred")
    calls = []
    real = expert_images.Experts.__call__

    def recorded(self, x, route, moe_out=None):
        used = real(self, x, route, moe_out)
        calls.append(x.copy())
        return used
    monkeypatch.setattr(expert_images.Experts, "__call__", recorded)
    rows = expert_images.main(["--layers", "3", "--experts", "4", "--hidden", "64", "--inter", "96", "--choices", "2",
                               "--threads", "2", "--calls", "4", "--out", str(tmp_path)])
    assert [row["layout"] for row in rows] == ["own", "pinned", "registered"]
    assert all(row["experts_call_us"] > 0 and row["experts_GBps"] > 0 for row in rows)
    assert "build_s" not in rows[0] and all(row["build_s"] > 0 and row["image_MB"] > 0 for row in rows[1:])
    for r in range(0, len(calls), 3):                    # one round's three calls: the same numbers
        assert np.array_equal(calls[r], calls[r + 1]) and np.array_equal(calls[r], calls[r + 2])
    assert len(calls) == 3 * 7
    written = json.loads(next(tmp_path.glob("*expert-images.json")).read_text())
    assert [row["layout"] for row in written["rows"]] == ["own", "pinned", "registered"]
