"""Shared by the trace and timeline tests: a format validator, an independent summary, and a GPU-shaped trace.

The GPU-shaped trace drives the recorder's device API exactly as a GPU
executor would (reference event, launches, copies, records/waits, syncs), with
made-up event times, so the device rows can be tested on a machine with no GPU.
"""
from __future__ import annotations

from collections import defaultdict

from kestrel_stream.obs import trace

EPS_US = 1e-6
REQUIRED = {                    # fields each phase must carry (Chrome Trace Event Format)
    "X": ("name", "cat", "pid", "tid", "ts", "dur"),
    "i": ("name", "cat", "pid", "tid", "ts", "s"),
    "C": ("name", "pid", "ts", "args"),
    "M": ("name", "pid", "args"),
    "s": ("name", "cat", "id", "pid", "tid", "ts"),
    "f": ("name", "cat", "id", "pid", "tid", "ts", "bp"),
}


def validate(events: list[dict]) -> None:
    """Assert the event-format rules Perfetto and chrome://tracing rely on."""
    for e in events:
        assert e["ph"] in REQUIRED, e
        missing = [k for k in REQUIRED[e["ph"]] if k not in e]
        assert not missing, f"{e} lacks {missing}"
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["cat"] in trace.CATEGORIES, e
        if e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values()), e
    slices = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            slices[(e["pid"], e["tid"])].append(e)
    for row, row_slices in slices.items():          # slices on one row nest or follow, never straddle
        open_ends: list[float] = []
        for e in sorted(row_slices, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"] + EPS_US:
                open_ends.pop()
            assert not open_ends or e["ts"] + e["dur"] <= open_ends[-1] + EPS_US, f"{e} straddles on {row}"
            open_ends.append(e["ts"] + e["dur"])
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts.keys() == finishes.keys(), "every flow start needs its finish"
    for fid, s in starts.items():
        f = finishes[fid]
        assert (s["cat"], s["name"]) == (f["cat"], f["name"]) and f["bp"] == "e"
        for end in (s, f):                          # each end must bind to a slice on its row
            assert any(x["ts"] <= end["ts"] <= x["ts"] + x["dur"] for x in slices[(end["pid"], end["tid"])])
    named_pids = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    named_rows = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    for e in events:
        if e["ph"] != "M":
            assert e["pid"] in named_pids, f"pid {e['pid']} has no process_name"
        if e["ph"] in ("X", "i", "s", "f"):
            assert (e["pid"], e["tid"]) in named_rows, f"row {(e['pid'], e['tid'])} has no thread_name"


def covered_us(intervals, need=lambda counts: counts[0] > 0) -> float:
    """Sweep-line measure of the time where ``need`` holds for per-kind active counts."""
    edges = sorted((t, kind, delta) for kind, group in enumerate(intervals)
                   for lo, hi in group for t, delta in ((lo, 1), (hi, -1)))
    counts, last, out = [0] * len(intervals), None, 0.0
    for t, kind, delta in edges:
        if last is not None and need(counts):
            out += t - last
        counts[kind] += delta
        last = t
    return out


def gpu_shaped_trace(path, steps: int = 4, layers: int = 3) -> list[dict]:
    """A trace recorded through the device API with synthetic GPU times: copies overlap kernels."""
    rec = trace.start(path)
    rec.set_reference(0, label="cuda:0 synthetic")
    gpu_ms = 0.05
    for _ in range(steps):
        with rec.step(tokens=1, sessions=1):
            with rec.span("plan", op="plan"):
                pass
            for layer in range(layers):
                copy_id = rec.copy("copy h2d", "h2d", 1 << 20, layer=layer, segment="stream")
                rec.event_record("copy h2d", f"weights{layer}")
                rec.stream_wait("compute", f"weights{layer}")
                launch_id = rec.launch("compute", "gemv_q8", op="qkv", layer=layer, flops=4096, bytes=1 << 20,
                                       segment="stream")
                rec.gpu_done(copy_id, gpu_ms, gpu_ms + 0.03)
                rec.gpu_done(launch_id, gpu_ms + 0.02, gpu_ms + 0.05)   # starts while the copy still runs
                rec.counter("bytes in flight", {"bytes": 1 << 20}, device=0)
                gpu_ms += 0.06
            d2h = rec.copy("copy d2h", "d2h", 1024)
            rec.gpu_done(d2h, gpu_ms, gpu_ms + 0.01)
            with rec.sync("stream"):
                pass
            gpu_ms += 0.02
    pending = rec.launch("compute", "never_timed")   # a launch whose events never came back: no flow
    assert pending
    trace.stop()
    from kestrel_stream.obs.trace_summary import load
    return load(path)
