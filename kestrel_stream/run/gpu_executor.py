"""The whole-step GPU executor (`gpu` mode): every op of a step on the device.

Same interface as cpu.CpuExecutor: alloc_kv / free_kv / forward(batch) / stats.

Static buffers, sized at load for `max_tokens` = max(max_batch, prefill_chunk)
tokens, live in the one device arena beside the weights; the KV cache is a
pool of blocks committed as sessions grow (kv_paged.py), f16 by default.  A
step's per-token scalars (token id, position, KV base) are written by the host
into a pinned staging block; the step's first node copies that block to the
device, and every kernel reads them from there, so one captured graph per
decode batch-size bucket (1, 2, 4, 8 sessions: the GEMV kernels' range)
serves every later step.  Decode: fill staging, one graph launch, one stream
sync (the step's only host sync), copy logits out; a decode batch of more
than 8 sessions replays the graphs in chunks of 8, one sync each (with
streamed weights the buckets go up to max_batch instead: one stream of the
weights per step).  Prefill
and mixed batches run the same launch list eagerly, in chunks of at most
`max_tokens` tokens, one sync per chunk.

The launch list of a step and why it looks as it does: step_launches.py.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from kestrel_stream.model.config import ModelConfig
from kestrel_stream.model.weights import ModelWeights
from kestrel_stream.obs import load_stages, prof
from kestrel_stream.run.budget import parse_vram_budget, plan_gpu_memory
from kestrel_stream.cuda import driver
from kestrel_stream.run.greedy_chain import GreedyChain
from kestrel_stream.run.kv_paged import PagedKV, PagedKVCache
from kestrel_stream.cuda.kernels import GEMV_MAX_TOKENS, KernelSet, Launch
from kestrel_stream.run.step_launches import argmax_launch, step_launches
from kestrel_stream.run.window import WeightWindow


GpuKV = PagedKV          # the name sessions' caches had before the pool
DEFAULT_MAX_SESSIONS = 256  # block-table rows (8 bytes per block of max_seq_len each): cheap, unlike KV
class GpuExecutor:
    name = "cuda"
    use_graphs = True     # False: decode steps launch every kernel eagerly (the bench's baseline)
    # programmatic dependent launch between the step's kernels (sm_90+); KESTREL_PDL=0 turns it off
    programmatic = os.environ.get("KESTREL_PDL", "1") != "0"

    def __init__(self, weights: ModelWeights, max_seq_len: int = 4096, max_batch: int = 8,
                 max_sessions: int | None = None, prefill_chunk: int = 64, attention_splits: int = 16,
                 verify: bool | None = None, vram_budget=None, window_slots: int = 2, prefetch_distance: int = 1,
                 small_item_bytes: int = 64 * 1024, kv_dtype: str = "f16", kv_block_size: int = 16,
                 kv_pool_bytes: int | None = None):
        c: ModelConfig = weights.config
        if kv_dtype not in ("f16", "f32"):
            raise ValueError(f"kv_dtype {kv_dtype!r}: expected f16 (default) or f32 (the reference)")
        if kv_block_size not in (16, 32, 64):
            raise ValueError(f"kv_block_size {kv_block_size}: expected 16, 32 or 64 positions")
        if c.head_dim not in (64, 128, 256) or c.gqa_group > 8 or not 1 <= attention_splits <= 32:
            raise ValueError(f"gpu mode needs head_dim in 64/128/256 and <= 8 q heads per kv head; "
                             f"{weights.source or 'model'} has head_dim={c.head_dim}, group={c.gqa_group}")
        self.weights, self.config = weights, c
        self.max_seq_len, self.max_batch = max_seq_len, max_batch
        self.max_tokens = max(max_batch, prefill_chunk)
        self.attention_splits = attention_splits
        self.device = driver.Device(0)
        with load_stages.stage("  kernels: NVRTC or disk cache, module load"):
            self.kernels = KernelSet(self.device)
        self.stream = driver.Stream("compute")
        self.stats = {"steps": 0, "tokens": 0, "syncs": 0, "launches": 0, "kernels": 0,
                      "h2d_bytes": 0, "d2h_bytes": 0, "graph_replays": 0, "graphs_captured": 0}

        T, H, V = self.max_tokens, c.hidden_size, c.vocab_size
        qkv_width = c.q_size + 2 * c.kv_size
        self.kv_dtype = kv_dtype
        partial_floats = T * c.num_attention_heads * attention_splits * (c.head_dim + 2)
        # the arena holds activations + block tables + weights, the KV pool grows beside it; under a
        # budget too small for all the weights, the residency window keeps some resident and streams
        # the rest (stream_window.py)
        self.memory = plan_gpu_memory(
            c, budget_bytes=parse_vram_budget(vram_budget), free_bytes=self.device.free_bytes(), max_tokens=T,
            max_sessions=max_sessions or DEFAULT_MAX_SESSIONS, max_seq_len=max_seq_len,
            attention_splits=attention_splits, max_batch=max_batch, kv_dtype=kv_dtype, block_size=kv_block_size,
            kv_pool_bytes=kv_pool_bytes, slot_count=window_slots, prefetch_distance=prefetch_distance,
            small_item_bytes=small_item_bytes)
        self.needs, self.vram_budget, self.window_plan = self.memory.needs, self.memory.budget_bytes, self.memory.window
        with load_stages.stage("  arena"):
            self.arena = driver.Arena(self.memory.arena_bytes)
        self._upload_weights()
        load_stages.record("  weights: pinned images", self.window.images_s)
        load_stages.record("  weights: H2D", self.window.preload_s)

        a = self.arena
        self.x = a.array((T, H), np.float32)             # residual stream
        self.xn = a.array((T, H), np.float32)            # x * the next RMSNorm's weight
        self.qkv = a.array((T, qkv_width), np.float32)
        self.q = a.array((T, c.q_size), np.float32)      # q after norm + rope
        self.attn = a.array((T, c.q_size), np.float32)
        self.act = a.array((T, c.intermediate_size), np.float32)   # silu(gate) * up
        self.logits = a.array((T, V), np.float32)
        self.inv_rms = a.array((T,), np.float32)         # the next RMSNorm's 1/rms per token
        self.partials = a.array((partial_floats,), np.float32)
        self.counter = a.array((64,), np.uint32)         # last-block ticket of the GEMV epilogue
        self.attention_counters = a.array((T * c.num_key_value_heads,), np.uint32)   # last-split tickets
        driver.h2d_sync(self.counter.ptr, np.zeros(64, np.uint32))
        driver.h2d_sync(self.attention_counters.ptr, np.zeros(T * c.num_key_value_heads, np.uint32))
        self.params = a.array((T * 16,), np.uint8)       # kvbase int64[T] | ids int32[T] | pos int32[T]
        self.staging = driver.PinnedBuffer(T * 16)
        self.staged_kvbase = self.staging.view(np.int64, (T,), 0)
        self.staged_ids = self.staging.view(np.int32, (T,), 8 * T)
        self.staged_pos = self.staging.view(np.int32, (T,), 12 * T)
        self.host_logits = driver.PinnedBuffer(T * V * 4)
        self.host_logits_view = self.host_logits.view(np.float32, (T, V))
        # greedy steps: argmax on the device, 4 bytes per token back (argmax_split's partials and tickets)
        self.argmax_splits = 64
        self.argmax_partials = a.array((2 * T * self.argmax_splits,), np.float32)
        self.argmax_counters = a.array((T,), np.uint32)
        self.argmax_out = a.array((T,), np.int32)
        driver.h2d_sync(self.argmax_counters.ptr, np.zeros(T, np.uint32))
        self.host_tokens = driver.PinnedBuffer(T * 4)
        self.host_tokens_view = self.host_tokens.view(np.int32, (T,))
        with load_stages.stage("  KV pool and block tables"):
            self.kv = PagedKVCache(c, self.memory.kv, kv_dtype, max_sessions or DEFAULT_MAX_SESSIONS,
                                   max_seq_len, a, self.stream)
        self._scratch_kv = self.kv.open(1)       # padded slots decode token 0 at its position 0
        self.kv.prepare(self._scratch_kv, 0, 1)
        self._launches: dict[int, list[Launch]] = {}
        self._graphs: dict[tuple[int, bool], driver.Graph] = {}      # (bucket, greedy) -> the captured step
        self._graph_kernels: dict[tuple[int, bool], int] = {}
        self._prof_events = (driver.Event(timing=True), driver.Event(timing=True)) if prof.enabled else ()
        # decode graphs hold at most GEMV_MAX_TOKENS sessions: a bigger decode batch replays them in chunks
        # (one sync each), since a 9..64-token step runs the tiled matmul, which costs as much as a 64-token
        # prefill chunk (~28 ms for qwen3-1.7b against 3.7 ms for a batch of 8).  Not with streamed weights:
        # each chunk would stream them again, and PCIe is what a streamed step waits for
        self.graph_rows = max_batch if self.window.streamed else min(max_batch, GEMV_MAX_TOKENS)
        self.buckets = sorted({min(1 << i, self.graph_rows) for i in range(self.graph_rows.bit_length() + 1)})
        self.chain = GreedyChain(self)

        if verify is None:
            verify = os.environ.get("KESTREL_VERIFY") == "1"
        self.verifier = None
        if verify:
            from kestrel_stream.run.verify import Verifier
            self.verifier = Verifier(weights, self.stats)

    # ---- weights -----------------------------------------------------------------------------
    def _upload_weights(self) -> None:
        # Q8 weights: the resident ones preloaded into the arena, the rest streamed through the ring
        self.window = WeightWindow(self.weights, self.arena, self.window_plan, self.stream)
        self.preload_line, warning = self.window.preload_report(self.vram_budget, self.needs.total)
        print(f"kestrel-stream: {self.preload_line}", file=sys.stderr)
        if warning:
            print(f"kestrel-stream: {warning}", file=sys.stderr)

        def vector(v: np.ndarray | None) -> int:
            if v is None:
                return 0
            ptr = self.arena.alloc(v.size * 4)
            driver.h2d_sync(ptr, np.asarray(v, np.float32))
            return ptr

        c, w, q = self.config, self.weights, self.window.qweight   # gate_up rows interleaved (gate j, up j)
        self.lm_head = q("lm_head")
        self.embed = self.lm_head if w.tied else q("embed")
        self.final_norm = vector(w.final_norm)
        self.layers = [dict(attn_norm=vector(l.attn_norm), wqkv=q(f"L{i}.qkv"), wo=q(f"L{i}.o"),
                            mlp_norm=vector(l.mlp_norm), w_gate_up=q(f"L{i}.gate_up"),
                            w_down=q(f"L{i}.down"), q_norm=vector(l.q_norm), k_norm=vector(l.k_norm))
                       for i, l in enumerate(w.layers)]
        inv_freq = (1.0 / (c.rope_theta ** (np.arange(0, c.head_dim, 2, dtype=np.int64).astype(np.float32)
                                            / c.head_dim))).astype(np.float32)   # as cpu.rope_tables
        self.inv_freq = vector(inv_freq)
        self.weight_bytes = self.arena.used_bytes

    # ---- KV caches -----------------------------------------------------------------------------
    def alloc_kv(self, max_seq_len: int) -> PagedKV:
        kv = self.kv.open(max_seq_len)
        if self.verifier:
            self.verifier.track(kv)
        return kv

    def free_kv(self, kv: PagedKV) -> None:
        self.kv.close(kv)
        if self.verifier:
            self.verifier.forget(kv)

    def truncate_kv(self, kv: PagedKV, length: int) -> None:
        self.kv.truncate(kv, length)          # whole blocks past `length` go back to the pool

    def fork_kv(self, kv: PagedKV, length: int, capacity: int | None = None) -> PagedKV:
        """A new cache of `capacity` positions (default kv's) sharing `kv`'s first `length` positions'
        blocks (copy-on-write: kv_pool.prepare_write)."""
        child = self.kv.fork(kv, length, capacity or kv.capacity)
        if self.verifier:
            self.verifier.fork(kv, child, length)
        return child

    def kv_stats(self) -> dict:
        return self.kv.stats()

    # ---- the launch lists (step_launches.py), built once per token count ------------------------------
    def _step_launches(self, tokens: int) -> list[Launch]:
        if tokens not in self._launches:
            self._launches[tokens] = step_launches(self, tokens)
        return self._launches[tokens]

    def _enqueue_step(self, tokens: int, greedy: bool = False) -> int:
        """Params H2D, every kernel, the logits (or, greedy, each row's argmax) D2H on the compute
        stream; returns the kernel count."""
        driver.h2d_async(self.params.ptr, self.staging, self.staging.nbytes, self.stream)
        launches = self._step_launches(tokens)
        self.window.enqueue_step(launches, self.stream)   # streamed weights: copies + slot events
        if not greedy:
            driver.d2h_async(self.host_logits, self.logits.ptr, tokens * self.config.vocab_size * 4, self.stream)
            return len(launches)
        self._argmax_launch(tokens).enqueue(self.stream)
        driver.d2h_async(self.host_tokens, self.argmax_out.ptr, tokens * 4, self.stream)
        return len(launches) + 1

    def _argmax_launch(self, tokens: int) -> Launch:
        key = ("argmax", tokens)
        if key not in self._launches:
            self._launches[key] = argmax_launch(self, tokens, self._step_launches(tokens)[-1].programmatic)
        return self._launches[key]

    def _stage(self, rows: list[tuple[GpuKV, int, int]], padded: int) -> None:
        for i, (kv, token, position) in enumerate(rows):
            self.staged_kvbase[i], self.staged_ids[i], self.staged_pos[i] = kv.base_elements, token, position
        for i in range(len(rows), padded):   # padded slots decode token 0 at position 0 of the scratch cache
            self.staged_kvbase[i], self.staged_ids[i], self.staged_pos[i] = self._scratch_kv.base_elements, 0, 0

    # ---- one step ------------------------------------------------------------------------------
    def _rows(self, batch) -> list[tuple[GpuKV, int, int]]:
        rows = []
        for kv, tokens, start in batch:
            tokens = np.asarray(tokens, np.int64).reshape(-1)
            if start + len(tokens) > kv.capacity:
                raise ValueError(f"KV cache holds {kv.capacity} positions; step needs {start + len(tokens)}")
            rows.extend((kv, int(t), start + i) for i, t in enumerate(tokens))
        return rows

    def _reserve(self, spans) -> None:
        """KV blocks for the positions a step (or chain of steps) writes, (kv, start, end) each; the
        changed table entries are uploaded ahead of the step's kernels on the same stream."""
        for kv, start, end in spans:
            self.kv.prepare(kv, start, end)
        self.kv.flush()

    def _replayable(self, batch, rows) -> bool:
        """A decode step (one token per session, at most max_batch) with no timed streaming: a graph."""
        self.window.timing = self.window.wants_timing()     # timed streamed steps run eagerly
        return (self.use_graphs and not self.window.timing and len(rows) <= self.max_batch
                and all(len(np.atleast_1d(t)) == 1 for _, t, _ in batch))

    def _replay(self, rows, greedy: bool) -> dict:
        """Stage the rows, launch (capturing once) the bucket's graph, wait: the step's one sync.
        Returns the profile stages so far (KESTREL_PROF) for the caller to complete and record."""
        bucket = next(b for b in self.buckets if b >= len(rows))
        self._stage(rows, bucket)
        key = (bucket, greedy)
        if key not in self._graphs:
            with load_stages.stage("graph capture"), driver.capture(self.stream) as captured:
                kernel_count = self._enqueue_step(bucket, greedy)
            self._graphs[key] = captured.graph
            self._graph_kernels[key] = kernel_count
            self.stats["graphs_captured"] += 1
        started = time.perf_counter()
        if prof.enabled:
            self._prof_events[0].record(self.stream)
        self._graphs[key].launch(self.stream)
        if prof.enabled:
            self._prof_events[1].record(self.stream)
        self.stream.synchronize()
        waited = time.perf_counter()
        self._count(launches=1, kernels=self._graph_kernels[key],
                    d2h=bucket * 4 if greedy else bucket * self.config.vocab_size * 4)
        self.stats["graph_replays"] += 1
        if not prof.enabled:
            return {}
        # one offloaded call per step: the replay's GPU time, the rest of the wait (+ the copy out, by the caller)
        gpu_us = self._prof_events[1].elapsed_ms(self._prof_events[0]) * 1e3
        return {"gemm": gpu_us, "d2h+sync": max((waited - started) * 1e6 - gpu_us, 0.0)}

    def forward(self, batch: list[tuple[GpuKV, np.ndarray, int]]) -> list[np.ndarray]:
        """batch: (kv, token ids [n_i], start position) per session → logits [n_i, V] float32 each."""
        self.device.make_current()
        rows = self._rows(batch)
        self._reserve((kv, start, start + len(np.atleast_1d(t))) for kv, t, start in batch)
        V = self.config.vocab_size
        logits = np.empty((len(rows), V), np.float32)
        if self._replayable(batch, rows):
            for lo in range(0, len(rows), self.graph_rows):
                chunk = rows[lo:lo + self.graph_rows]
                stages = self._replay(chunk, greedy=False)
                started = time.perf_counter()
                logits[lo:lo + len(chunk)] = self.host_logits_view[:len(chunk)]
                if prof.enabled:
                    prof.record_call({**stages, "reduce": (time.perf_counter() - started) * 1e6})
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

    def forward_greedy(self, batch: list[tuple[GpuKV, np.ndarray, int]]) -> np.ndarray:
        """Like forward, but only each session's greedy next token (argmax of its last logits row):
        int64 [len(batch)].  A decode step computes the argmax on the device and copies 4 bytes per
        token back instead of the logits; anything else (prefill, KESTREL_VERIFY) goes through forward."""
        self.device.make_current()
        rows = self._rows(batch)
        if self.verifier is not None or not self._replayable(batch, rows):
            return np.array([int(np.argmax(out[-1])) for out in self.forward(batch)], np.int64)
        self._reserve((kv, position, position + 1) for kv, _, position in rows)
        tokens = np.empty(len(rows), np.int64)
        for lo in range(0, len(rows), self.graph_rows):
            chunk = rows[lo:lo + self.graph_rows]
            stages = self._replay(chunk, greedy=True)
            if prof.enabled:
                prof.record_call({**stages, "reduce": 0.0})
            tokens[lo:lo + len(chunk)] = self.host_tokens_view[:len(chunk)]
        self.stats["steps"] += 1
        self.stats["tokens"] += len(rows)
        return tokens

    def generate_greedy(self, batch: list[tuple[GpuKV, np.ndarray, int]], steps: int) -> np.ndarray | None:
        """`steps` greedy decode steps chained on the device (greedy_chain.py): each session's next
        `steps` tokens, int64 [steps, len(batch)], one host sync per GreedyChain.steps_per_sync steps.
        None where this configuration steps one token at a time instead (not a one-token-per-session
        batch of at most graph_rows sessions, KESTREL_VERIFY, KESTREL_PROF, a timed streamed step):
        the caller then steps."""
        self.device.make_current()
        rows = self._rows(batch)
        if (self.verifier is not None or prof.enabled or not self._replayable(batch, rows)
                or len(rows) > self.graph_rows):
            return None
        for kv, _, position in rows:
            if position + steps > kv.capacity:
                raise ValueError(f"KV cache holds {kv.capacity} positions; {steps} steps from {position} "
                                 f"need {position + steps}")
        self._reserve((kv, position, position + steps) for kv, _, position in rows)   # positions advance on the device
        return self.chain.run(rows, steps)

    def close(self) -> None:
        """Give the arena, graphs and pinned buffers back (the engine calls this on close)."""
        self.device.make_current()
        self.stream.synchronize()
        self.chain.close()
        for graph in self._graphs.values():
            graph.destroy()
        self._graphs.clear()
        self.staging.free()
        self.host_logits.free()
        self.host_tokens.free()
        self.window.close()
        self.kv.release()
        self.arena.release()

    def _count(self, launches: int, kernels: int, d2h: int) -> None:
        self.stats["syncs"] += 1
        self.stats["launches"] += launches
        self.stats["kernels"] += kernels
        self.stats["h2d_bytes"] += self.staging.nbytes
        self.stats["d2h_bytes"] += d2h
        self.window.account(self.stats)
