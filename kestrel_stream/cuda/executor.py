"""The whole-step GPU executor (`gpu` mode): every op of a step on the device.

Same interface as cpu.CpuExecutor: alloc_kv / free_kv / forward(batch) / stats.

Static buffers, sized at load for `max_tokens` = max(max_batch, prefill_chunk)
tokens, live in the one device arena beside the weights and the KV caches.  A
step's per-token scalars (token id, position, KV base) are written by the host
into a pinned staging block; the step's first node copies that block to the
device, and every kernel reads them from there, so one captured graph per
decode batch-size bucket serves every later step.  Decode: fill staging, one
graph launch, one stream sync (the step's only host sync), copy logits out.
Prefill and mixed batches run the same launch list eagerly, in chunks of at
most `max_tokens` tokens, one sync per chunk.

Launches per layer: fused QKV GEMV with RMSNorm prologue; q/k norm + RoPE + KV
append; attention; O GEMV + residual; fused gate/up GEMV with RMSNorm prologue;
down GEMV with SiLU·mul prologue + residual.  Then lm_head with the final norm.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from ..quant import QTensor
from ..weights import ModelWeights
from . import driver
from .kernels import KernelSet, Launch

GEMV_SIGNATURE = "pppipfpipiii"   # qs, scales, x, ldx, normw, eps, y, ldy, res, N, K, ntok
ATTENTION_SIGNATURE = "pppppiiiiif"
ROPE_SIGNATURE = "ppppppppfiiiii"


@dataclass
class GpuKV:
    """A session's KV cache in the arena: [capacity, L, 2 (k|v), n_kv, D] float32."""
    ptr: int
    capacity: int
    base_elements: int   # offset from the arena base in float32 elements (what kernels read)


@dataclass
class QWeight:
    qs: int
    scales: int
    rows: int
    cols: int


def rows_per_block(m: int) -> int:
    """Must match ROWS_FOR in kernels_ptx/q8_gemv.cu."""
    return 8 if m == 1 else (4 if m <= 4 else 2)


