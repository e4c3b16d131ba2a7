"""The device layer's tracing without a GPU: event times onto the host clock, lazy resolution, the hooks' wiring."""
from __future__ import annotations

import pytest

from kestrel_stream.obs import trace
from kestrel_stream.obs import trace_summary
from kestrel_stream.cuda import device_trace
from kestrel_stream.cuda import driver
from kestrel_stream.cuda import kernels
from kestrel_stream.cuda.device_trace import GpuTimes
from trace_checks import validate


class FakeEvent:
    """A timing event whose GPU time (ms on some device clock) is known once `complete` is called."""

    def __init__(self):
        self.gpu_ms: float | None = None
        self.destroyed = False

    def complete(self, gpu_ms: float) -> None:
        self.gpu_ms = gpu_ms

    def query(self) -> bool:
        return self.gpu_ms is not None

    def elapsed_ms(self, since: "FakeEvent") -> float:
        assert self.gpu_ms is not None and since.gpu_ms is not None, "cuEventElapsedTime: CUDA_ERROR_NOT_READY"
        return self.gpu_ms - since.gpu_ms

    def mark(self, stream) -> None:     # what driver.Event.mark does: a new record, not yet passed
        self.gpu_ms = None

    def destroy(self) -> None:
        self.destroyed = True


class FakeStream:
    def __init__(self, name: str):
        self.name, self.capturing = name, False


def new_times(path, reference_host_us: float = 500.0):
    rec = trace.start(path)
    made: list[FakeEvent] = []

    def new_event():
        made.append(FakeEvent())
        return made[-1]

    reference = FakeEvent()
    times = GpuTimes(rec, reference, reference_host_us, new_event, label="cuda:0 fake")
    return rec, times, reference, made


def slices(rec, cat: str) -> list[dict]:
    return [e for e in rec.events if e["ph"] == "X" and e["cat"] == cat]


def test_gpu_times_land_on_the_host_clock_once_complete(tmp_path):
    rec, times, reference, _ = new_times(tmp_path / "t.json")
    start, end = times.pair()
    op_id = rec.launch("compute", "q8_gemv_m1", op="L0.qkv", layer=0)
    times.add(op_id, start, end)
    assert times.resolve() == 0, "nothing resolves before the reference completes"
    reference.complete(1000.0)                   # device clock, ms
    assert times.resolve() == 0 and len(times.pending) == 1, "nor before the op's end event"
    start.complete(1000.25)
    end.complete(1000.75)
    assert times.resolve() == 1 and not times.pending
    (kernel,) = slices(rec, "kernel")
    assert kernel["ts"] == pytest.approx(500.0 + 250.0) and kernel["dur"] == pytest.approx(500.0)
    assert kernel["args"]["op"] == "L0.qkv" and kernel["name"] == "q8_gemv_m1"
    assert sorted(times.free, key=id) == sorted([start, end], key=id), "completed events return to the pool"
    assert times.pair() in ((start, end), (end, start))
    trace.stop()
    validate(trace_summary.load(tmp_path / "t.json"))


def test_ops_resolve_per_stream_as_they_complete_and_bytes_in_flight_waits_for_every_copy(tmp_path):
    rec, times, reference, _ = new_times(tmp_path / "t.json", reference_host_us=0.0)
    reference.complete(0.0)
    h2d = rec.copy("copy h2d", "h2d", 4096, layer=1)
    h2d_events = times.pair()
    times.add(h2d, *h2d_events, "h2d", 4096)
    d2h = rec.copy("copy d2h", "d2h", 1024)
    d2h_events = times.pair()
    times.add(d2h, *d2h_events, "d2h", 1024)
    kernel = rec.launch("compute", "attention_split_d128")
    kernel_events = times.pair()
    times.add(kernel, *kernel_events)
    for event, ms in zip(h2d_events + kernel_events, (0.010, 0.030, 0.020, 0.050)):
        event.complete(ms)
    assert times.resolve() == 2 and [op.op_id for op in times.pending] == [d2h], "the d2h stream is still busy"
    assert not [e for e in rec.events if e["ph"] == "C"], "a copy is pending: its bytes are unknown yet"
    for event, ms in zip(d2h_events, (0.025, 0.060)):
        event.complete(ms)
    assert times.resolve() == 1 and not times.pending
    counter = [(e["ts"], e["args"]) for e in rec.events if e["ph"] == "C" and e["name"] == "bytes in flight"]
    assert counter == [(10.0, {"h2d": 4096.0, "d2h": 0.0}), (25.0, {"h2d": 4096.0, "d2h": 1024.0}),
                       (30.0, {"h2d": 0.0, "d2h": 1024.0}), (60.0, {"h2d": 0.0, "d2h": 0.0})]
    assert {e["args"]["direction"] for e in slices(rec, "memcpy")} == {"h2d", "d2h"}
    trace.stop()
    events = trace_summary.load(tmp_path / "t.json")
    validate(events)
    assert len([e for e in events if e["ph"] == "s"]) == 3, "one flow arrow per timed op"


def test_close_gives_every_event_back(tmp_path):
    rec, times, reference, made = new_times(tmp_path / "t.json")
    times.add(rec.launch("compute", "k"), *times.pair())
    times.close()
    assert reference.destroyed and made and all(e.destroyed for e in made)
    trace.stop()


def test_hooks_import_and_do_nothing_while_tracing_is_off():
    assert trace.active is None
    stream = driver.Stream.__new__(driver.Stream)     # no driver here: a stream that was never created
    stream.name, stream.capturing = "compute", False
    launch = kernels.Launch(None, "q8_gemv_m1", (4,), (128,), "pi", [0, 3]).label(op="qkv", layer=None)
    assert launch.labels == {"op": "qkv"}, "None labels are left out"
    driver.resolve_gpu_times(None)             # no trace: no GpuTimes, nothing to resolve
    calls = []
    launch.submit = lambda s: calls.append(s)
    launch.enqueue(stream)
    assert calls == [stream] and driver._gpu_times is None, "untraced: the launch alone, no events"


def test_an_enqueued_launch_is_a_timed_slice_with_its_labels_and_a_flow(tmp_path, monkeypatch):
    rec, times, reference, _ = new_times(tmp_path / "t.json", reference_host_us=0.0)
    monkeypatch.setattr(driver, "_gpu_times", times)
    w = kernels.QWeight(qs=0, scales=0, rows=64, cols=128)
    fake_kernels = type("Kernels", (), {"gemv_m1": None, "gemv_mn": None, "launch": lambda self, name, grid, block, sig, args:
                                        kernels.Launch(None, name, grid, block, sig, args)})()
    launch = kernels.gemv_launch(fake_kernels, w, 0, 128, 0, 64, 1).label(op="L2.o", layer=2)
    submitted = []
    launch.submit = lambda s: submitted.append(s)
    stream = FakeStream("compute")
    launch.enqueue(stream)
    stream.capturing = True
    launch.enqueue(stream)                           # inside a capture: no events, no report
    assert submitted == [stream, stream] and len(times.pending) == 1
    reference.complete(0.0)
    times.pending[0].start.complete(0.001)
    times.pending[0].end.complete(0.004)
    driver.resolve_gpu_times(rec)
    assert not times.pending
    trace.stop()
    events = trace_summary.load(tmp_path / "t.json")
    validate(events)
    (kernel,) = [e for e in events if e["ph"] == "X" and e["cat"] == "kernel"]
    assert kernel["name"] == launch.name and kernel["args"] == {
        "op": "L2.o", "layer": 2, "flops": 2 * 64 * 128, "bytes": 64 * 128 + 64 * 4 * 2}
    threads = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "compute" in threads
