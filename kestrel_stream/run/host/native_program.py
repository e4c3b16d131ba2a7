"""A host segment of the step program as one call into the native library (native/host_program.c).

The same ops as HostProgram's, bound once to the library's op list: a projection is a bound Linear (its
norm prologue and SiLU·mul epilogue inside), then the residual add; rope and attention run per session
over its cache; a routed layer's router and experts are routed.py's bound structs (host_moe.c), the
experts op of a split layer adding the device part's sum (moe_out) with its own.  The numbers are those
of the per-op native calls, bit for bit (the same C functions in the same order, a float32 add for the
residual as numpy's); what goes away is the Python around each op.  The embedding's rows are gathered in
Python first, as the per-op program does.  cpu mode runs its whole step through `run`; a mixed step's
host segment goes through `run_state` over its pinned state (what the segment reads copied in, what it
writes written back through the state).

`bind` returns None where a segment has an op the list has no entry for (a split group, an expert in two
formats): HostProgram runs those, and the steps with a token tree (numpy's masked attention).  Buffers are kept between steps and grow to the largest step (logits are new each
step: the caller keeps them), so a program runs one step at a time (the engine's step lock).
"""
from __future__ import annotations

import ctypes
import time

import numpy as np

from kestrel_stream.model.op_tensors import fused_tensor
from kestrel_stream.obs import trace
from kestrel_stream.native.routed import Experts
from kestrel_stream.run.host.arithmetic import attention_scale
from kestrel_stream.run.host.routed import expert_bytes, native_experts, native_router
from kestrel_stream.run.host_nodes import ProgramNode
from scheduler import segment_inputs
from scheduler.ops import runs_alone

X, QKV, Q, ATTN, ACT, LOGITS, TMP, XL, ROUTE, MOE_OUT = range(10)    # the step's buffers (host_program.c: KS_BUFFERS)
BUFFER_OF = {"x": X, "attn": ATTN, "act": ACT}           # what a projection reads
# what a segment may find made before it
INPUT_OF = {"x": X, "qkv": QKV, "attn": ATTN, "act": ACT, "route": ROUTE, "moe_out": MOE_OUT}
OUTPUT_OF = {"x": X, "qkv": QKV, "q": Q, "attn": ATTN, "act": ACT, "logits": LOGITS, "route": ROUTE}
OP_LINEAR, OP_ADD, OP_SILU_MUL, OP_QKV_ROPE, OP_ATTENTION, OP_ROUTER, OP_EXPERTS = range(7)
# a host node's buffers that are the mixed step's pinned state (device/backend.PinnedState's names)
PINNED_OF = {"x": X, "qkv": QKV, "attn": ATTN, "act": ACT, "logits": LOGITS, "route": ROUTE, "moe_out": MOE_OUT}

_i, _f, _p, _z = ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_ssize_t


class Op(ctypes.Structure):
    _fields_ = [("kind", _i), ("in_", _i), ("out", _i), ("col", _i), ("gather", _i), ("n", _i), ("layer", _i),
                ("H", _i), ("n_kv", _i), ("D", _i), ("window", _i), ("eps", _f), ("scale", _f), ("linear", _p),
                ("bias", _p), ("qk_norm", _p), ("router", _p), ("experts", _p)]


class Run(ctypes.Structure):
    _fields_ = [("lo", _i), ("hi", _i), ("start", _i), ("first", _i), ("layer_stride", _z), ("k", _p), ("v", _p)]


class Step(ctypes.Structure):
    _fields_ = [("T", _i), ("n_runs", _i), ("n_lm", _i), ("threads", _i), ("buf", _p * 10), ("width", _z * 10),
                ("cos_t", _p), ("sin_t", _p), ("runs", _p), ("lm_rows", _p), ("op_ns", _p)]


def _op(kind: int, in_: int, out: int, **fields) -> Op:
    return Op(kind=kind, in_=in_, out=out, gather=fields.pop("gather", -1), **fields)


