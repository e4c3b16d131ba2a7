"""Traces of GPU decode steps, as the device layer records them (skipped without a GPU)."""
from __future__ import annotations

import numpy as np
import pytest

import kestrel_stream as ks
from kestrel_stream.obs import trace
from kestrel_stream.obs import trace_summary
from trace_checks import validate

pytestmark = pytest.mark.gpu

DECODE_STEPS = 3


@pytest.mark.parametrize("mode", ["gpu", "gated"])
def test_decode_trace_has_timed_kernels_flows_and_every_sync(tiny_model, tmp_path, mode, monkeypatch):
    if mode == "gated":
        monkeypatch.setenv("KESTREL_MINFLOP", "1")      # every projection wins the GPU: kernels to see
    engine = ks.load(tiny_model, device="cuda", mode=mode)
    session = engine.new_session()
    path = tmp_path / f"{mode}.json.gz"
    trace.start(path)                                   # before prefill: gpu mode captures its graph while traced
    # 70 tokens: past the largest bucket of one session's step graphs (run/device/step_graphs.py), so the
    # prompt's kernels launch eagerly, each a slice of its own
    token = int(np.argmax(session.prefill([5, 3, 200, 17] + list(range(20, 86)))[-1]))
    before = engine.executor.stats["syncs"]
    for _ in range(DECODE_STEPS):
        token = int(np.argmax(session.decode(token)))
    syncs = engine.executor.stats["syncs"]
    trace.stop()
    engine.close()

    events = trace_summary.load(path)
    validate(events)
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    gpu = [e for e in events if e["ph"] == "X" and e["cat"] in ("kernel", "memcpy")]
    kernels = [e for e in gpu if e["cat"] == "kernel"]
    assert kernels and all(rows[(e["pid"], e["tid"])] == "compute" for e in kernels), "kernels on the compute row"
    flows = [e for e in events if e["ph"] == "s"]
    assert len(flows) == len(gpu), "every timed launch and copy has its arrow"
    launches = [e for e in events if e["ph"] == "X" and e["args"].get("kind") in ("launch", "copy")]
    assert len(launches) == len(gpu), "every launch and copy was resolved (none left without GPU times)"
    sync_slices = [e for e in events if e["ph"] == "X" and e["cat"] == "sync"]
    decode_syncs = [e for e in sync_slices if e["args"].get("step", -1) >= 1]
    assert len(decode_syncs) == syncs - before, "each host sync of the decode steps is in the trace"
    assert any(e["ph"] == "C" and e["name"] == "bytes in flight" for e in events)
    if mode == "gpu":
        replays = [e for e in kernels if e["name"] == "graph replay"]
        assert len(replays) == DECODE_STEPS and any(e["name"] == "graph capture" for e in events)
        assert len(decode_syncs) == DECODE_STEPS
        eager = [e for e in kernels if e["args"].get("step") == 0]
        assert {e["args"]["op"] for e in eager} >= {"embed", "qkv", "attention", "lm_head"}, "prefill launches are labelled"
    else:
        assert any(e["args"].get("segment") == "gpu" and "flops" in e["args"] for e in kernels)
        assert any(e["name"].startswith("cpu ") for e in events if e["ph"] == "X"), "host ops of the plan"
    assert trace_summary.summarize(events)["host_syncs"] == len(sync_slices)
