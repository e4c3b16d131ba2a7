"""The host half of a split step (gated and layers=N modes): numpy ops on the pinned host state.

A mixin of segment_steps.SegmentSteps (StepExecutor's plans with host segments), kept apart because it is the CPU
reference arithmetic (kestrel_stream.run.host) applied to one op at a time and
touches no device: norms and SiLU·mul are folded into the projection that
consumes them, exactly as on the GPU side, so either side can run any
projection from the same state.
"""
from __future__ import annotations

from kestrel_stream.model.op_tensors import fused_tensor, norm_weight
from kestrel_stream.run.host import apply_rope, attention, rmsnorm, silu_mul


class HostOps:
    """Host-side ops; expects the attributes StepExecutor sets up (host, valid, weights, ...)."""

    def _host_op(self, op, T: int) -> None:
        c, role = self.config, self._role(op)
        if role in ("norm", "elementwise"):
            return                                    # folded into the consuming projection
        h = self.host
        if role == "embed":
            self._host_writes("x")
            h["x"][:T] = self.weights.embed.dequantize_rows(self.ids)
            self.counters.cpu_weight_read_bytes += T * self.weights.embed.nbytes // self.weights.embed.shape[0]
            return
        if role == "rope":
            return self._host_rope(op.layer, T)
        if role == "attention":
            return self._host_attention(op.layer, T)
        if op.prologue:                           # the norm folded into the projection
            x_in = rmsnorm(h["x"][:T], norm_weight(self.weights, op.prologue), c.rms_norm_eps)
        else:                                     # o, down: attention's output, silu(gate)·up
            x_in = h[op.reads[0]][:T]
        tensor = fused_tensor(self.weights, op)
        dense = self.host_backend.dense(tensor)
        rows = sum(hi - lo for lo, hi in op.row_ranges)     # a split group's host part: its rows
        self.counters.cpu_weight_read_bytes += rows * tensor.nbytes // tensor.shape[0]
        if role in ("o", "down"):
            self._host_writes("x")
            h["x"][:T] += x_in @ dense.T
            return
        if role == "gate_up":                         # gate and up always share a side (equal shapes)
            gate_up = x_in @ dense.T
            self._host_writes("act")
            h["act"][:T] = silu_mul(gate_up[:, :c.intermediate_size], gate_up[:, c.intermediate_size:])
            return
        out = {"qkv": "qkv", "lm_head": "logits"}[role]
        if rows < tensor.shape[0] and self.valid[out] == {"dev"}:   # a split group's host part: the GPU part's rows
            self._to_host([out], T)
            for lo, hi in op.row_ranges:
                h[out][:T, lo:hi] = x_in @ dense[lo:hi].T
            self.valid[out] = {"host"}
            return
        self._host_writes(out)
        for lo, hi in op.row_ranges:
            h[out][:T, lo:hi] = x_in @ dense[lo:hi].T

    def _host_rope(self, li: int, T: int) -> None:
        c = self.config
        qkv = self.host["qkv"][:T]
        lw = self.weights.layers[li]
        if lw.qkv_bias is not None:          # Qwen2: the GPU adds it in its rope kernel, the host here
            qkv = qkv + lw.qkv_bias
        q = qkv[:, :c.q_size].reshape(T, c.num_attention_heads, c.head_dim)
        k = qkv[:, c.q_size:c.q_size + c.kv_size].reshape(T, c.num_key_value_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size:].reshape(T, c.num_key_value_heads, c.head_dim)
        if c.qk_norm:
            q = rmsnorm(q, lw.q_norm, c.rms_norm_eps)
            k = rmsnorm(k, lw.k_norm, c.rms_norm_eps)
        self._q_host = apply_rope(q, self.cos, self.sin)
        k = apply_rope(k, self.cos, self.sin)
        layer = li - self.gpu_layers
        for kv, lo, hi, start in self.runs:
            kv.host.k[layer, start:start + hi - lo] = k[lo:hi]
            kv.host.v[layer, start:start + hi - lo] = v[lo:hi]

    def _host_attention(self, li: int, T: int) -> None:
        self._host_writes("attn")
        layer = li - self.gpu_layers
        for kv, lo, hi, start in self.runs:
            end = start + hi - lo
            self.host["attn"][lo:hi] = attention(self._q_host[lo:hi], kv.host.k[layer, :end],
                                                 kv.host.v[layer, :end], start, self.config.sliding_window)

