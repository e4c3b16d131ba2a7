"""`gated`, `layers=N` and `offload` steps: the plan's segments in order, host segments on the host backend's programs,
device segments as the device backend's launches, the step's state moved only where segments meet.

State tensors (rows = tokens of the step):

    x [T, H] residual   qkv [T, q+2kv]   attn [T, q]   act [T, I] = silu(gate)·up   logits [T, V]

each with a pinned host copy and a device copy and a record of which copy is current (SegmentState).
Norms and SiLU·mul own no state of their own: SiLU·mul is the epilogue of gate_up on either side, and
an RMSNorm is folded into the projection that consumes it.  On the GPU that projection reads xn = x·w
and 1/rms per token, which the GEMV that wrote x on the device prepares in its epilogue, or the host
computes and uploads when x was last written there.  Entering a host segment downloads everything it
reads from the device with one sync; entering a GPU segment uploads what it reads, asynchronously.
Syncs per step therefore equal the plan's GPU segments, never one per projection.  A greedy step
(forward_greedy, forward_argmax: the daemon's decode steps and verify passes) takes each logits row's argmax
where lm_head ran: on the device (argmax_split, 4 bytes a row back instead of the row), or on the host; a
sampled step (forward_sample) draws each session's last row there where lm_head runs on the device (step_picks).

The device side is the backend every offloading mode builds (device/backend.py): its arena, its paged KV
pool (float32 for the first N layers in gated and layers=N; every layer, f16 by default, in offload) and its
residency window.  In gated and layers=N the window holds every weight that the plans of 1, 2, 4, ...
max_tokens tokens put on the GPU, uploaded at load and kept (counted in weight_uploads), and nothing
streams; a weight some other plan puts there (a forced group choice) is uploaded on first use and kept.
In offload the window holds the resident layers, and the layers a step's plan streams go through its
ring (device/stream_ring.py) while the host computes the others.

A device segment of a step of up to SEGMENT_GRAPH_MAX_TOKENS tokens replays a graph of its launches (segment_graphs.py) once
the same (tokens, segment, lm rows) came twice: its uploads still go eagerly, in the eager order, before
the replay (they read only the host's state, which no device op of the segment changes), and the launches
are the ones prepared per op and size, whose arguments never change between steps (positions and KV table
rows are read from the step's params on the device).  Eager instead: graphs off (KESTREL_STEP_GRAPHS=0,
use_graphs), mode offload's weight ring, a step that streams experts through the experts' ring (one that
streams none replays), a token tree, KESTREL_PROF or a trace (op by op), and a segment that would need the
device's x back on the host midway (an op whose norm input the host computes after a device op wrote x).

Where every host segment after the first device one is a native op list, a step of up to
SEGMENT_GRAPH_MAX_TOKENS tokens instead runs from that segment on as one graph with host items
(item_graphs.py, KESTREL_HOST_NODES=0 turns it off): one wait a step, the weight ring's copies inside it.

One concern, a mixed step: the walk over the plan's segments (MixedSteps), which decides every move of the
state between the sides (segment_state.py) by where the next op runs.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

import scheduler
from kestrel_stream.model.op_tensors import norm_weight
from kestrel_stream.obs import prof, trace
from kestrel_stream.run.host.backend import CpuKV, HostBackend
from kestrel_stream.run.host.pool_spin import spinning_step
from kestrel_stream.run.host_nodes import HostNodes
from kestrel_stream.run.item_graphs import SEGMENT_GRAPH_MAX_TOKENS, ItemGraphs  # noqa: F401 (re-exported)
from kestrel_stream.run.segment_graphs import SegmentGraphs
from kestrel_stream.run.segment_state import SegmentState
from kestrel_stream.run.steps import Steps
from kestrel_stream.run.token_tree import step_tree_fields

if TYPE_CHECKING:
    from kestrel_stream.run.device.backend import DeviceBackend
    from kestrel_stream.run.device.kv_paged import PagedKV
    from kestrel_stream.run.device.expert_ring import ExpertRing
    from kestrel_stream.run.device.stream_ring import StreamRing

ATTENTION_SPLITS = 16
@dataclass
class HybridKV:
    host: CpuKV | None          # layers whose attention runs on the host (index li - gpu_layers)
    device: PagedKV | None      # the GPU layers' float32 keys and values in the device backend's pool
    capacity: int


class MixedSteps(Steps):
    """gated and layers=N steps over the host backend and one device backend."""

    def __init__(self, backend: DeviceBackend, counters, plan, *, gpu_layers: int, max_tokens: int, mode: str,
                 load_s: float, options=None, ring: StreamRing | None = None, expert_ring: ExpertRing | None = None,
                 link=None):
        """ring: mode offload's streaming of the items a step's plan streams (device/stream_ring.py);
        expert_ring: of the routed layers whose experts it streams (device/expert_ring.py); link: the routed
        layers' link share at one token (device/expert_link.py)."""
        self.backend, self.counters, self.plan, self.ring, self.expert_ring = backend, counters, plan, ring, expert_ring
        self.config, self.weights = backend.weights.config, backend.weights
        self.gpu_layers, self.max_tokens = gpu_layers, max_tokens
        self.host = HostBackend(self.weights, counters, options)
        self.spin = spinning_step(self.host.kernels, options)
        self._host_programs: dict = {}       # (tokens, segment index) -> (its inputs, its HostProgram)
        self._prepared: dict = {}            # (op name, tokens[, lm rows]) -> _prepare's tuple
        self._copies: dict = {}              # (dst, src, bytes) -> a copy_words launch (mode offload's uploads)
        self.segment_graphs = SegmentGraphs(self)   # device segments replayed as graphs (segment_graphs.py)
        self.use_graphs = options is None or options.step_graphs
        # the library's host items (host_nodes.py): the host's xn for the device, and steps whose host segments
        # are native op lists as one graph (item_graphs.py; KESTREL_HOST_NODES=0: segment by segment), with the
        # routed layers' link share at one token (device/expert_link.py)
        self.nodes = (HostNodes(self.host.kernels, backend.pinned)
                      if self.host.kernels is not None and backend.pinned is not None else None)
        self.item_graphs = ItemGraphs(self, self.nodes if options is None or options.host_nodes else None, link,
                                      ring_steps=options is None or options.ring_graphs)
        from kestrel_stream.run.device.step_picks import StepPicks
        self.picks = StepPicks(backend)                # tokens taken where lm_head runs on the device
        window, first = backend.window, plan(1)
        total = sum(1 for segment in first.segments for _ in segment.ops)
        self.preload_line = (f"preload: {len(window.resident)}/{len(window.resident)} GPU weights warmed in "
                             f"{load_s:.2f} s; device cache {window.resident_bytes / 1e6:.1f} MB / "
                             f"{len(window.resident)} entries ({mode}: {first.syncs_per_step} GPU segments "
                             f"over {total} ops)")
        self.preload_line += "".join(f"; {note}" for note in first.notes if note.startswith("offloaded "))
        print(f"kestrel-stream: {self.preload_line}", file=sys.stderr)

    def streams_experts(self) -> bool:
        """Whether this step streams experts through the experts' ring (copies a graph does not capture)."""
        return self.expert_ring is not None and bool(self.expert_ring.names)

    def prepared_launches(self):
        """Every device launch prepared so far, over all ops and step sizes."""
        return (launch for prepared in self._prepared.values() for launch in prepared[2])

    def _kernel_copy(self, dst: int, src_address: int, nbytes: int):
        """The copy_words launch of an upload (kept per destination, source and size)."""
        key = (dst, src_address, nbytes)
        launch = self._copies.get(key)
        if launch is None:
            words = nbytes // 4
            launch = self._copies[key] = self.backend.kernels.launch(
                "copy_words", (max(1, min(-(-words // 256), 64)),), (256,), "ppi", [dst, src_address, words])
        return launch

    def clear_launches(self) -> None:
        """Forget the prepared launches, their graphs and the host programs (the plans changed: a forced group
        choice)."""
        self._prepared.clear()
        self._host_programs.clear()
        self._drop_graphs()

    def _drop_graphs(self) -> None:
        self.segment_graphs.drop()
        self.item_graphs.drop()

    # ---- KV caches: the backend's pool for the first gpu_layers layers, host caches for the rest ---------
    def alloc_kv(self, max_seq_len: int) -> HybridKV:
        device = self.backend.kv.open(max_seq_len) if self.backend.kv else None
        return HybridKV(self._host_kv(max_seq_len), device, max_seq_len)

    def _host_kv(self, capacity: int) -> CpuKV | None:
        host_layers = self.config.num_hidden_layers - self.gpu_layers
        return self.host.alloc_kv(capacity, host_layers) if host_layers else None

    def free_kv(self, kv: HybridKV) -> None:
        if kv.device is not None:
            self.backend.kv.close(kv.device)
            kv.device = None

    def truncate_kv(self, kv: HybridKV, length: int) -> None:
        # whole blocks past `length` go back to the pool; host rows past it are written again before any
        # step reads them
        if kv.device is not None:
            self.backend.kv.truncate(kv.device, length)

    def move_kv(self, kv: HybridKV, moves: list[tuple[int, int]]) -> None:
        if kv.host is not None:
            self.host.move_kv(kv.host, moves)
        if kv.device is not None:
            self.backend.device.make_current()
            self.backend.kv.move(kv.device, moves)

    def fork_kv(self, kv: HybridKV, length: int, capacity: int | None = None) -> HybridKV:
        """A new cache of `capacity` positions (default kv's) sharing `kv`'s first `length` positions' device
        blocks (copy-on-write: kv_pool.prepare_write); host rows copied."""
        capacity = capacity or kv.capacity
        host = self._host_kv(capacity)
        if host is not None:
            host.k[:, :length] = kv.host.k[:, :length]
            host.v[:, :length] = kv.host.v[:, :length]
        device = self.backend.kv.fork(kv.device, length, capacity) if kv.device is not None else None
        return HybridKV(host, device, capacity)

    def kv_stats(self) -> dict:
        return self.backend.kv.stats() if self.backend.kv else {}       # gated: the caches are on the host

    def routing_counts(self) -> np.ndarray | None:
        """The host router's counts and, where some routers run on the device (resident experts), its counts."""
        counts = self.host.routing_counts()
        store = self.backend.experts
        return counts if counts is None or store is None else counts + store.counts()

    def close(self) -> None:
        if self.expert_ring is not None:
            self.expert_ring.close()
        self.backend.device.make_current()
        self._drop_graphs()
        self.item_graphs.close()
        if self.nodes is not None:
            self.nodes.close()
        self.picks.close()
        self.backend.close()

    # ---- steps ------------------------------------------------------------------------------------
    def forward(self, batch: list[tuple[HybridKV, np.ndarray, int]], logits: str = "all",
                trees: list | None = None) -> list[np.ndarray]:
        """batch: (kv, token ids [n_i], start position) per session → logits [n_i, V] each; logits="last":
        each session's last row, [1, V]: lm_head runs on the chunk's wanted rows alone where they are one run
        (a prefill's last row, a decode batch), on none in a prefill's earlier chunks.  trees: per session a
        TokenTree (run/token_tree.py) or None."""
        return self._forward(batch, logits, trees, pick=None)

    def forward_greedy(self, batch: list) -> np.ndarray:
        """Each session's greedy next token, int64 [len(batch)]: the argmax of its last logits row, taken on
        the device where lm_head runs there (4 bytes a row back instead of the row)."""
        return np.array([int(rows[-1]) for rows in self._forward(batch, "last", None, pick="argmax")], np.int64)

    def forward_argmax(self, batch: list, trees: list | None = None) -> list[np.ndarray]:
        """Every row's argmax, int64 [n_i] per session, taken where forward_greedy takes it."""
        return [np.asarray(rows, np.int64).reshape(-1) for rows in self._forward(batch, "all", trees, pick="argmax")]

    def forward_sample(self, batch: list, states: list) -> np.ndarray | None:
        """Each session's next token drawn on the device (states: pack_state's, one a session), int64 [len(batch)],
        prompt chunks beside decodes too; None where it cannot (lm_head on the host): the caller samples."""
        if (self.picks.sampler is None or not batch or len(states) != len(batch)
                or not self._head_on_device(min(sum(np.asarray(ids).size for _, ids, _ in batch), self.max_tokens))):
            return None
        rows = self._forward(batch, "last", None, pick="sample", states=states)
        if any(row.ndim == 2 for row in rows):    # logits came back after all: the caller samples (this step again)
            return None
        return np.array([int(row[-1]) for row in rows], np.int64)

    def _head_on_device(self, tokens: int) -> bool:
        """Whether lm_head runs on the device, whole, in a step of `tokens` tokens."""
        sides = {p.side for p in self.plan(tokens).placements.values() if p.group == "lm_head"}
        return sides == {"gpu"}

    def _forward(self, batch: list, logits: str, trees: list | None, pick: str | None, states=None) -> list:
        """forward's rows, or with `pick` ("argmax"; "sample" with `states`, one a session) each row's token."""
        self.backend.device.make_current()
        fields = None if trees is None else step_tree_fields(batch, trees)
        rows = [(kv, int(t), start + i) for kv, ids, start in batch
                for i, t in enumerate(np.asarray(ids, np.int64).reshape(-1))]
        bounds = np.cumsum([0] + [len(np.atleast_1d(ids)) for _, ids, _ in batch])
        wanted = set(int(hi) - 1 for hi in bounds[1:]) if logits == "last" else None
        out = {}
        for lo in range(0, len(rows), self.max_tokens):
            chunk = rows[lo:lo + self.max_tokens]
            lm = None
            if wanted is not None:
                mine = sorted(r - lo for r in wanted if lo <= r < lo + len(chunk))
                contiguous = not mine or mine[-1] - mine[0] + 1 == len(mine)
                lm = (mine[0] if mine else 0, len(mine)) if contiguous else None
            if states is not None:
                self.picks.stage_draws(states, bounds[1:] - 1, lo, lm if lm is not None else (0, len(chunk)))
            chunk_fields = None if fields is None else tuple(f[lo:lo + len(chunk)] for f in fields)
            with self.spin(native_only=self.ring is not None or chunk_fields is None):
                computed = self._run_chunk(chunk, lm, chunk_fields, pick).copy()   # the pinned rows: the next chunk's
            first = lm[0] if lm is not None else 0
            for i in range(len(computed)):
                out[lo + first + i] = computed[i]
        self.counters.steps += 1
        self.counters.tokens += len(rows)
        if logits == "last":
            return [out[int(hi) - 1][None] for hi in bounds[1:]]
        return [out[lo][None] if hi - lo == 1 else np.stack([out[r] for r in range(lo, hi)])
                for lo, hi in zip(bounds[:-1], bounds[1:])]

    def _run_chunk(self, rows, lm: tuple[int, int] | None = None, tree_fields=None, pick: str | None = None) -> np.ndarray:
        """One step of the plan over `rows`: its segments in order, each on its side; lm = (first, count): the
        rows lm_head computes (None: all), whose logits come back, or with `pick` each one's argmax (taken on
        the device where lm_head ran there); tree_fields: the rows' token-tree masks."""
        T, b = len(rows), self.backend
        plan = self.plan(T)
        state = SegmentState(b, self.counters, rows, self.gpu_layers, self.host.rope,
                             self._kernel_copy if self.ring is not None else None, tree_fields, self.nodes)
        if lm is not None:
            state.lm_rows = np.arange(lm[0], lm[0] + lm[1])
        state.pick = self.picks.pick(pick)
        if self.gpu_layers:          # KV blocks for the positions the step writes, their table entries up
            for kv, lo, hi, start in state.runs:
                b.kv.prepare(kv.device, start, start + hi - lo)
            b.kv.flush()
            b.step_params.stage([(kv.device.base_elements, t, pos) for kv, t, pos in rows], T)
            self.counters.h2d_bytes += b.step_params.upload(T, b.stream)
            self.counters.h2d_bytes += b.step_params.stage_tree(tree_fields, b.stream)
        if self.expert_ring is not None:    # the layers whose every expert this step streams, in its order
            self.expert_ring.begin(list(plan.expert_ring), b.stream)
        first = self.item_graphs.start(plan, state)
        begin = (lambda: None) if self.ring is None else lambda: self.ring.begin_step(plan, b.stream)  # its copies
        if first is None:
            begin()
            self._run_segments(plan, state, lm, 0)
            state.outputs_to_host()
        else:
            self._run_segments(plan, state, lm, 0, first)       # the embed (host work before the graph): eagerly
            self.item_graphs.run(plan, state, lm, first, begin)
        for ring in (self.ring, self.expert_ring):
            if ring is not None:
                self.counters.h2d_bytes += ring.bytes_per_step
                self.counters.streamed_bytes = (self.counters.streamed_bytes or 0) + ring.bytes_per_step
        if state.picked:
            return self.picks.tokens(state.logit_rows)
        out = state.host["logits"][:state.logit_rows]
        return np.argmax(out, axis=1) if pick == "argmax" else out

    def _run_segments(self, plan, state: SegmentState, lm: tuple[int, int] | None, lo: int, hi: int | None = None,
                      nodes: list | None = None) -> None:
        """Segments lo..hi-1 of the plan, each on its side; while a step graph is captured (state.graphing) the
        host segments go in as host nodes, each appended to `nodes` as (program, its node)."""
        for index, segment in enumerate(plan.segments[lo:hi], lo):
            if segment.side == "cpu":
                inputs, program = self._host_program(state.T, index, segment)
                state.to_host(inputs)
                if not state.graphing:
                    program.run(state)
                    continue
                nodes.append(self.item_graphs.host_item(plan, index, state, lm, program.one_call))
                continue
            state.call = {}
            ops = [op for op in segment.ops if scheduler.runs_alone(op)]
            if state.graphing:            # a routed layer's device experts may wait for its host item's hand-off
                ops = self.item_graphs.defer(plan, index, ops, state)
            self.segment_graphs.run(index, ops, state, lm)
            if prof.enabled:      # attribute GPU time to gemm, not to the next sync
                start = time.perf_counter()
                state.stream.synchronize()
                state.call["gemm"] = state.call.get("gemm", 0.0) + (time.perf_counter() - start) * 1e6

    def _host_program(self, T: int, index: int, segment) -> tuple:
        """(what the segment reads, its HostProgram), bound once per step size."""
        key = (T, index)
        if key not in self._host_programs:
            self._host_programs[key] = (scheduler.segment_inputs(segment.ops), self.host.program(segment.ops, "cpu "))
        return self._host_programs[key]

    def _prepared_for(self, op, T: int, lm: tuple[int, int] | None) -> tuple:
        """_prepare's tuple for `op` in steps of T tokens, worked out once per op and size (lm_head's per its rows)."""
        lm_rows = lm if op.group == "lm_head" and lm is not None and lm != (0, T) else None
        key = (op.name, T) if lm_rows is None else (op.name, T, lm_rows)
        prepared = self._prepared.get(key)
        if prepared is None:
            prepared = self._prepared[key] = self._prepare(op, T, lm_rows)
        return prepared

    def _upload(self, reads, prologue, state: SegmentState) -> None:
        """What an op reads that the device lacks (the step program's reads; params: staged per step)."""
        for name in reads:
            if name == "xn":
                state.xn_to_device(prologue, self.config.rms_norm_eps)
            else:
                state.to_device(name)

    def _device_op(self, op, state: SegmentState, lm: tuple[int, int] | None = None) -> None:
        """One op of a device segment: upload what it reads that the device lacks, then its launches (lm_head's
        on the rows `lm` names).  What does not change between steps is worked out once per op and size."""
        reads, prologue, launches, ring, nbytes, prepares = self._prepared_for(op, state.T, lm)
        timed = prof.enabled
        start = time.perf_counter() if timed else 0.0
        self._upload(reads, prologue, state)
        if timed:
            state.call["h2d"] = state.call.get("h2d", 0.0) + (time.perf_counter() - start) * 1e6
            start = time.perf_counter()
        stream = self.backend.stream
        if ring is not None:
            ring.before(op.name, stream)
        if trace.active is None:
            for launch in launches:
                launch.enqueue(stream)
        else:
            with trace.span(f"gpu {op.group or op.kind}", op=op.name, layer=-1 if op.layer is None else op.layer,
                            flops=float(op.flops), bytes=int(op.weight_bytes), segment="gpu"):
                for launch in launches:
                    launch.enqueue(stream)
        if ring is not None:
            ring.after(op.name, stream)
        if timed:
            state.call["gemm"] = state.call.get("gemm", 0.0) + (time.perf_counter() - start) * 1e6
        self.counters.launches += len(launches)
        self.counters.gpu_weight_read_bytes += nbytes
        state.device_wrote(op, prepares)

    def _prepare(self, op, T: int, lm_rows) -> tuple:
        """(reads, the prologue's norm weight, launches, the ring it waits on or None, weight bytes, the norm its
        epilogue prepares) of an op in steps of T tokens."""
        b = self.backend
        streamed = self.ring is not None and self.ring.streams(op.name)
        ring = self.ring if streamed else None
        expert_slot = None           # a routed layer whose experts stream: its router and experts read its slot's table
        experts = self.expert_ring
        if experts is not None and op.kind in ("router", "experts") and experts.streams(f"L{op.layer}.experts"):
            expert_slot = experts.slot(op.layer)
            ring = experts if op.kind == "experts" else None
        reads = tuple(name for name in op.device_reads() if name == "xn" or name in b.pinned.widths)
        weight = self.ring.qweight(op.name, self.ring.order[op.name]) if streamed else None
        launches = ([] if lm_rows is not None and lm_rows[1] == 0 else
                    b.ops.launches(op, T, lm_rows, weight, expert_slot))
        for launch in launches:
            launch.label(op=op.name, layer=op.layer, segment="gpu")
        return (reads, norm_weight(self.weights, op.prologue) if op.prologue else None, launches, ring,
                sum(launch.labels.get("bytes", 0) for launch in launches),
                norm_weight(self.weights, op.prepares) if op.prepares else None)
