"""The host backend's op table: each op kind of the step program (scheduler/ops.py) bound to its host
function, once per segment (projections through HostBackend.linear: the native kernels, or numpy).

A HostProgram is a segment's ops in the plan's order, each op that runs alone as one call; a norm is the
prologue of the projection that reads it and SiLU·mul the epilogue of gate_up, on the host as on the
device, so the ops that call something here are the ops the device launches.  cpu mode runs the whole
step as one program; gated and layers=N run their host segments as programs over the pinned state
(run/mixed.py); KESTREL_VERIFY runs the whole step on it.  With the native kernels a projection is one
call (its norm prologue and gate_up's SiLU·mul inside: HostBackend.fused_linear), rope one call per
session (kernels.qkv_rope), attention one call per session (a token tree's masked rows in numpy) and a
routed layer's router and experts one call each (routed.py); numpy runs each of those as its own numpy
ops, the reference arithmetic.  Where a segment's ops all have a
native entry, `run` makes them one library call (native_program.py: the same numbers as these calls);
a trace times each op, so a traced step calls them one by one.

A program reads and writes the step's state through a StepState: `read(name)`, `write(name, value)`,
`add(name, value)` (the residual stream) and `write_rows(name, lo, hi, value, width)` (a split group's
part), over [T, width] float32 rows.  HostState keeps them as arrays the step makes; mixed.PinnedState
keeps them in the pinned buffers the device reads and writes, and moves them only where segments meet.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from kestrel_stream.model.op_tensors import fused_tensor
from kestrel_stream.obs import trace
from kestrel_stream.run.host import routed
from kestrel_stream.run.host.arithmetic import attention, rmsnorm, rotate, silu_mul
from kestrel_stream.run.host.native_program import NativeProgram
from kestrel_stream.run.token_tree import visible_keys
from scheduler.ops import runs_alone


class StepState(Protocol):
    """The state of one step as the host program sees it (rows = the step's tokens)."""
    T: int
    ids: np.ndarray            # token ids [T]
    runs: list                 # (kv, first row, end row, start position) per session, in row order
    cos: np.ndarray            # rope tables of the rows' positions, rope_rotation's form [T, 1, D]
    sin: np.ndarray
    lm_rows: np.ndarray | None     # the rows lm_head computes (None: all)
    tree_fields: tuple | None  # the rows' token-tree masks (token_tree.step_tree_fields); None: no tree

    def read(self, name: str) -> np.ndarray: ...

    def write(self, name: str, value: np.ndarray) -> None: ...

    def add(self, name: str, value: np.ndarray) -> None: ...

    def write_rows(self, name: str, lo: int, hi: int, value: np.ndarray, width: int) -> None: ...

    def host_kv(self, kv) -> tuple:
        """(the host cache of session `kv`, the first layer it holds)."""


class HostState:
    """A step's state as arrays the step makes (cpu mode, KESTREL_VERIFY)."""

    def __init__(self, ids: np.ndarray, runs: list, cos: np.ndarray, sin: np.ndarray,
                 lm_rows: np.ndarray | None = None, tree_fields: tuple | None = None):
        self.T, self.ids, self.runs, self.cos, self.sin, self.lm_rows = len(ids), ids, runs, cos, sin, lm_rows
        self.tree_fields = tree_fields
        self.arrays: dict[str, np.ndarray] = {}

    def read(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def write(self, name: str, value: np.ndarray) -> None:
        self.arrays[name] = value

    def add(self, name: str, value: np.ndarray) -> None:
        self.arrays[name] = self.arrays[name] + value

    def write_rows(self, name: str, lo: int, hi: int, value: np.ndarray, width: int) -> None:
        if name not in self.arrays:
            self.arrays[name] = np.empty((len(value), width), np.float32)
        self.arrays[name][:, lo:hi] = value

    @staticmethod
    def host_kv(kv):
        return kv, 0        # a cpu-mode cache holds every layer


class HostProgram:
    """One segment of the step program as host calls, bound once; `run(state)` runs them in order."""

    def __init__(self, backend, ops, span_prefix: str = ""):
        """span_prefix: what the trace's host slices of these ops start with ("cpu " in a mixed step)."""
        self.ops = [op for op in ops if runs_alone(op)]
        self.calls = [BIND[op.kind](backend, op) for op in self.ops]
        self.span_prefix = span_prefix
        self.one_call = NativeProgram.bind(backend, ops)      # the same calls as one, where they bind

    def run(self, state: StepState) -> None:
        if self.one_call is not None and state.tree_fields is None:
            self.one_call.run_state(state, self.span_prefix)      # traced: it times each op itself
            return
        if trace.active is None:
            for call in self.calls:
                call(state)
            return
        for op, call in zip(self.ops, self.calls):
            with trace.span(f"{self.span_prefix}{op.group or op.kind}", op=op.name, layer=-1 if op.layer is None else op.layer,
                            flops=float(op.flops), bytes=int(op.active_weight_bytes), segment="cpu"):
                call(state)


def _embed(backend, op):
    table, counters = backend.weights.embed, backend.counters
    row_bytes = table.nbytes // table.shape[0]

    def run(state: StepState) -> None:
        dense = backend.dense_if_built(table)        # built when it is the tied lm_head
        state.write("x", dense[state.ids] if dense is not None else table.dequantize_rows(state.ids))
        counters.cpu_weight_read_bytes += state.T * row_bytes
    return run


def _projection(backend, op):
    """qkv, o, gate_up, down, lm_head (or a split group's part): the prologue's norm, the matmul
    (HostBackend.linear), the epilogue (residual add, SiLU·mul)."""
    c, counters = backend.config, backend.counters
    tensor = fused_tensor(backend.weights, op)
    norm = backend.norm(op.prologue) if op.prologue else None
    rows = sum(hi - lo for lo, hi in op.row_ranges)
    nbytes = rows * tensor.nbytes // tensor.shape[0]
    eps, source, role, inter = c.rms_norm_eps, op.reads[0], op.group, c.intermediate_size
    whole = rows == tensor.shape[0]
    if whole and backend.kernels is not None:
        return _native_projection(backend, op, tensor, norm, nbytes)
    matmul = backend.linear(tensor) if whole else None        # x [T, K] -> x @ W.T
    norm_rows = rmsnorm if backend.kernels is None else backend.kernels.rmsnorm

    def x_in(state: StepState) -> np.ndarray:
        if norm is None:                         # o, down: attention's output, silu(gate)·up
            return state.read(source)
        x = state.read("x")
        if role == "lm_head" and state.lm_rows is not None:
            x = x[state.lm_rows]                 # lm_head on the wanted rows alone
        return norm_rows(x, norm, eps)

    if role in ("o", "down"):
        def run(state: StepState) -> None:
            state.add("x", matmul(x_in(state)))
            counters.cpu_weight_read_bytes += nbytes
    elif role == "gate_up":                      # gate and up always share a side (equal shapes)
        def run(state: StepState) -> None:
            gate_up = matmul(x_in(state))
            state.write("act", silu_mul(gate_up[:, :inter], gate_up[:, inter:]))
            counters.cpu_weight_read_bytes += nbytes
    elif whole:                                  # qkv, lm_head
        out = "logits" if role == "lm_head" else "qkv"

        def run(state: StepState) -> None:
            state.write(out, matmul(x_in(state)))
            counters.cpu_weight_read_bytes += nbytes
    else:                                        # a split group's host part: its rows beside the GPU part's
        out = "logits" if role == "lm_head" else "qkv"
        ranges, width = op.row_ranges, op.full_rows
        parts = [(lo, hi, backend.linear(tensor, lo, hi)) for lo, hi in ranges]

        def run(state: StepState) -> None:
            x = x_in(state)
            for lo, hi, part in parts:
                state.write_rows(out, lo, hi, part(x), width)
            counters.cpu_weight_read_bytes += nbytes
    return run


def _native_projection(backend, op, tensor, norm, nbytes):
    """A whole projection on the native kernels: the prologue's norm, the matmul and gate_up's SiLU·mul in
    one call (HostBackend.fused_linear); the residual add through the state."""
    counters, role, source = backend.counters, op.group, op.reads[0]
    call = backend.fused_linear(tensor, norm, backend.config.rms_norm_eps, role == "gate_up")
    if role in ("o", "down"):
        def run(state: StepState) -> None:
            state.add("x", call(state.read(source)))
            counters.cpu_weight_read_bytes += nbytes
        return run
    out = {"gate_up": "act", "lm_head": "logits"}.get(role, "qkv")
    if role == "lm_head":
        def run(state: StepState) -> None:
            x = state.read("x")
            state.write(out, call(x if state.lm_rows is None else x[state.lm_rows]))
            counters.cpu_weight_read_bytes += nbytes
        return run

    def run(state: StepState) -> None:
        state.write(out, call(state.read(source)))
        counters.cpu_weight_read_bytes += nbytes
    return run


def _rope(backend, op):
    """Qwen2's q/k/v bias, Qwen3's per-head q/k norm, RoPE, and the new keys and values into each
    session's cache; q for attention."""
    c, layer = backend.config, op.layer
    heads, q_heads, D = c.num_attention_heads + c.num_key_value_heads, c.num_attention_heads, c.head_dim
    qk_size, kv_heads, eps = c.q_size + c.kv_size, c.num_key_value_heads, c.rms_norm_eps
    bias, qk_norm = backend.qkv_bias[layer], backend.qk_norms[layer]
    swap, kernels = backend.rope_swap, backend.kernels
    if kernels is not None:
        qk_norm = None if qk_norm is None else np.ascontiguousarray(qk_norm)

        def native(state: StepState) -> None:
            qkv, cos, sin = state.read("qkv"), state.cos, state.sin
            q = np.empty((state.T, q_heads, D), np.float32)
            for kv, lo, hi, start in state.runs:
                cache, first = state.host_kv(kv)
                end = start + hi - lo
                kernels.qkv_rope(qkv[lo:hi], q_heads, kv_heads, bias, qk_norm, eps, cos[lo:hi], sin[lo:hi], q[lo:hi],
                                 cache.k[layer - first, start:end], cache.v[layer - first, start:end])
            state.write("q", q)
        return native

    def run(state: StepState) -> None:
        qkv = state.read("qkv")
        if bias is not None:
            qkv = qkv + bias
        qk = qkv[:, :qk_size].reshape(-1, heads, D)
        if qk_norm is not None:
            qk = rmsnorm(qk, qk_norm, eps)
        qk = rotate(qk, state.cos, state.sin, swap)
        v = qkv[:, qk_size:].reshape(-1, kv_heads, D)
        state.write("q", qk[:, :q_heads])
        k = qk[:, q_heads:]
        for kv, lo, hi, start in state.runs:
            cache, first = state.host_kv(kv)
            cache.k[layer - first, start:start + hi - lo] = k[lo:hi]
            cache.v[layer - first, start:start + hi - lo] = v[lo:hi]
    return run


def _attention(backend, op):
    """Each session's queries over its own cache (causal; a sliding window where the model has one)."""
    c, layer, window = backend.config, op.layer, backend.config.sliding_window
    if backend.kernels is not None:
        return _native_attention(backend, op)

    def run(state: StepState) -> None:
        q = state.read("q")
        if len(state.runs) == 1:                 # one session: no slicing by session
            kv, lo, hi, start = state.runs[0]
            cache, first = state.host_kv(kv)
            end = start + hi - lo
            state.write("attn", attention(q, cache.k[layer - first, :end], cache.v[layer - first, :end], start,
                                          window, tree_mask(state, 0, end)))
            return
        attn = np.empty((state.T, c.q_size), np.float32)
        for i, (kv, lo, hi, start) in enumerate(state.runs):
            cache, first = state.host_kv(kv)
            end = start + hi - lo
            attn[lo:hi] = attention(q[lo:hi], cache.k[layer - first, :end], cache.v[layer - first, :end], start,
                                    window, tree_mask(state, i, end))
        state.write("attn", attn)
    return run


def tree_mask(state: StepState, run: int, keys: int) -> np.ndarray | None:
    """The keys the rows of run `run` see where the step has a token tree (None: causal)."""
    if state.tree_fields is None:
        return None
    _, lo, hi, start = state.runs[run]
    _, span, bits = state.tree_fields
    return visible_keys(span[lo:hi], bits[lo:hi], np.arange(start, start + hi - lo), keys)


def _native_attention(backend, op):
    """Each session's queries over its own cache: on the native kernels (its first start + n rows), or
    with numpy's masked attention where the step has a token tree."""
    c, layer, window, kernels = backend.config, op.layer, backend.config.sliding_window, backend.kernels

    def run(state: StepState) -> None:
        q, attn = state.read("q"), np.empty((state.T, c.q_size), np.float32)
        for i, (kv, lo, hi, start) in enumerate(state.runs):
            cache, first = state.host_kv(kv)
            k, v = cache.k[layer - first], cache.v[layer - first]
            end = start + hi - lo
            mask = tree_mask(state, i, end)
            if mask is None:
                kernels.attention(q[lo:hi], k, v, start, window, out=attn[lo:hi])
            else:               # a token tree: numpy's masked attention
                attn[lo:hi] = attention(q[lo:hi], k[:end], v[:end], start, window, mask)
        state.write("attn", attn)
    return run


# op kind -> the function that binds one op of it (a new op kind is a new entry here)
BIND = {"embed": _embed, "projection": _projection, "rope": _rope, "attention": _attention,
        "router": routed.router, "experts": routed.experts}
