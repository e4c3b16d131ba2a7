"""`gated` and `layers=N` modes: one step split between host and GPU by a scheduler Plan.

The part of StepExecutor (step_executor.py) that runs plans with host segments.  The plan
says which side runs each op; this path runs them and moves the
step's state between the sides only where the plan's segments meet.  State
tensors (rows = tokens of the step):

    x [T, H] residual   qkv [T, q+2kv]   attn [T, q]   act [T, I] = silu(gate)·up   logits [T, V]

each with a pinned host copy and a device copy and a record of which copy is
current.  Norms and SiLU·mul own no state of their own: SiLU·mul is the
epilogue of gate_up on either side, and an RMSNorm is folded into the
projection that consumes it.  On the GPU that projection reads xn = x·w and
1/rms per token, which the GEMV that wrote x on the device prepares in its
epilogue, or the host computes and uploads when x was last written there.
Entering a host segment downloads everything it reads from the device with
one sync; entering a GPU segment uploads what it reads, asynchronously. Syncs
per step therefore equal the plan's GPU segments, never one per projection.

The device side is the backend every offloading mode builds (device_backend.py):
its arena, its paged KV pool (float32 here, for the first N layers) and its
residency window, which holds every weight that the plans of 1, 2, 4, ...
max_tokens tokens put on the GPU, uploaded at load and kept (counted in
weight_uploads); nothing streams.  A weight some other plan puts there (a
forced group choice) is uploaded on first use and kept.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

import scheduler

from kestrel_stream.obs import prof
from kestrel_stream.obs import trace
from kestrel_stream.model.op_tensors import norm_weight
from kestrel_stream.run.host import CpuKV, HostBackend, model_rope_tables
from kestrel_stream.run.hybrid_host import HostOps

if TYPE_CHECKING:
    from kestrel_stream.run.kv_paged import PagedKV

ATTENTION_SPLITS = 16


def _op_span(side: str, op):
    """The host slice of one op of the plan while tracing (the timeline's host ops)."""
    return trace.span(f"{side} {op.group or op.kind}", op=op.name, layer=-1 if op.layer is None else op.layer,
                      flops=float(op.flops), bytes=int(op.weight_bytes), segment=side)


@dataclass
class HybridKV:
    host: CpuKV | None          # layers whose attention runs on the host (index li - gpu_layers)
    device: PagedKV | None      # the GPU layers' float32 keys and values in the device backend's pool
    capacity: int


class SegmentSteps(HostOps):
    """StepExecutor's path for plans with host segments; expects the backend's parts
    StepExecutor._build names.  The CUDA driver is imported where these modes build their parts, not
    with this module (cpu mode's executor is the same class and runs without cuda.bindings)."""

    def _start_segment_steps(self, load_s: float) -> None:
        """The host backend (its dense weights), the pinned state copies (after the device backend), and
        the load's report."""
        from kestrel_stream.cuda import driver
        self.driver = driver                    # the state copies between the sides
        self.host_backend = HostBackend(self.weights, self.counters)
        b = self.backend
        self.dev = b.arrays
        self.xn_dev, self.inv_rms_dev = self.dev["xn"], self.dev["inv_rms"]     # x · the next norm's weight, its 1/rms
        self.pinned, self.host, self.widths = b.pinned.buffers, b.pinned.views, b.pinned.widths
        self.host_xn, self.host_inv_rms = b.pinned.xn, b.pinned.inv_rms         # host-made xn rows, then 1/rms
        plan, window = self.plan(1), self.window
        total = sum(1 for op in plan.segments for _ in op.ops)
        self.preload_line = (f"preload: {len(window.resident)}/{len(window.resident)} GPU weights warmed in "
                             f"{load_s:.2f} s; device cache {window.resident_bytes / 1e6:.1f} MB / "
                             f"{len(window.resident)} entries ({self.mode}: {plan.syncs_per_step} GPU segments "
                             f"over {total} ops)")
        self.preload_line += "".join(f"; {note}" for note in plan.notes if note.startswith("offloaded "))
        print(f"kestrel-stream: {self.preload_line}", file=sys.stderr)

    # ---- moving state between the sides ---------------------------------------------------------
    def _to_host(self, names, tokens: int) -> None:
        """Download every named state the host reads that only the device has; one sync."""
        pending = [n for n in names if self.valid[n] == {"dev"}]   # state not yet made this step is skipped
        if not pending:
            return
        start = time.perf_counter()
        for name in pending:
            nbytes = tokens * self.widths[name] * 4
            self.driver.d2h_async(self.pinned[name], self.dev[name].ptr, nbytes, self.stream)
            self.counters.d2h_bytes += nbytes
            self.valid[name].add("host")
        self.stream.synchronize()
        self.counters.syncs += 1
        self._uploads_in_flight.clear()
        if self._call is not None:
            self._call["d2h+sync"] = (time.perf_counter() - start) * 1e6
            self._finish_call()

    def _to_device(self, name: str, tokens: int) -> None:
        if "dev" not in self.valid[name]:
            nbytes = tokens * self.widths[name] * 4
            self.driver.h2d_async(self.dev[name].ptr, self.pinned[name], nbytes, self.stream)
            self.counters.h2d_bytes += nbytes
            self.valid[name].add("dev")
            self._uploads_in_flight.add(name)

    def _xn_to_device(self, norm: np.ndarray, tokens: int) -> None:
        """Make the device's xn / 1/rms those of `norm` over x, computing them on the host if x was written there."""
        if self.xn_norm is norm:
            return
        self._to_host(["x"], tokens)
        self._wait_upload("xn")
        x = self.host["x"][:tokens]
        self.host_xn[:tokens] = x * norm
        self.host_inv_rms[:tokens] = 1.0 / np.sqrt(np.mean(np.square(x), axis=-1) + np.float32(self.config.rms_norm_eps))
        self.driver.h2d_async(self.xn_dev.ptr, self.host_xn, tokens * self.config.hidden_size * 4, self.stream)
        self.driver.h2d_async(self.inv_rms_dev.ptr, self.host_inv_rms, tokens * 4, self.stream)
        self.counters.h2d_bytes += tokens * (self.config.hidden_size + 1) * 4
        self._uploads_in_flight.add("xn")
        self.xn_norm = norm

    def _wait_upload(self, name: str) -> None:
        """Before the host overwrites `name`'s pinned copy: wait for an async upload still reading it."""
        if name in self._uploads_in_flight:
            self.stream.synchronize()
            self.counters.syncs += 1
            self._uploads_in_flight.clear()

    def _host_writes(self, name: str) -> None:
        self._wait_upload(name)
        self.valid[name] = {"host"}
        if name == "x":
            self.xn_norm = None

    def _finish_call(self) -> None:
        call, self._call = self._call, None
        if prof.enabled:
            uploads = call.pop("uploads", 0)
            prof.record_call(call, uploads=uploads)

    # ---- one step ---------------------------------------------------------------------------------
    def _forward_segments(self, batch: list[tuple[HybridKV, np.ndarray, int]],
                          logits: str = "all") -> list[np.ndarray]:
        """batch: (kv, token ids [n_i], start position) per session → logits [n_i, V] each; logits="last":
        each session's last row, [1, V] (the plan's lm_head still runs on every row of a chunk here)."""
        self.device.make_current()
        rows = [(kv, int(t), start + i) for kv, ids, start in batch
                for i, t in enumerate(np.asarray(ids, np.int64).reshape(-1))]
        out = np.empty((len(rows), self.config.vocab_size), np.float32)
        for lo in range(0, len(rows), self.max_tokens):
            chunk = rows[lo:lo + self.max_tokens]
            out[lo:lo + len(chunk)] = self._run_chunk(chunk)
        self.counters.steps += 1
        self.counters.tokens += len(rows)
        bounds = np.cumsum([0] + [len(np.atleast_1d(ids)) for _, ids, _ in batch])
        if logits == "last":
            return [out[hi - 1:hi] for hi in bounds[1:]]
        return [out[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]

    def _run_chunk(self, rows) -> np.ndarray:
        T = len(rows)
        plan = self.plan(T)
        self.valid = {name: set() for name in self.widths}
        self.xn_norm = None
        self._uploads_in_flight: set = set()
        self._call = None
        self.ids = np.array([t for _, t, _ in rows], np.int64)
        self.positions = np.array([p for _, _, p in rows], np.int64)
        # sessions as runs of consecutive rows: (kv, first row, last row + 1, start position)
        self.runs = []
        for i, (kv, _, pos) in enumerate(rows):
            if self.runs and self.runs[-1][0] is kv and self.runs[-1][2] == i:
                self.runs[-1][2] = i + 1
            else:
                self.runs.append([kv, i, i + 1, pos])
        self.cos, self.sin = model_rope_tables(self.positions, self.config)
        if self.gpu_layers:          # KV blocks for the positions the step writes, their table entries up
            for kv, lo, hi, start in self.runs:
                self.kv.prepare(kv.device, start, start + hi - lo)
            self.kv.flush()
            self.step_params.stage([(kv.device.base_elements, t, pos) for kv, t, pos in rows], T)
            self.counters.h2d_bytes += self.step_params.upload(T, self.stream)
        for segment in plan.segments:
            if segment.side == "cpu":
                self._to_host(scheduler.segment_inputs(segment.ops), T)
                self._run_ops("cpu", segment.ops, self._host_op, T)
            else:
                self._call = {}
                self._run_ops("gpu", segment.ops, self._gpu_op, T)
                if prof.enabled:      # attribute GPU time to gemm, not to the next sync
                    start = time.perf_counter()
                    self.stream.synchronize()
                    self._call["gemm"] = self._call.get("gemm", 0.0) + (time.perf_counter() - start) * 1e6
        self._to_host(["logits"], T)
        return self.host["logits"][:T]

    @staticmethod
    def _run_ops(side: str, ops, run, T: int) -> None:
        """One segment's ops on `side` in order, each in its own trace span while tracing."""
        for op in ops:
            if trace.active is None:
                run(op, T)
            else:
                with _op_span(side, op):
                    run(op, T)

    @staticmethod
    def _role(op) -> str:
        return op.group or op.kind

    # ---- the GPU side -------------------------------------------------------------------------------
    def _gpu_op(self, op, T: int) -> None:
        role = self._role(op)
        if role in ("norm", "elementwise"):
            return
        start = time.perf_counter()
        for name in op.device_reads():             # the step program's reads (params: staged per step)
            if name == "xn":
                self._xn_to_device(norm_weight(self.weights, op.prologue), T)
            elif name in self.widths:
                self._to_device(name, T)
        self._call["h2d"] = self._call.get("h2d", 0.0) + (time.perf_counter() - start) * 1e6
        launches = self._launches.get((op.name, T))
        if launches is None:
            launches = self._launches[(op.name, T)] = self.device_ops.launches(op, T)
            for launch in launches:
                launch.label(op=op.name, layer=op.layer, segment="gpu")
        start = time.perf_counter()
        for launch in launches:
            launch.enqueue(self.stream)
        self._call["gemm"] = self._call.get("gemm", 0.0) + (time.perf_counter() - start) * 1e6
        self.counters.launches += len(launches)
        self.counters.gpu_weight_read_bytes += sum(launch.labels.get("bytes", 0) for launch in launches)
        for name in op.writes:
            if name in self.widths:
                self.valid[name] = {"dev"}
        if op.prepares:                           # o / down's epilogue: xn and 1/rms of the next norm
            self.xn_norm = norm_weight(self.weights, op.prepares)
