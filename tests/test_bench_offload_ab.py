"""bench/offload_ab.py on the emulated device (fake_cuda) with a tiny Qwen3 GGUF: one placement loaded once per
value of the switch, both measured alternately; with KESTREL_RING_GRAPHS the streaming step is one graph (one sync
a step) for 1 and segment by segment for 0; a bad switch is refused; the process's settings are put back."""
from __future__ import annotations

import os

import pytest

import fake_cuda
from bench.make_gguf import write as write_gguf
from kestrel_stream.loading.presets import PRESETS


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    fake_cuda.install(monkeypatch, mode="deferred")
    path = tmp_path / "tiny.gguf"
    write_gguf(PRESETS["tiny"], None, str(path), seed=1)
    for name in ("KESTREL_OFFLOAD", "KESTREL_OFFLOAD_HOMES", "KESTREL_RING_GRAPHS"):
        monkeypatch.delenv(name, raising=False)
    return path


def test_the_ring_graph_switch_measured_both_ways_on_one_placement(tiny, tmp_path):
    from bench import offload_ab
    row = offload_ab.main([str(tiny), "--fraction", "1.0", "--homes", "HS:resident", "--reps", "2",
                           "--new-tokens", "4", "--step-tokens", "3", "--step-repeats", "1", "--threads", "1",
                           "--max-seq-len", "64", "--out", str(tmp_path)])
    on, off = row["1"], row["0"]
    assert len(on["tok_s_runs"]) == len(off["tok_s_runs"]) == 2 and on["tok_s"] > 0 and off["step_ms"] > 0
    assert on["graph_replays"] > 0 and off["graph_replays"] == 0, row     # the step with the ring: a graph or not
    assert on["syncs_per_step"] < off["syncs_per_step"], row
    assert row["decode_1_over_0"] == round(on["tok_s"] / off["tok_s"], 3)
    assert row["step_1_over_0"] == round(off["step_ms"] / on["step_ms"], 3)
    assert row["predicted_ms"] > 0 and row["predicted_step_ms"] > 0
    assert next(tmp_path.glob("*-offload-ab.json")).exists()
    assert "KESTREL_OFFLOAD_HOMES" not in os.environ and "KESTREL_RING_GRAPHS" not in os.environ


def test_a_switch_that_is_not_a_setting_is_refused(tiny):
    from bench import offload_ab
    with pytest.raises(SystemExit):
        offload_ab.main([str(tiny), "--fraction", "1.0", "--homes", "HS", "--switch", "RING", "--values", "1", "0"])
