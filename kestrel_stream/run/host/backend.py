"""The host backend: the weights as the host multiplies them, rope tables and KV caches on the host, and
the step program's host segments run as HostPrograms (program.py).

A projection runs on the native host kernels (kestrel_stream/native: the weight's own quantized blocks,
activations quantized per block, integer dot products) where they build for this machine, or on a
float32 copy of the weight with numpy (`KESTREL_HOST_KERNELS=numpy`, or no C compiler: one line says so):
the reference arithmetic, which KESTREL_VERIFY and the oracle tests hold the rest to.

cpu mode's executor hands every step to `forward` (its plan is one host segment, the whole step);
gated and layers=N run their host segments through `program`; KESTREL_VERIFY recomputes the GPU's steps
with `forward` (verify.py).  numpy's float copies are built once per weight on first use and kept (one
float copy of the model); the embedding is never dequantized whole unless it is also the (tied) lm_head.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

import scheduler
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.model.op_tensors import norm_weight
from kestrel_stream.model.quant import QTensor
from kestrel_stream.model.quant4 import tensor_format, tensor_key, tensor_parts
from kestrel_stream.model.weights import ModelWeights
from kestrel_stream.options import Options
from kestrel_stream.run.executor import StepCounters
from kestrel_stream.run.host.arithmetic import model_rope_tables, rope_rotation
from kestrel_stream.run.host.program import HostProgram, HostState
from kestrel_stream.run.host.repacked import RepackedTensor, repacked_weights
from kestrel_stream.run.steps import Steps
from kestrel_stream.run.token_tree import step_tree_fields


@dataclass
class CpuKV:
    """One session's KV cache on the host: k, v [L, max_seq_len, n_kv, D] float32."""
    k: np.ndarray
    v: np.ndarray

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


def session_runs(batch, trees: list | None = None) -> tuple[np.ndarray, np.ndarray, list]:
    """A batch of (kv, token ids [n_i], start position) as the step's rows: ids [T], positions [T] and the
    sessions as runs of rows (kv, first row, end row, start position).  trees: per session a TokenTree
    (run/token_tree.py) or None; a tree's rows sit at start + their depth."""
    if len(batch) == 1 and (trees is None or trees[0] is None):
        kv, ids, start = batch[0]
        ids = np.asarray(ids, np.int64).reshape(-1)
        return ids, np.arange(start, start + len(ids)), [(kv, 0, len(ids), start)]
    ids = np.concatenate([np.asarray(t, np.int64).reshape(-1) for _, t, _ in batch])
    positions = np.concatenate([np.arange(p, p + len(np.atleast_1d(t))) if trees is None or trees[i] is None
                                else p + trees[i].depth for i, (_, t, p) in enumerate(batch)])
    runs, lo = [], 0
    for kv, t, start in batch:
        hi = lo + len(np.atleast_1d(t))
        runs.append((kv, lo, hi, start))
        lo = hi
    return ids, positions, runs


_NATIVE: dict = {}      # (settings) -> HostKernels or the reason they are unavailable: loaded once a process


def native_kernels(options: Options | None):
    """The native host kernels `options` ask for, or None (numpy): asked not to, or they do not build here
    (said once, in one line)."""
    if options is None or options.host_kernels == "numpy":
        return None
    key = (options.host_isa, options.host_cc, options.host_spin_us, options.host_threads, options.host_kernel_cache)
    if key not in _NATIVE:
        from kestrel_stream import native
        try:
            _NATIVE[key] = native.load(options, threads=options.host_threads)
        except native.NativeUnavailable as e:
            print(e, file=sys.stderr)
            _NATIVE[key] = None
    return _NATIVE[key]