def _projection(backend, op, keep: list) -> list[Op] | None:
    """norm → matmul (→ SiLU·mul) → write, or → add into x (o, down)."""
    c, kernels, role = backend.config, backend.kernels, op.group
    tensor = fused_tensor(backend.weights, op)
    if sum(hi - lo for lo, hi in op.row_ranges) != tensor.shape[0]:
        return None                                   # a split group's host part
    norm = backend.norm(op.prologue) if op.prologue else None
    parts = backend.prepared_parts(tensor)
    glu_inside = role == "gate_up" and len(parts) == 1
    out = {"qkv": QKV, "gate_up": ACT if glu_inside else TMP, "lm_head": LOGITS, "o": TMP, "down": TMP}[role]
    ops = []
    for col, prepared in parts:
        linear = kernels.linear(prepared, norm, c.rms_norm_eps, glu_inside)
        keep.append(linear)
        ops.append(_op(OP_LINEAR, BUFFER_OF[op.reads[0]], out, col=col, linear=linear.spec_address,
                       gather=XL if role == "lm_head" else -1))
    if role in ("o", "down"):
        ops.append(_op(OP_ADD, TMP, X, n=c.hidden_size))
    elif role == "gate_up" and not glu_inside:
        ops.append(_op(OP_SILU_MUL, TMP, ACT, n=c.intermediate_size))
    return ops


def _rope(backend, op, keep: list) -> list[Op]:
    c, layer = backend.config, op.layer
    bias, qk_norm = backend.qkv_bias[layer], backend.qk_norms[layer]
    qk_norm = None if qk_norm is None else np.ascontiguousarray(qk_norm)
    keep.extend([bias, qk_norm])
    return [_op(OP_QKV_ROPE, QKV, Q, layer=layer, H=c.num_attention_heads, n_kv=c.num_key_value_heads, D=c.head_dim,
                eps=c.rms_norm_eps, bias=None if bias is None else bias.ctypes.data,
                qk_norm=None if qk_norm is None else qk_norm.ctypes.data)]


def _attention(backend, op, keep: list) -> list[Op]:
    c = backend.config
    return [_op(OP_ATTENTION, Q, ATTN, layer=op.layer, H=c.num_attention_heads, n_kv=c.num_key_value_heads,
                D=c.head_dim, window=c.sliding_window or 0, scale=float(attention_scale(c.head_dim)))]


def projection_bytes(backend, op) -> int:
    """The weight bytes a projection reads, as HostProgram counts them."""
    tensor = fused_tensor(backend.weights, op)
    return sum(hi - lo for lo, hi in op.row_ranges) * tensor.nbytes // tensor.shape[0]


def _router(backend, op, keep: list) -> list[Op] | None:
    bound = native_router(backend, op)
    if bound is None:
        return None
    keep.append(bound)
    return [_op(OP_ROUTER, X, ROUTE, router=bound.spec_address)]


def _experts(backend, op, keep: list) -> list[Op] | None:
    """x += the chosen experts' sum (+ the device part's, moe_out, where the layer is split)."""
    bound = native_experts(backend, op)
    if bound is None:
        return None
    keep.append(bound)
    return [_op(OP_EXPERTS, ROUTE, X, experts=bound.spec_address, gather=MOE_OUT if "moe_out" in op.reads else -1)]


# op kind -> the ops of the library's list it is (embed runs before the call; other kinds: no entry)
NATIVE = {"projection": _projection, "rope": _rope, "attention": _attention, "router": _router, "experts": _experts}


