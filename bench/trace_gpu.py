"""Trace the GPU executors on a real device, instrumented from outside.

    PYTHONPATH=. python3 -m bench.trace_gpu [--preset qwen3-1.7b] [--modes gated,gpu] [--steps 8] [--out DIR]

The executors do not call the recorder yet, so this wraps the device layer's
entry points (kernel launches, graph replays, async copies, stream
synchronizes) and the hybrid executor's per-op methods while tracing is on.
Each launch and copy is bracketed by a pair of timing events and handed to
the recorder exactly as an executor would: ``launch``/``copy`` when issued,
``gpu_done(id, start_ms, end_ms)`` against one reference event once a
synchronize shows the events complete.  Work enqueued during graph capture
is not timed (the replay is, as one span).  Weights are random Q8_0 of the
preset's real shapes (``presets.random_q8_weights``).
"""
from __future__ import annotations

import argparse
import functools
from pathlib import Path

import numpy as np
from cuda.bindings import driver as cu

from kestrel_stream import timeline, trace
from kestrel_stream.cuda import driver, kernels
from kestrel_stream.engine import Engine
from kestrel_stream.presets import random_q8_weights


class DeviceTracer:
    """Timing events around every device call of one executor; resolved at each synchronize."""

    def __init__(self, executor, device_label: str):
        self.rows = {id(v): ("compute" if k == "stream" else k.replace("_", " "))
                     for k, v in vars(executor).items() if isinstance(v, driver.Stream)}
        self.device_label = device_label
        self.free_events: list[driver.Event] = []
        self.pending: list[tuple] = []          # (recorder, op id, start event, end event)
        self.reference = None                   # (recorder, event) of the trace in progress
        self.current_op: dict = {}              # args of the hybrid op being issued, for its launches
        self.saved: list[tuple] = []

    def row(self, stream) -> str:
        return self.rows.setdefault(id(stream), f"stream {len(self.rows) + 1}")

    @staticmethod
    def capturing(stream) -> bool:
        err, status = cu.cuStreamIsCapturing(stream.handle)
        return status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    def event(self) -> driver.Event:
        return self.free_events.pop() if self.free_events else driver.Event(timing=True)

    def ensure_reference(self, rec, stream) -> None:
        if self.reference is not None and self.reference[0] is rec:
            return
        self.original_sync(stream)
        ref = self.event()
        driver.check(cu.cuEventRecord(ref.handle, stream.handle), "cuEventRecord")
        host_us = rec.now_us()              # the stream is idle: the event completes within microseconds
        ref.synchronize()
        rec.set_reference(0, host_us=host_us, label=self.device_label)
        self.reference = (rec, ref)

    def timed(self, stream, call, register):
        rec = trace.active
        if rec is None or self.capturing(stream):
            return call()
        self.ensure_reference(rec, stream)
        start, end = self.event(), self.event()
        host_start_us = rec.now_us()
        driver.check(cu.cuEventRecord(start.handle, stream.handle), "cuEventRecord")
        result = call()
        driver.check(cu.cuEventRecord(end.handle, stream.handle), "cuEventRecord")
        self.pending.append((rec, register(rec, host_start_us), start, end))
        return result

    def resolve(self) -> None:
        still = []
        for rec, op_id, start, end in self.pending:
            (err,) = cu.cuEventQuery(end.handle)
            if err != cu.CUresult.CUDA_SUCCESS:
                still.append((rec, op_id, start, end))
                continue
            ref = self.reference[1]
            if self.reference[0] is rec:
                rec.gpu_done(op_id, start.elapsed_ms(ref), end.elapsed_ms(ref))
            self.free_events += [start, end]
        self.pending = still

    # -- the wrapped entry points ----------------------------------------------------------
    def install(self, hybrid_cls=None) -> None:
        tracer = self
        enqueue, graph_launch = kernels.Launch.enqueue, driver.Graph.launch
        h2d, d2h, sync = driver.h2d_async, driver.d2h_async, driver.Stream.synchronize
        self.original_sync = sync

        def traced_enqueue(launch, stream):
            return tracer.timed(stream, lambda: enqueue(launch, stream), lambda rec, t0: rec.launch(
                tracer.row(stream), launch.name, host_start_us=t0, grid=list(launch.grid), **tracer.current_op))

        def traced_graph_launch(graph, stream):
            return tracer.timed(stream, lambda: graph_launch(graph, stream), lambda rec, t0: rec.launch(
                tracer.row(stream), "graph replay", host_start_us=t0, graph=True))

        def traced_copy(direction, original):
            def copy(a, b, nbytes, stream):
                return tracer.timed(stream, lambda: original(a, b, nbytes, stream), lambda rec, t0: rec.copy(
                    tracer.row(stream), direction, nbytes, host_start_us=t0,
                    **{k: v for k, v in tracer.current_op.items() if k in ("op", "layer", "segment")}))
            return copy

        def traced_sync(stream):
            rec = trace.active
            if rec is None:
                return sync(stream)
            with rec.sync(tracer.row(stream)):
                sync(stream)
            tracer.resolve()

        self.saved = [(kernels.Launch, "enqueue", enqueue), (driver.Graph, "launch", graph_launch),
                      (driver, "h2d_async", h2d), (driver, "d2h_async", d2h), (driver.Stream, "synchronize", sync)]
        kernels.Launch.enqueue, driver.Graph.launch = traced_enqueue, traced_graph_launch
        driver.h2d_async, driver.d2h_async = traced_copy("h2d", h2d), traced_copy("d2h", d2h)
        driver.Stream.synchronize = traced_sync
        if hybrid_cls is not None:
            for name, side in (("_host_op", "cpu"), ("_gpu_op", "gpu")):
                original = getattr(hybrid_cls, name)
                self.saved.append((hybrid_cls, name, original))
                setattr(hybrid_cls, name, self.traced_op(original, side))

    def traced_op(self, original, side: str):
        tracer = self

        @functools.wraps(original)
        def wrapper(executor, op, tokens):
            if trace.active is None:
                return original(executor, op, tokens)
            args = {"op": op.name, "layer": -1 if op.layer is None else op.layer, "flops": float(op.flops),
                    "bytes": int(op.weight_bytes), "segment": side}
            tracer.current_op = args
            try:
                with trace.span(f"{side} {op.group or op.kind}", **args):
                    return original(executor, op, tokens)
            finally:
                tracer.current_op = {}
        return wrapper

    def uninstall(self) -> None:
        for owner, name, original in reversed(self.saved):
            setattr(owner, name, original)
        self.saved = []


