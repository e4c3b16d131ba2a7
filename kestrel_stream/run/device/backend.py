"""The device backend: what every mode that runs ops on the GPU builds once, at load.

StepExecutor (step_executor.py) builds one in every mode that offloads, gpu, gated and
layers=N: the device and its context, the kernels, the compute stream, one arena
sized by budget.py, the weights the residency window supplies (weight_window.py) and
the small vectors (norms, q/k norms, biases, the rope table: WeightCache),
the paged KV pool (kv_paged.py), the step's parameters (StepParams) and state
buffers (DeviceState), a mixture-of-experts model's routers and resident experts
where the memory plan keeps them (expert_store.py), and DeviceOps, which turns an
op of the step program into its prepared launches.  What differs between the modes is handed in: how the
memory is planned, the KV pool's layers and dtype, whether the step's outputs
come back through StepOutputs (gpu mode) or the mixed modes' pinned state
copies (PinnedState), and whether the dense GEMM path is on.

A weight the window does not hold (a mixed mode's plan for a token count or a
forced group choice that puts one more projection on the GPU) is uploaded on
first use into an allocation of its own and kept, counted in weight_uploads.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from kestrel_stream.cuda import driver
from kestrel_stream.cuda.kernels import ATTENTION_MIN_KEYS, ATTENTION_WARPS, KernelSet, QWeight
from kestrel_stream.model import rope
from kestrel_stream.obs import load_stages
from kestrel_stream.run.device import dense_path
from kestrel_stream.run.device.budget import GpuMemoryPlan
from kestrel_stream.run.device.ops import DeviceOps, DeviceState, KVCaches, fused_tensor
from kestrel_stream.run.device.kv_paged import PagedKVCache
from kestrel_stream.run.device.step_io import StepOutputs, TokenOutputs
from kestrel_stream.run.device.step_io import StepParams
from kestrel_stream.run.device.weight_cache import WeightCache, layer_vectors
from kestrel_stream.run.device.weight_window import WeightWindow


class OwnAllocations:
    """Device memory for weights uploaded after load, one allocation each (the arena is sized at load)."""

    def __init__(self):
        self.chunks: list = []

    def alloc(self, nbytes: int) -> int:
        chunk = driver.Arena(max(nbytes, 1))
        self.chunks.append(chunk)
        return chunk.alloc(nbytes)

    def release(self) -> None:
        for chunk in self.chunks:
            chunk.release()
        self.chunks.clear()


class PinnedState:
    """Pinned host copies of a step's state, for the modes that move it between host and device at the
    plan's segment boundaries: x, qkv, attn, act, logits [tokens, width] float32 each, and the host-made
    xn rows followed by their 1/rms."""

    def __init__(self, config, tokens: int):
        c, T = config, tokens
        self.widths = {"x": c.hidden_size, "qkv": c.q_size + 2 * c.kv_size, "attn": c.q_size,
                       "act": c.intermediate_size, "logits": c.vocab_size}
        if c.is_moe:          # a routed layer's choices, and the sum of its experts on the device
            self.widths.update(route=2 * c.num_experts_per_tok, moe_out=c.hidden_size)
        self.buffers = {name: driver.PinnedBuffer(T * w * 4)
                        for name, w in dict(self.widths, xn=c.hidden_size + 1).items()}
        self.views = {name: self.buffers[name].view(np.float32, (T, w)) for name, w in self.widths.items()}
        self.xn = self.buffers["xn"].view(np.float32, (T, c.hidden_size))
        self.inv_rms = self.buffers["xn"].view(np.float32, (T,), 4 * T * c.hidden_size)

    def free(self) -> None:
        for buffer in self.buffers.values():
            buffer.free()


class DeviceBackend:
    def __init__(self, weights, options, counters, *, max_tokens: int, logits_rows: int,
                 plan_memory: Callable[[int, int], GpuMemoryPlan], kv_dtype: str, kv_layers: int,
                 max_sessions: int, max_seq_len: int, attention_splits: int,
                 attention_min_keys: int = ATTENTION_MIN_KEYS, attention_warps: int = ATTENTION_WARPS,
                 dense: bool = True, step_outputs: bool = True, pinned_state: bool = False):
        """plan_memory(free device bytes, dense GEMM scratch bytes) -> the arena, window and KV pool plan.
        kv_layers: the layers whose KV the pool holds (0: no pool, attention runs on the host)."""
        c = weights.config
        self.weights, self.config, self.options, self.counters = weights, c, options, counters
        self.max_tokens, self.logits_rows = max_tokens, logits_rows
        with load_stages.stage("  device and context"):
            self.device = driver.Device(options.device_ordinal)
        with load_stages.stage("  kernels: NVRTC or disk cache, module load"):
            self.kernels = KernelSet(self.device, options)
        self.stream = driver.Stream("compute")
        # steps of >= dense_min_tokens tokens: one fp16 GEMM per projection, cuBLAS or built-in (dense_path.py)
        self.dense_min_tokens, self.blas = None, None
        if dense:
            with load_stages.stage("  cuBLAS: library and handle"):
                self.dense_min_tokens, self.blas = dense_path.open_blas(options, c, max_tokens)
        self.memory = plan_memory(self.device.free_bytes(),
                                  dense_path.scratch_bytes(c, max_tokens, self.dense_min_tokens, self.blas))
        with load_stages.stage("  arena"):
            self.arena = driver.Arena(self.memory.arena_bytes)
        with load_stages.stage("  weights (all): pinning, images, H2D"):
            # projection weights: the resident ones preloaded into the arena, the rest streamed through the ring
            self.window = WeightWindow(weights, self.arena, self.memory.window, self.stream)
            # norm weights, q/k norms, biases and the rope table: uploaded now (never while a graph is captured)
            self.cache = WeightCache(self.arena, counters)
            for v in layer_vectors(weights):
                self.cache.vector(v)
            self.inv_freq = self.cache.vector(rope.inv_freq(c))
            # a mixture-of-experts model's routers and the experts the plan keeps on the device
            self.experts = None
            if self.memory.experts is not None or self.memory.expert_ring_slots:
                from kestrel_stream.run.device.expert_store import ExpertStore
                self.experts = ExpertStore(weights, self.arena, self.memory.expert_slots, self.stream,
                                           self.memory.expert_ring_slots)
                if self.memory.experts is not None:
                    self.experts.place(self.memory.experts)
            self.weight_bytes = self.arena.used_bytes
        load_stages.record("  weights: pinned images", self.window.images_s)
        load_stages.record("  weights: H2D", self.window.preload_s)
        self.late = WeightCache(OwnAllocations(), counters)

        self.buffers_started = time.perf_counter()
        self.state, self.arrays = DeviceState.allocate(self.arena, c, max_tokens, logits_rows, attention_splits)
        self.logits = self.arrays["logits"]
        self.state.dense = dense_path.allocate_scratch(self.arena, c, max_tokens, self.dense_min_tokens, self.blas)
        self.step_params = StepParams(self.arena, max_tokens)          # kvbase | ids | pos of the step's tokens
        self.outputs = (StepOutputs(self.arena, c.vocab_size, max_tokens, logits_rows, self.logits.ptr)
                        if step_outputs else None)                     # logits or tokens back, one wait
        # each row's token taken here, 4 bytes back (a mixed step's greedy steps: no step outputs of their own)
        self.token_outputs = self.outputs if step_outputs else TokenOutputs(self.arena, max_tokens)
        self.pinned = PinnedState(c, max_tokens) if pinned_state else None
        self.kv = None
        if kv_layers:
            with load_stages.stage("  KV pool and block tables"):
                self.kv = PagedKVCache(c, self.memory.kv, kv_dtype, max_sessions, max_seq_len, self.arena,
                                       self.stream, layers=kv_layers)
        kv_caches = KVCaches(self.kv.table_ptr if self.kv else 0, kv_layers, self.kv.block_shift if self.kv else 0,
                             kv_dtype, attention_splits, attention_min_keys, attention_warps)
        self.ops = DeviceOps(self.kernels, weights, self.state, kv_caches, self.step_params, self.inv_freq,
                             self.qweight, self.cache.vector, self.experts)

    def qweight(self, op) -> QWeight:
        """The device weight a projection (or the embed gather) of the step program reads: the window's, or
        (a weight it does not hold) an upload made on first use and kept."""
        name = "lm_head" if op.kind == "embed" and self.weights.tied else op.name.split("[")[0]   # a split part's
        if name in self.window.qweights:
            return self.window.qweight(name)
        return self.late.qweight(fused_tensor(self.weights, op), {}, op.group == "gate_up")

    def close(self) -> None:
        """Give the arena, the pool and the pinned buffers back (the stream synchronized first)."""
        self.device.make_current()
        self.stream.synchronize()
        self.step_params.free()
        self.token_outputs.free()
        if self.pinned is not None:
            self.pinned.free()
        self.window.close()
        if self.kv is not None:
            self.kv.release()
        if self.blas is not None:
            self.blas.destroy()
        self.late.arena.release()
        self.arena.release()