class NativeProgram:
    """A whole step's segment (embed first) as one library call; `run` returns the logits rows."""

    @classmethod
    def bind(cls, backend, ops) -> NativeProgram | None:
        ops = [op for op in ops if runs_alone(op)]
        if backend.kernels is None or not ops:
            return None
        if any(name not in INPUT_OF for name in segment_inputs(ops)):
            return None
        keep, listed, owners = [], [], []
        for i, op in enumerate(ops):
            if op.kind == "embed" and i == 0:
                continue
            bound = NATIVE[op.kind](backend, op, keep) if op.kind in NATIVE else None
            if bound is None:
                return None
            listed.extend(bound)
            owners.extend([i] * len(bound))
        return cls(backend, ops, listed, keep, owners)

    def __init__(self, backend, ops, listed: list[Op], keep: list, owners: list[int]):
        c, kernels = backend.config, backend.kernels
        self.backend, self.counters, self.embed = backend, backend.counters, backend.weights.embed
        self.ops = (Op * len(listed))(*listed)
        self.step_ops = ops
        self.owners = np.asarray(owners, np.int64)       # the step program's op each listed op is part of
        self.keep = keep                                  # the bound Linears and vectors the list points into
        self.embeds = ops[0].kind == "embed"
        self.reads_caches = any(op.kind in ("rope", "attention") for op in ops)    # else: no host cache
        self.inputs = segment_inputs(ops)
        written = dict.fromkeys(name for op in ops for name in op.writes)
        self.outputs = [name for name in written if name in OUTPUT_OF]
        self.weight_bytes = sum(projection_bytes(backend, op) for op in ops if op.kind == "projection")
        # a routed layer's experts: its bound ops and the bytes of one expert (a step counts those it ran)
        self.routed = list(zip([bound for bound in keep if isinstance(bound, Experts)],
                               [expert_bytes(backend, op) for op in ops if op.kind == "experts"]))
        self.routed_layers = [op.layer for op in ops if op.kind == "experts"]
        self.embed_row_bytes = self.embed.nbytes // self.embed.shape[0]
        self.head_dim = c.head_dim
        self.widths = [c.hidden_size, c.q_size + 2 * c.kv_size, c.q_size, c.q_size, c.intermediate_size, c.vocab_size,
                       max(c.hidden_size, 2 * c.intermediate_size), c.hidden_size, 2 * c.num_experts_per_tok,
                       c.hidden_size]
        self.buffers: list[np.ndarray] = []
        self.rows = 0
        self.step = Step(threads=kernels.threads)
        for i, width in enumerate(self.widths):
            self.step.width[i] = width
        self.call = kernels.program_call
        self._nodes: dict = {}                # (tokens, lm rows) -> (its ProgramNode, the step and arrays it points at)

    def _grow(self, rows: int) -> None:
        self.rows = max(rows, 2 * self.rows)
        self.buffers = [np.empty((self.rows, w), np.float32) if i != LOGITS else None for i, w in enumerate(self.widths)]
        for i, b in enumerate(self.buffers):
            if b is not None:
                self.step.buf[i] = b.ctypes.data

    def run(self, ids: np.ndarray, runs: list, cos: np.ndarray, sin: np.ndarray,
            lm_rows: np.ndarray | None) -> np.ndarray:
        """A whole cpu step: ids [T]; runs: (cpu-mode cache, first row, end row, start position) per
        session; cos, sin: rope_rotation's rows [T, 1, D]; lm_rows: the rows lm_head computes (None: all)
        → logits."""
        return self._call(ids, [(kv, 0, lo, hi, start) for kv, lo, hi, start in runs], cos, sin, lm_rows)

    def run_state(self, state, span_prefix: str = "") -> None:
        """A segment over a StepState (program.StepState: a mixed step's pinned state): the state it
        reads before writing copied in, every state it writes written back through the state.
        span_prefix: what the trace's slices of its ops start with (HostProgram's)."""
        t = state.T
        if t > self.rows:
            self._grow(t)
        for name in self.inputs:
            self.buffers[INPUT_OF[name]][:t] = state.read(name)
        runs = [(cache, first, lo, hi, start) for kv, lo, hi, start in state.runs
                for cache, first in [state.host_kv(kv)]] if self.reads_caches else []
        logits = self._call(state.ids, runs, state.cos, state.sin, state.lm_rows, span_prefix)
        for name in self.outputs:
            buffer = OUTPUT_OF[name]
            value = logits if buffer == LOGITS else self.buffers[buffer][:t]
            state.write(name, value.reshape(t, -1, self.head_dim).copy() if name == "q" else value)

    def _call(self, ids, runs: list, cos, sin, lm_rows, span_prefix: str = "") -> np.ndarray:
        """runs: (cache, the first layer it holds, first row, end row, start position) per session.
        Traced, each op of the step program is a host slice timed inside the call (the library reads the
        clock around each of its ops), named as HostProgram names its per-op calls."""
        t, step, rec = len(ids), self.step, trace.active
        if t > self.rows:
            self._grow(t)
        embed_start = time.perf_counter_ns()
        if self.embeds:
            dense = self.backend.dense_if_built(self.embed)        # built when it is the tied lm_head
            self.buffers[X][:t] = dense[ids] if dense is not None else self.embed.dequantize_rows(ids)
        lm = None if lm_rows is None else np.ascontiguousarray(lm_rows, np.int64)
        logits = np.empty((t if lm is None else len(lm), self.widths[LOGITS]), np.float32)
        for cache, _, _, _, _ in runs:
            assert cache.k.dtype == np.float32 and cache.k.flags.c_contiguous and cache.v.flags.c_contiguous
        table = (Run * len(runs))(*[Run(lo, hi, start, first, cache.k[0].size, cache.k.ctypes.data,
                                        cache.v.ctypes.data) for cache, first, lo, hi, start in runs])
        cos, sin = np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32)
        step.T, step.n_runs, step.n_lm = t, len(runs), len(logits)
        step.buf[LOGITS] = logits.ctypes.data
        step.cos_t, step.sin_t, step.runs = cos.ctypes.data, sin.ctypes.data, ctypes.addressof(table)
        step.lm_rows = None if lm is None else lm.ctypes.data
        times = np.zeros(2 * len(self.ops), np.int64) if rec is not None else None
        step.op_ns = None if times is None else times.ctypes.data
        embed_end = time.perf_counter_ns()
        failed = self.call(self.ops, len(self.ops), ctypes.byref(step))
        step.op_ns = None
        if times is not None:
            self._trace(rec, span_prefix, times, embed_start, embed_end, failed)
        self.count_run(t, failed)
        return logits

    def count_run(self, tokens: int, failed: int = 0) -> None:
        """After a call (or a host node's run): its failure raised, else its weight bytes counted (the routed
        layers' by the experts each one ran)."""
        if failed:
            raise MemoryError(f"host kernels: step op {failed - 1} failed (no memory)")
        self.counters.cpu_weight_read_bytes += self.weight_bytes + (tokens * self.embed_row_bytes if self.embeds else 0)
        self.counters.cpu_weight_read_bytes += sum(bound.used * nbytes for bound, nbytes in self.routed)

    def node(self, state) -> ProgramNode | None:
        """This segment as a host node of a step graph (run/host_nodes.py) over `state`'s pinned buffers, made
        once per step size and lm rows; None where it cannot be one: it embeds or reads the sessions' caches
        (rows and positions that change between steps), or a pinned buffer is not of its width."""
        if self.embeds or self.reads_caches:
            return None
        lm = None if state.lm_rows is None else tuple(int(r) for r in state.lm_rows)
        made = self._nodes.get((state.T, lm))
        if made is None:
            step = Step(T=state.T, threads=self.step.threads, n_lm=state.logit_rows)
            own = []                          # its buffers that are not the state's (the same for every step)
            for i, width in enumerate(self.widths):
                step.width[i] = width
                name = next((n for n, b in PINNED_OF.items() if b == i and n in state.widths), None)
                if name is not None and state.widths[name] != width:
                    return None
                if name is not None:
                    step.buf[i] = state.pinned[name].address
                else:
                    own.append(np.empty((state.T, width), np.float32))
                    step.buf[i] = own[-1].ctypes.data
            rows = None if lm is None else np.asarray(lm, np.int64)
            step.lm_rows = None if rows is None else rows.ctypes.data
            node = ProgramNode(ops=ctypes.addressof(self.ops), n_ops=len(self.ops), step=ctypes.addressof(step))
            made = self._nodes[(state.T, lm)] = (node, step, own, rows)
        return made[0]

    def _trace(self, rec, span_prefix: str, times: np.ndarray, embed_start: int, embed_end: int,
               failed: int) -> None:
        """One host slice per op of the step program the call ran (from its first listed op's start to
        its last one's end); the embedding's gather (Python, before the call) as the first."""
        ran = len(self.ops) if not failed else failed
        starts, ends = times[0:2 * ran:2], times[1:2 * ran:2]
        spans = {}
        for owner, start, end in zip(self.owners[:ran].tolist(), starts.tolist(), ends.tolist()):
            first, _ = spans.get(owner, (start, end))
            spans[owner] = (first, end)
        if self.embeds:
            spans[0] = (embed_start, embed_end)
        for index in sorted(spans):
            op = self.step_ops[index]
            start, end = spans[index]
            if end < start:              # the op failed before its end was read
                end = start
            rec.host_slice(f"{span_prefix}{op.group or op.kind}", start, end, op=op.name,
                           layer=-1 if op.layer is None else op.layer, flops=float(op.flops),
                           bytes=int(op.active_weight_bytes), segment="cpu")