class HostBackend(Steps):
    """Runs whole steps (any mix of sessions and token counts) and host segments; counts into `counters`
    (the executor's; default: its own).  options: which kernels multiply (Options.host_kernels; None: numpy,
    the reference)."""

    def __init__(self, weights: ModelWeights, counters: StepCounters | None = None, options: Options | None = None,
                 sole_reader: bool = False):
        """sole_reader: nothing but this backend reads `weights` (cpu mode): the projections the native kernels
        repack are repacked now and held in that form alone (repacked.py), and `self.weights` is that copy."""
        self.kernels = native_kernels(options)
        if sole_reader and self.kernels is not None:
            weights = repacked_weights(weights, self.kernels)
        self.weights = weights
        self.config: ModelConfig = weights.config
        self._dequantized: dict[int, np.ndarray] = {}
        self._prepared: dict[tuple[int, int, int], object] = {}     # (tensor_key, first row, end) -> PreparedWeight
        # Norm weights as plain float32 arrays (a memory-mapped one would make every result it touches a
        # memmap, each with a Python-level finalizer); q_norm and k_norm stacked per head, [q + kv heads, D].
        plain = lambda a: np.array(a, np.float32)   # noqa: E731
        c = self.config
        self._norms: dict[str, np.ndarray] = {}
        self.qk_norms = [np.concatenate([np.broadcast_to(plain(lw.q_norm), (c.num_attention_heads, c.head_dim)),
                                         np.broadcast_to(plain(lw.k_norm), (c.num_key_value_heads, c.head_dim))])
                         if c.qk_norm else None for lw in weights.layers]
        self.qkv_bias = [plain(lw.qkv_bias) if lw.qkv_bias is not None else None for lw in weights.layers]
        self._cos = self._sin = np.zeros((0, 1, c.head_dim), np.float32)
        half = c.head_dim // 2       # rope_rotation's swap of the halves of a head
        self.rope_swap = np.concatenate([np.arange(half, 2 * half), np.arange(half)])
        self.counters = StepCounters.counting("cpu_weight_read_bytes") if counters is None else counters
        self._whole_step: HostProgram | None = None
        # a mixture-of-experts model's selections per expert of each routed layer, as the host router makes them
        routed = [i for i in range(c.num_hidden_layers) if c.moe_layer(i)]
        self.routed_index = {layer: n for n, layer in enumerate(routed)}
        self.expert_counts = np.zeros((len(routed), c.num_experts), np.int64)
        # routed layer -> e -> expert e's Q8_0 parts in the device's pinned images (mode offload with a link
        # share or an experts' ring: device/expert_ring.host_expert_images), which the native experts read
        self.expert_images: dict = {}

    def plan(self, tokens: int):
        return scheduler.build_plan(self.config, tokens, "cpu")

    def routing_counts(self) -> np.ndarray | None:
        return self.expert_counts.copy() if self.config.is_moe else None

    def program(self, ops, span_prefix: str = "") -> HostProgram:
        """A segment's ops bound to their numpy functions (the callers keep it per plan)."""
        return HostProgram(self, ops, span_prefix)

    # ---- what the programs read ----------------------------------------------------------------------
    def dense(self, w: QTensor) -> np.ndarray:
        """float32 copy of a linear weight (Q8_0 or a block format), built on first use."""
        key = tensor_key(w)
        if key not in self._dequantized:
            self._dequantized[key] = w.dequantize()
        return self._dequantized[key]

    def linear(self, w, lo: int = 0, hi: int | None = None) -> Callable[[np.ndarray], np.ndarray]:
        """x [T, K] float32 -> x @ W[lo:hi].T [T, hi - lo]: on the native kernels over the weight's own
        blocks, or on its float32 copy with numpy."""
        rows = w.shape[0]
        hi = rows if hi is None else hi
        if self.kernels is None:
            dense = self.dense(w)
            dense_t = (dense if (lo, hi) == (0, rows) else dense[lo:hi]).T
            return lambda x: x @ dense_t
        kernels, parts = self.kernels, self.prepared_parts(w, lo, hi)
        if len(parts) == 1:
            prepared = parts[0][1]
            return lambda x: kernels.matmul(x, prepared)

        def stacked(x: np.ndarray) -> np.ndarray:
            out = np.empty((x.shape[0], hi - lo), np.float32)
            for offset, prepared in parts:
                kernels.matmul(x, prepared, out=out[:, offset:offset + prepared.rows])
            return out
        return stacked

    def fused_linear(self, w, norm: np.ndarray | None, eps: float, glu: bool) -> Callable[[np.ndarray], np.ndarray]:
        """On the native kernels: x [T, K] -> rmsnorm(x, norm, eps) @ W.T (no norm: x @ W.T), and with glu
        silu(gate) * up of the result's two halves [T, N/2]; one call into the library where W is one
        format.  (numpy runs the same ops one by one: program.py.)"""
        kernels, parts = self.kernels, self.prepared_parts(w)
        if len(parts) == 1:
            return kernels.linear(parts[0][1], norm, eps, glu)
        stacked, half = self.linear(w), w.shape[0] // 2

        def run(x: np.ndarray) -> np.ndarray:
            y = stacked(x if norm is None else kernels.rmsnorm(x, norm, eps))
            return kernels.silu_mul(y[:, :half], y[:, half:]) if glu else y
        return run

    def prepared_parts(self, w, lo: int = 0, hi: int | None = None) -> list:
        """Rows lo..hi of w as the kernels' prepared weights: (first row - lo, PreparedWeight) per run of
        one format (a RowStack has several), in row order.  Each is made once and kept: a repacked one
        (Q4_K, Q6_K with VNNI) is a copy of its rows, which every program binding them shares; a
        RepackedTensor's are its own."""
        kernels, parts, first = self.kernels, [], 0
        hi = w.shape[0] if hi is None else hi
        for part in tensor_parts(w):
            end = first + part.shape[0]
            if first < hi and lo < end:
                start, stop = max(lo, first) - first, min(hi, end) - first
                key = (tensor_key(part), start, stop)
                if isinstance(part, RepackedTensor):
                    self._prepared[key] = part.piece(start, stop)
                if key not in self._prepared:
                    piece = part.rows(start, stop)
                    self._prepared[key] = (kernels.prepare_q8_0(piece.qs, piece.scales) if tensor_format(piece) == "Q8_0"
                                           else kernels.prepare_blocks(piece.fmt, piece.blocks, piece.cols))
                parts.append((max(lo, first) - lo, self._prepared[key]))
            first = end
        return parts

    def dense_if_built(self, w: QTensor) -> np.ndarray | None:
        return self._dequantized.get(tensor_key(w))

    def norm(self, name: str) -> np.ndarray:
        """A norm op's weight ("L3.attn_norm", "final_norm") as a plain float32 array."""
        if name not in self._norms:
            self._norms[name] = np.array(norm_weight(self.weights, name), np.float32)
        return self._norms[name]

    def rope(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, signed sin [T, 1, D] for positions [T] (rope_rotation's form): rows of tables built once for
        every position so far (each row's arithmetic is rope_tables' own), so a step indexes them."""
        need = int(positions.max()) + 1
        if need > len(self._cos):
            size = max(need, 2 * len(self._cos), 64)
            self._cos, self._sin, _ = rope_rotation(*model_rope_tables(np.arange(size), self.config))
        return self._cos[positions], self._sin[positions]

    # ---- KV caches -----------------------------------------------------------------------------------
    def alloc_kv(self, max_seq_len: int, layers: int | None = None) -> CpuKV:
        c = self.config
        shape = (c.num_hidden_layers if layers is None else layers, max_seq_len, c.num_key_value_heads, c.head_dim)
        return CpuKV(np.zeros(shape, np.float32), np.zeros(shape, np.float32))

    def free_kv(self, kv: CpuKV) -> None:
        pass

    def close(self) -> None:
        pass        # numpy arrays only

    def kv_stats(self) -> dict:
        return {}        # one float32 cache per session, no pool

    def truncate_kv(self, kv: CpuKV, length: int) -> None:
        pass        # positions past `length` are written again before any step reads them

    def move_kv(self, kv: CpuKV, moves: list[tuple[int, int]]) -> None:
        """Copy slot src to slot dst for each (src, dst), in order (a token tree's accepted path)."""
        for src, dst in moves:
            kv.k[:, dst] = kv.k[:, src]
            kv.v[:, dst] = kv.v[:, src]

    def fork_kv(self, kv: CpuKV, length: int, capacity: int | None = None) -> CpuKV:
        """A new cache of `capacity` positions (default kv's) holding the first `length` of `kv`."""
        new = self.alloc_kv(capacity or kv.capacity, kv.k.shape[0])
        new.k[:, :length] = kv.k[:, :length]
        new.v[:, :length] = kv.v[:, :length]
        return new

    # ---- whole steps ---------------------------------------------------------------------------------
    def forward(self, batch: list[tuple[CpuKV, np.ndarray, int]], logits: str = "all",
                trees: list | None = None) -> list[np.ndarray]:
        """batch: (kv, token ids [n_i], start position) per session → logits [n_i, V] each, or with
        logits="last" each session's last row only, [1, V] (lm_head runs on those rows alone).  trees:
        per session a TokenTree its ids are the nodes of, or None (run/token_tree.py).

        The plan of a cpu step is one host segment, the whole step program; its ops are the same for
        every token count (only their costs differ), so one program serves every step.  All sessions'
        tokens go through every projection as one [T, K] matmul (T = Σ n_i); attention runs per session
        over its own cache.
        """
        if self._whole_step is None:
            (segment,) = self.plan(1).segments
            self._whole_step = self.program(segment.ops)
        fields = None if trees is None else step_tree_fields(batch, trees)
        ids, positions, runs = session_runs(batch, trees)
        bounds = [lo for _, lo, _, _ in runs] + [len(ids)]
        cos, sin = self.rope(positions)
        last = np.asarray(bounds[1:]) - 1 if logits == "last" else None
        # one call a step where it binds and no token tree masks the attention (traced, it times each op)
        one_call = self._whole_step.one_call
        if one_call is not None and fields is None:
            out = one_call.run(ids, runs, cos, sin, last)
        else:
            state = HostState(ids, runs, cos, sin, last, fields)
            self._whole_step.run(state)
            out = state.read("logits")
        self.counters.steps += 1
        self.counters.tokens += len(ids)
        if logits == "last":
            return [out[i:i + 1] for i in range(len(batch))]
        return [out[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