def trace_mode(weights, preset: str, mode: str, steps: int, out_dir: Path) -> Path:
    engine = Engine(weights, device="cuda", mode=mode, max_seq_len=256)
    hybrid_cls = type(engine.executor) if hasattr(engine.executor, "_host_op") else None
    tracer = DeviceTracer(engine.executor, f"cuda:0 {driver.detect()}")
    tracer.install(hybrid_cls)
    try:
        session = engine.new_session()
        session.prefill(list(range(1, 17)))
        token = 1
        for _ in range(4):                      # warm-up: graph capture, launch lists, plans
            token = int(np.argmax(session.decode(token)))
        trace.start(out_dir / f"trace-{mode}-{preset}.json.gz", preset=preset, mode=mode, gpu=driver.detect())
        for _ in range(steps):
            token = int(np.argmax(session.decode(token)))
        path = trace.stop()
    finally:
        tracer.uninstall()
        engine.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--modes", default="gated,gpu")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = random_q8_weights(args.preset)
    for mode in args.modes.split(","):
        path = trace_mode(weights, args.preset, mode, args.steps, out_dir)
        html, summary = timeline.run(str(path), str(path).replace(".json.gz", ".html"), None)
        print(f"== {mode}: {path}\n{summary}\n", flush=True)


if __name__ == "__main__":
    main()