def gemv_launch(kernels: KernelSet, w: QWeight, x: int, ldx: int, mode: int, normw: int, eps: float,
                y: int, ldy: int, res: int, tokens: int) -> Launch:
    """y[t, :N] = W @ xin(t) (+ res) for `tokens` rows of x; M <= 8 tokens per block slice."""
    m = min(tokens, 8)
    grid = (-(-w.rows // rows_per_block(m)), -(-tokens // m))
    return kernels.launch(f"q8_gemv_m{m}_mode{mode}", grid, (128,), GEMV_SIGNATURE,
                          [w.qs, w.scales, x, ldx, normw, eps, y, ldy, res, w.rows, w.cols, tokens])


class GpuExecutor:
    name = "cuda"

    def __init__(self, weights: ModelWeights, max_seq_len: int = 4096, max_batch: int = 8,
                 max_sessions: int | None = None, prefill_chunk: int = 64, verify: bool | None = None):
        c: ModelConfig = weights.config
        if c.head_dim not in (64, 128, 256) or c.gqa_group > 8:
            raise ValueError(f"gpu mode needs head_dim in 64/128/256 and <= 8 q heads per kv head; "
                             f"{weights.source or 'model'} has head_dim={c.head_dim}, group={c.gqa_group}")
        self.weights, self.config = weights, c
        self.max_seq_len, self.max_batch = max_seq_len, max_batch
        self.max_tokens = max(max_batch, prefill_chunk)
        self.device = driver.Device(0)
        self.kernels = KernelSet(self.device)
        self.stream = driver.Stream()
        self.stats = {"steps": 0, "tokens": 0, "syncs": 0, "launches": 0, "kernels": 0,
                      "h2d_bytes": 0, "d2h_bytes": 0, "graph_replays": 0, "graphs_captured": 0}

        T, H, V = self.max_tokens, c.hidden_size, c.vocab_size
        qkv_width = c.q_size + 2 * c.kv_size
        self.kv_bytes_per_position = c.num_hidden_layers * 2 * c.kv_size * 4
        sessions = (max_sessions or 2 * max_batch) + 1          # +1: scratch cache for padded slots
        activation_floats = T * (H + qkv_width + 2 * c.q_size + 2 * c.intermediate_size + V)
        norm_floats = H * (2 * c.num_hidden_layers + 1) + 2 * c.head_dim * c.num_hidden_layers + c.head_dim
        capacity = (weights.quantized_bytes() + 4 * (activation_floats + norm_floats) + 16 * T
                    + sessions * max_seq_len * self.kv_bytes_per_position
                    + driver.Arena.ALIGN * (12 * c.num_hidden_layers + 64))
        self.arena = driver.Arena(capacity)
        self._upload_weights()

        a = self.arena
        self.x = a.array((T, H), np.float32)             # residual stream
        self.qkv = a.array((T, qkv_width), np.float32)
        self.q = a.array((T, c.q_size), np.float32)      # q after norm + rope
        self.attn = a.array((T, c.q_size), np.float32)
        self.gate_up = a.array((T, 2 * c.intermediate_size), np.float32)
        self.logits = a.array((T, V), np.float32)
        self.params = a.array((T * 16,), np.uint8)       # kvbase int64[T] | ids int32[T] | pos int32[T]
        self.staging = driver.PinnedBuffer(T * 16)
        self.staged_kvbase = self.staging.view(np.int64, (T,), 0)
        self.staged_ids = self.staging.view(np.int32, (T,), 8 * T)
        self.staged_pos = self.staging.view(np.int32, (T,), 12 * T)
        self.host_logits = driver.PinnedBuffer(T * V * 4)
        self.host_logits_view = self.host_logits.view(np.float32, (T, V))
        self._scratch_kv = self.alloc_kv(1)
        self._launches: dict[int, list[Launch]] = {}
        self._graphs: dict[int, driver.Graph] = {}
        self._graph_kernels: dict[int, int] = {}
        self.buckets = sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)})

        if verify is None:
            verify = os.environ.get("KESTREL_VERIFY") == "1"
        self.verifier = None
        if verify:
            from .verify import Verifier
            self.verifier = Verifier(weights, self.stats)

    # ---- weights -----------------------------------------------------------------------------
    def _upload_weights(self) -> None:
        uploaded: dict[int, QWeight] = {}

        def qweight(w: QTensor) -> QWeight:
            if id(w) not in uploaded:   # a tied lm_head is the embedding: upload once
                qs, sc = self.arena.alloc(w.qs.nbytes), self.arena.alloc(w.scales.nbytes)
                driver.h2d_sync(qs, w.qs)
                driver.h2d_sync(sc, w.scales)
                uploaded[id(w)] = QWeight(qs, sc, w.shape[0], w.shape[1])
            return uploaded[id(w)]

        def vector(v: np.ndarray | None) -> int:
            if v is None:
                return 0
            ptr = self.arena.alloc(v.size * 4)
            driver.h2d_sync(ptr, np.asarray(v, np.float32))
            return ptr

        c, w = self.config, self.weights
        self.embed = qweight(w.embed)
        self.lm_head = qweight(w.lm_head)
        self.final_norm = vector(w.final_norm)
        self.layers = [dict(attn_norm=vector(l.attn_norm), wqkv=qweight(l.wqkv), wo=qweight(l.wo),
                            mlp_norm=vector(l.mlp_norm), w_gate_up=qweight(l.w_gate_up),
                            w_down=qweight(l.w_down), q_norm=vector(l.q_norm), k_norm=vector(l.k_norm))
                       for l in w.layers]
        inv_freq = (1.0 / (c.rope_theta ** (np.arange(0, c.head_dim, 2, dtype=np.int64).astype(np.float32)
                                            / c.head_dim))).astype(np.float32)   # as cpu.rope_tables
        self.inv_freq = vector(inv_freq)
        self.weight_bytes = self.arena.used_bytes

    # ---- KV caches -----------------------------------------------------------------------------
    def alloc_kv(self, max_seq_len: int) -> GpuKV:
        ptr = self.arena.alloc(max_seq_len * self.kv_bytes_per_position)
        kv = GpuKV(ptr, max_seq_len, (ptr - self.arena.base) // 4)
        if getattr(self, "verifier", None):
            self.verifier.track(kv)
        return kv

    def free_kv(self, kv: GpuKV) -> None:
        self.arena.free(kv.ptr)
        if self.verifier:
            self.verifier.forget(kv)

    # ---- the launch list of one step over `tokens` tokens -----------------------------------------
    def _step_launches(self, tokens: int) -> list[Launch]:
        if tokens in self._launches:
            return self._launches[tokens]
        c, k, T = self.config, self.kernels, self.max_tokens
        eps, L = c.rms_norm_eps, c.num_hidden_layers
        kvbase, ids, pos = self.params.ptr, self.params.ptr + 8 * T, self.params.ptr + 12 * T
        H, QKV, I = c.hidden_size, c.q_size + 2 * c.kv_size, c.intermediate_size
        out = [k.launch("embed_q8", (tokens,), (256,), "ppppi",
                        [self.embed.qs, self.embed.scales, ids, self.x.ptr, H])]
        for li, lw in enumerate(self.layers):
            out.append(gemv_launch(k, lw["wqkv"], self.x.ptr, H, 1, lw["attn_norm"], eps,
                                   self.qkv.ptr, QKV, 0, tokens))
            out.append(k.launch("qkv_norm_rope_append", (c.num_attention_heads + 2 * c.num_key_value_heads,
                                                         tokens), (32,), ROPE_SIGNATURE,
                                [self.qkv.ptr, self.q.ptr, self.arena.base, kvbase, pos, lw["q_norm"],
                                 lw["k_norm"], self.inv_freq, eps, li, L, c.num_attention_heads,
                                 c.num_key_value_heads, c.head_dim]))
            out.append(k.launch(f"attention_gqa_d{c.head_dim}", (c.num_key_value_heads, tokens), (128,),
                                ATTENTION_SIGNATURE,
                                [self.q.ptr, self.arena.base, kvbase, pos, self.attn.ptr, li, L,
                                 c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                 1.0 / np.sqrt(c.head_dim)]))
            out.append(gemv_launch(k, lw["wo"], self.attn.ptr, c.q_size, 0, 0, eps,
                                   self.x.ptr, H, self.x.ptr, tokens))
            out.append(gemv_launch(k, lw["w_gate_up"], self.x.ptr, H, 1, lw["mlp_norm"], eps,
                                   self.gate_up.ptr, 2 * I, 0, tokens))
            out.append(gemv_launch(k, lw["w_down"], self.gate_up.ptr, 2 * I, 2, 0, eps,
                                   self.x.ptr, H, self.x.ptr, tokens))
        out.append(gemv_launch(k, self.lm_head, self.x.ptr, H, 1, self.final_norm, eps,
                               self.logits.ptr, c.vocab_size, 0, tokens))
        self._launches[tokens] = out
        return out

    def _enqueue_step(self, tokens: int) -> int:
        """Params H2D, every kernel, logits D2H on the compute stream; returns the kernel count."""
        driver.h2d_async(self.params.ptr, self.staging, self.staging.nbytes, self.stream)
        launches = self._step_launches(tokens)
        for launch in launches:
            launch.enqueue(self.stream)
        driver.d2h_async(self.host_logits, self.logits.ptr, tokens * self.config.vocab_size * 4, self.stream)
        return len(launches)

    def _stage(self, rows: list[tuple[GpuKV, int, int]], padded: int) -> None:
        for i, (kv, token, position) in enumerate(rows):
            self.staged_kvbase[i], self.staged_ids[i], self.staged_pos[i] = kv.base_elements, token, position
        for i in range(len(rows), padded):   # padded slots decode token 0 at position 0 of the scratch cache
            self.staged_kvbase[i], self.staged_ids[i], self.staged_pos[i] = self._scratch_kv.base_elements, 0, 0

    # ---- one step ------------------------------------------------------------------------------
    def forward(self, batch: list[tuple[GpuKV, np.ndarray, int]]) -> list[np.ndarray]:
        """batch: (kv, token ids [n_i], start position) per session → logits [n_i, V] float32 each."""
        self.device.make_current()
        rows = []
        for kv, tokens, start in batch:
            tokens = np.asarray(tokens, np.int64).reshape(-1)
            if start + len(tokens) > kv.capacity:
                raise ValueError(f"KV cache holds {kv.capacity} positions; step needs {start + len(tokens)}")
            rows.extend((kv, int(t), start + i) for i, t in enumerate(tokens))
        V = self.config.vocab_size
        logits = np.empty((len(rows), V), np.float32)
        if all(len(np.atleast_1d(t)) == 1 for _, t, _ in batch) and len(rows) <= self.max_batch:
            bucket = next(b for b in self.buckets if b >= len(rows))
            self._stage(rows, bucket)
            if bucket not in self._graphs:
                with driver.capture(self.stream) as captured:
                    kernel_count = self._enqueue_step(bucket)
                self._graphs[bucket] = captured.graph
                self._graph_kernels[bucket] = kernel_count
                self.stats["graphs_captured"] += 1
            self._graphs[bucket].launch(self.stream)
            self.stream.synchronize()
            self._count(launches=1, kernels=self._graph_kernels[bucket], d2h=bucket * V * 4)
            self.stats["graph_replays"] += 1
            logits[:] = self.host_logits_view[:len(rows)]
        else:
            for lo in range(0, len(rows), self.max_tokens):
                chunk = rows[lo:lo + self.max_tokens]
                self._stage(chunk, len(chunk))
                kernel_count = self._enqueue_step(len(chunk))
                self.stream.synchronize()
                self._count(launches=kernel_count, kernels=kernel_count, d2h=len(chunk) * V * 4)
                logits[lo:lo + len(chunk)] = self.host_logits_view[:len(chunk)]
        self.stats["steps"] += 1
        self.stats["tokens"] += len(rows)
        bounds = np.cumsum([0] + [len(np.atleast_1d(t)) for _, t, _ in batch])
        outputs = [logits[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
        if self.verifier:
            self.verifier.check(batch, outputs)
        return outputs

    def close(self) -> None:
        """Give the arena, graphs and pinned buffers back (the engine calls this on close)."""
        self.device.make_current()
        self.stream.synchronize()
        for graph in self._graphs.values():
            graph.destroy()
        self._graphs.clear()
        self.staging.free()
        self.host_logits.free()
        self.arena.release()

    def _count(self, launches: int, kernels: int, d2h: int) -> None:
        self.stats["syncs"] += 1
        self.stats["launches"] += launches
        self.stats["kernels"] += kernels
        self.stats["h2d_bytes"] += self.staging.nbytes
        self.stats["d2h_bytes"] += d2h
