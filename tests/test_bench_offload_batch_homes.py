"""bench/offload_batch_homes.py on the emulated device (fake_cuda) with a tiny Qwen3 GGUF: the window alone, the
cost model's choice and its neighbours given as KESTREL_OFFLOAD_HOMES, each timed with its placement and
prediction; a placement given runs as given; the process's settings are put back."""
from __future__ import annotations

import os

import pytest

from bench.offload_batch_homes import every_other
from test_bench_offload_ab import tiny  # noqa: F401  (the fixture: a tiny Qwen3 GGUF on the emulated device)


def test_every_other_mlp_on_the_host_streams():
    assert every_other("MRSMRSM:resident") == "MRSSRSM:resident"
    assert every_other("RSRS:host") == "RSRS:host"


@pytest.mark.parametrize("logits", [False, True])
def test_the_choice_beside_its_neighbours(tiny, logits):
    from bench import offload_batch_homes
    argv = [str(tiny), "--ngl", "2", "--sessions", "2", "--threads", "1", "--steps", "2", "--homes", "HS:resident",
            "--eager"] + (["--logits"] if logits else [])
    rows = offload_batch_homes.main(argv)
    names = [row["row"] for row in rows]
    assert names[:2] == ["window alone", "mode offload's choice"], names
    chosen = rows[1]["placement"]
    assert names[2] == chosen and "HS:resident" in names and names[-1] == chosen + " eager", names
    for row in rows:
        if row["row"] == "window alone" and "refused" in row:    # gpu mode's buffers outgrow this tiny budget
            assert "too small for gpu mode" in row["refused"]
            continue
        assert row["median_ms"] >= row["least_ms"] > 0
        if row["row"] != "window alone":
            assert row["predicted_ms"] > 0 and row["placement"].count(":") == 1
    given = next(row for row in rows if row["row"] == "HS:resident")
    assert given["placement"] == "HS:resident" and given["items_a_step"] >= 1     # given homes run as given
    assert "KESTREL_OFFLOAD_HOMES" not in os.environ and "KESTREL_RING_GRAPHS" not in os.environ
    assert "KESTREL_OFFLOAD" not in os.environ
