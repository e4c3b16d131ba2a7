"""The executor of every mode: one class, the mode's steps handed to the backend that runs them.

An Executor (executor.py): alloc_kv / free_kv / forward(batch, logits) / counters.  It runs the
scheduler's plan of each step (`plan(tokens)`), whose segments say which backend runs which ops of the
step program (scheduler/ops.py):

- `cpu`: one host segment, the whole step: the host backend (run/host/) runs it as one program of
  numpy calls.  No device backend is built and nothing CUDA is imported, so cpu mode runs without
  cuda.bindings; the device modes import their parts where they build them;
- `gpu`: one device segment, the whole step: the device backend's WholeStep (run/device/whole_step.py)
  runs it as one captured graph per decode batch bucket (eagerly for prefill and mixed batches), takes
  greedy and sampled tokens on the device and chains decode steps there;
- `gated`, `layers=N` (`layers=N+head`) and `offload`: host and device segments: MixedSteps (run/mixed.py) walks them in
  order, host segments as the host backend's programs, device segments as the device backend's launches,
  and moves the step's state only where segments meet.  `offload` is what gpu mode becomes when the weights
  do not fit its VRAM budget and the cost model (scheduler/offload.py) predicts host compute beside the
  streaming ring beats streaming alone: resident, streamed and host layers, the split chosen per step size
  (its start: offload_start.py).
  A mixture-of-experts model runs in gpu mode when every expert fits the budget (router and experts on the
  device: run/device/moe_ops.py), else in `offload` (gpu and auto become it, saying so on stderr): qkv, o
  and attention on the GPU, the experts the room left holds resident there (chosen by routing frequency:
  place_experts), the others on the host backend (the native kernels, the chosen experts only); gated
  and layers=N refuse it.

The device backend is the same in every mode that offloads; what the mode changes is its memory plan
(the residency window's resident set and streaming ring, the KV pool's layers and dtype) and which
buffers return a step's outputs (StepOutputs, or the pinned state copies of the mixed modes).

One concern, the executor of every mode: which mode a model and a budget get and what each mode builds are
read together.
"""
from __future__ import annotations

import sys
import time

import numpy as np

import scheduler
from kestrel_stream.model.weights import ModelWeights
from kestrel_stream.options import Options
from kestrel_stream.run import offload_start
from kestrel_stream.run.device.budget import (DEFAULT_MAX_SESSIONS, EXECUTOR_DEFAULTS, plan_gpu_memory,
                                              plan_mixed_memory, step_rows)
from kestrel_stream.run.executor import Executor, StepCounters
from kestrel_stream.run.host.backend import HostBackend

DEFAULTS = EXECUTOR_DEFAULTS        # (max_seq_len, max_batch, prefill_chunk) when not given: gpu mode's, mixed modes'


class StepExecutor(Executor):
    name = "cuda"         # cpu mode: "cpu"

    def __init__(self, weights: ModelWeights, mode: str = "gpu", profile=None, *, max_seq_len: int | None = None,
                 max_batch: int | None = None, max_sessions: int | None = None, prefill_chunk: int | None = None,
                 attention_splits: int = 16, verify: bool | None = None, vram_budget=None, window_slots: int = 2,
                 prefetch_distance: int = 1, small_item_bytes: int = 64 * 1024, options: Options | None = None,
                 kv_dtype: str = "f16", kv_block_size: int = 16, kv_pool_bytes: int | None = None,
                 attention_min_keys: int | None = None, attention_warps: int | None = None,
                 group_choice: dict | None = None):
        """mode: gpu (the default), cpu, gated or layers=N; profile: the cost model's device figures (gated).
        vram_budget: parsed bytes or fraction (Options.with_), gpu mode's; None takes the options' budget.
        attention_min_keys: split-key attention's fewest keys per split block; attention_warps: a block's warps
        in one-token steps' attention (default: cuda.kernels' values, chosen by bench/attention_decode.py).
        kv_dtype, kv_block_size, kv_pool_bytes, window_slots, prefetch_distance, small_item_bytes and verify:
        gpu mode's (the mixed modes keep float32 KV and every GPU weight resident); group_choice: gated mode's
        forced groups.  cpu mode reads none of these."""
        c = weights.config
        kind, count = scheduler.parse_mode(mode)
        self.weights, self.config = weights, c
        self._plans: dict[int, scheduler.Plan] = {}
        self.placement = None                      # mode offload's placement of one-token steps
        if kind == "cpu":
            self.name, self.mode, self.options = "cpu", "cpu", options    # None: numpy's reference arithmetic
            self.counters = StepCounters.counting("cpu_weight_read_bytes")
            self.steps = HostBackend(weights, self.counters, options, sole_reader=True)
            self.weights = self.steps.weights           # the one host copy: repacked where the kernels repack
            return
        if c.is_moe and kind not in ("gpu", "auto", "offload"):
            raise ValueError(f"mode {mode}: {weights.source or 'this model'} is a mixture-of-experts model "
                             f"({c.arch}), whose experts gated and layers=N do not place: run it in mode offload "
                             "(attention on the GPU, the most used experts resident, the rest on the host), in mode "
                             "gpu (every expert in VRAM; it becomes offload where they do not fit) or on the CPU "
                             "engine (--device cpu; ks.load(..., device='cpu'))")
        self.options = Options.from_env() if options is None else options
        vram_budget = self.options.vram_budget if vram_budget is None else vram_budget
        self.resident_experts = None               # a mixture-of-experts model's experts on the device
        if c.is_moe and kind in ("gpu", "auto") and not offload_start.holds_every_expert_here(
                self, vram_budget, max_seq_len, max_batch, kv_dtype):
            print(f"kestrel-stream: mode {mode}: {weights.source or 'the model'} is a mixture-of-experts model "
                  f"({c.arch}) whose experts do not fit the VRAM budget: mode offload (attention on the GPU, the "
                  "most used experts resident, the rest on the host)", file=sys.stderr)
            kind = mode = "offload"
        if kind in ("gpu", "auto") and offload_start.offload_wins(self, vram_budget, max_seq_len, max_batch, kv_dtype,
                                                                  profile):
            kind = mode = "offload"
        if kind == "offload":
            offload_start.start_offload(self, profile, vram_budget, max_seq_len, max_batch, max_sessions,
                                        prefill_chunk, kv_dtype, kv_block_size)
            return
        whole_step = kind in ("gpu", "auto")       # the plan is one device segment
        self.mode, self.profile, self.group_choice = ("gpu" if whole_step else mode), profile, group_choice
        self.gpu_layers = min(count, c.num_hidden_layers) if kind in scheduler.LAYER_KINDS else 0
        default_seq, default_batch, default_chunk = DEFAULTS[whole_step]
        self.max_seq_len, self.max_batch = max_seq_len or default_seq, max_batch or default_batch
        prefill_chunk = prefill_chunk or default_chunk
        if whole_step:
            self._start_gpu(prefill_chunk, max_sessions, attention_splits=attention_splits, verify=verify,
                            vram_budget=vram_budget, window_slots=window_slots, prefetch_distance=prefetch_distance,
                            small_item_bytes=small_item_bytes, kv_dtype=kv_dtype, kv_block_size=kv_block_size,
                            kv_pool_bytes=kv_pool_bytes, attention_min_keys=attention_min_keys,
                            attention_warps=attention_warps)
        else:
            self._start_mixed(mode, prefill_chunk, max_sessions)

    def _start_gpu(self, prefill_chunk: int, max_sessions: int | None, *, attention_splits: int, verify,
                   vram_budget, window_slots: int, prefetch_distance: int, small_item_bytes: int, kv_dtype: str,
                   kv_block_size: int, kv_pool_bytes: int | None, attention_min_keys: int | None,
                   attention_warps: int | None) -> None:
        """gpu mode: the whole step on the device backend, its weights the residency window's under the budget."""
        from kestrel_stream.cuda.kernels import ATTENTION_MIN_KEYS, ATTENTION_WARPS, ROPE_ATTENTION
        from kestrel_stream.run.device.backend import DeviceBackend
        from kestrel_stream.run.device.whole_step import WholeStep
        c, weights = self.config, self.weights
        self._check_gpu_mode(kv_dtype, kv_block_size, attention_splits)
        max_tokens, logits_rows = step_rows(self.max_batch, prefill_chunk)
        # one-token steps: each layer's rope as its attention's prologue (scheduler/ops.py fuse_rope)
        rope_fused = self.options.fused_rope and (c.head_dim, kv_dtype) in ROPE_ATTENTION
        self.counters = StepCounters.counting("kernels", "graph_replays", "graphs_captured",
                                              "gpu_weight_read_bytes")
        sessions = max_sessions or DEFAULT_MAX_SESSIONS

        def plan_memory(free_bytes: int, scratch_bytes: int):
            # the arena holds activations + block tables + weights, the KV pool grows beside it; under a
            # budget too small for all the weights, the residency window keeps some resident and streams
            # the rest (device/weight_window.py)
            return plan_gpu_memory(
                c, budget_bytes=vram_budget, free_bytes=free_bytes, max_tokens=max_tokens,
                max_sessions=sessions, max_seq_len=self.max_seq_len, attention_splits=attention_splits,
                max_batch=self.max_batch, kv_dtype=kv_dtype, block_size=kv_block_size,
                logits_rows=logits_rows, kv_pool_bytes=kv_pool_bytes, slot_count=window_slots,
                prefetch_distance=prefetch_distance, small_item_bytes=small_item_bytes,
                scratch_bytes=scratch_bytes)
        backend = DeviceBackend(
            weights, self.options, self.counters, max_tokens=max_tokens, logits_rows=logits_rows,
            plan_memory=plan_memory, kv_dtype=kv_dtype, kv_layers=c.num_hidden_layers, max_sessions=sessions,
            max_seq_len=self.max_seq_len, attention_splits=attention_splits,
            attention_min_keys=ATTENTION_MIN_KEYS if attention_min_keys is None else attention_min_keys,
            attention_warps=ATTENTION_WARPS if attention_warps is None else attention_warps)
        memory = backend.memory
        self.resident_experts = memory.experts
        self.preload_line, warning = backend.window.preload_report(memory.budget_bytes, memory.needs.total)
        print(f"kestrel-stream: {self.preload_line}", file=sys.stderr)
        if warning:
            print(f"kestrel-stream: {warning}", file=sys.stderr)
        self.window_plan = memory.window
        self.steps = WholeStep(backend, self.counters, max_batch=self.max_batch, rope_fused=rope_fused,
                               verify=self.options.verify if verify is None else verify)

    def _start_mixed(self, mode: str, prefill_chunk: int, max_sessions: int | None) -> None:
        """gated and layers=N: host and device segments; the device backend holds what the plans put on the GPU."""
        from kestrel_stream.cuda.kernels import ATTENTION_HEAD_DIMS
        from kestrel_stream.run.device.backend import DeviceBackend
        from kestrel_stream.run.device.weight_window import weight_tensors
        from kestrel_stream.run.mixed import ATTENTION_SPLITS, MixedSteps
        c, weights = self.config, self.weights
        if self.gpu_layers and (c.head_dim not in ATTENTION_HEAD_DIMS or c.gqa_group > 8):
            raise ValueError(f"mode {mode} runs attention on the GPU, whose kernels serve head_dim "
                             f"{'/'.join(map(str, ATTENTION_HEAD_DIMS))} with <= 8 q heads per kv head; "
                             f"{weights.source or 'model'} has head_dim={c.head_dim}, group={c.gqa_group}: "
                             "use mode gated or cpu")
        T = max(self.max_batch, prefill_chunk)
        self.counters = StepCounters.counting("weight_uploads", "weight_upload_bytes", "gpu_weight_read_bytes",
                                              "cpu_weight_read_bytes", "graph_replays", "graphs_captured")
        start = time.perf_counter()
        resident = self._gpu_weights(T)
        table_rows = max_sessions or DEFAULT_MAX_SESSIONS
        # float32 KV for the GPU layers, at most (max_sessions or 2 x max_batch) full-length sessions' worth
        memory = lambda free_bytes, scratch_bytes: plan_mixed_memory(     # noqa: E731
            c, resident=resident, max_tokens=T, kv_layers=self.gpu_layers, max_sessions=table_rows,
            sessions=max_sessions or 2 * self.max_batch, max_seq_len=self.max_seq_len,
            attention_splits=ATTENTION_SPLITS)
        backend = DeviceBackend(
            weights, self.options, self.counters, max_tokens=T, logits_rows=T, plan_memory=memory, kv_dtype="f32",
            kv_layers=self.gpu_layers, max_sessions=table_rows, max_seq_len=self.max_seq_len,
            attention_splits=ATTENTION_SPLITS, dense=False, step_outputs=False, pinned_state=True)
        tensors = weight_tensors(weights)
        self.counters.weight_uploads += len(backend.window.resident)
        self.counters.weight_upload_bytes += sum(tensors[name][0].nbytes for name in backend.window.resident)
        self.steps = MixedSteps(backend, self.counters, self.plan, gpu_layers=self.gpu_layers, max_tokens=T,
                                mode=self.mode, load_s=time.perf_counter() - start, options=self.options)
        self.preload_line = self.steps.preload_line

    def placement_for(self, tokens: int):
        """Mode offload's placement of a step of `tokens` tokens (the resident layers and ring kept)."""
        from scheduler import offload
        if tokens == 1:
            return self.placement
        return offload.place_for_tokens(self.placement, self.config, self.profile, tokens)

    def _check_gpu_mode(self, kv_dtype: str, kv_block_size: int, attention_splits: int) -> None:
        from kestrel_stream.cuda.kernels import ATTENTION_HEAD_DIMS
        c = self.config
        if kv_dtype not in ("f16", "f32"):
            raise ValueError(f"kv_dtype {kv_dtype!r}: expected f16 (default) or f32 (the reference)")
        if kv_block_size not in (16, 32, 64):
            raise ValueError(f"kv_block_size {kv_block_size}: expected 16, 32 or 64 positions")
        if c.head_dim not in ATTENTION_HEAD_DIMS or c.gqa_group > 8 or not 1 <= attention_splits <= 32:
            raise ValueError(f"gpu mode needs head_dim in {'/'.join(map(str, ATTENTION_HEAD_DIMS))} and <= 8 q "
                             f"heads per kv head; "
                             f"{self.weights.source or 'model'} has head_dim={c.head_dim}, group={c.gqa_group}")

    def _gpu_weights(self, T: int) -> set:
        """The window items the plans of 1, 2, 4, ... max_tokens tokens run on the GPU: a mixed mode's
        resident set.  The gate offloads more as steps grow, so these cover the steps of sizes between; a
        weight some other plan wants there (a forced group choice) is uploaded on its first use and kept."""
        counts = sorted({min(1 << i, T) for i in range(T.bit_length() + 1)})
        return {op.name.split("[")[0] for t in counts for op in self.plan(t).ops_on("gpu") if op.group}

    # ---- plans ----------------------------------------------------------------------------------
    def plan(self, tokens: int) -> scheduler.Plan:
        """The plan of a step of `tokens` tokens, as this executor runs it."""
        if self.mode == "cpu":
            return self.steps.plan(tokens)
        if self.mode == "gpu":
            b = self.steps.backend
            return scheduler.build_plan(self.config, tokens, "gpu", gpu_available=True,
                                        streamed=set(b.window.streamed), dense_min_tokens=b.dense_min_tokens,
                                        dense_fused=b.blas is None, rope_fused=self.steps.rope_fused)
        if tokens not in self._plans:
            offload = self.mode == "offload"
            plan = scheduler.build_plan(self.config, tokens=tokens, mode=self.mode, profile=self.profile,
                                        gpu_available=True, group_choice=self.group_choice,
                                        minflop=self.options.minflop,
                                        offload=self.placement_for(tokens) if offload else None,
                                        resident_experts=self.resident_experts.experts
                                        if offload and self.resident_experts is not None else None)
            scheduler.audit_plan(plan, self.config)
            self._plans[tokens] = plan
        return self._plans[tokens]

    def set_group_choice(self, group_choice: dict | None) -> None:
        """Force groups on/off in every layer (the bench's exhaustive search); weights stay on the device."""
        self.group_choice = group_choice
        self._plans.clear()
        self.steps.clear_launches()

    # ---- a mixture-of-experts model's experts ------------------------------------------------------
    def routing_counts(self):
        """Each routed layer's selections per expert so far, int64 [routed layers, E], wherever the router ran
        (None for a dense model)."""
        return self.steps.routing_counts()

    def place_experts(self, policy: str = "frequency", counts=None):
        """Mode offload: choose the resident experts again, by `policy` (scheduler/expert_residency.py) from
        `counts` ([routed layers][experts]; default: routing_counts()), into the pool's slots; later steps'
        plans split each routed layer by the new choice.  Returns the ResidentExperts."""
        from scheduler import expert_residency
        store = self.steps.backend.experts if self.mode == "offload" else None
        if store is None or not store.slots:
            raise ValueError(f"mode {self.mode}: no expert pool to place experts in (mode offload with room for "
                             "experts beside its layers)")
        counts = self.routing_counts() if counts is None else counts
        choice = expert_residency.choose(counts, store.layers, self.config.num_experts, store.slots, policy)
        self.steps.backend.stream.synchronize()           # no launch still reads the pool
        store.place(choice)
        self.resident_experts = choice
        self._plans.clear()
        self.steps.clear_launches()
        return choice

    @property
    def backend(self):
        """The device backend (None in cpu mode)."""
        return None if self.mode == "cpu" else self.steps.backend

    @property
    def use_graphs(self) -> bool:
        """gpu mode: decode steps replay one graph per batch bucket; False launches every kernel eagerly."""
        return self.steps.use_graphs

    @use_graphs.setter
    def use_graphs(self, value: bool) -> None:
        self.steps.use_graphs = value

    # ---- what the engine asks: each the mode's steps' own --------------------------------------------
    def alloc_kv(self, max_seq_len: int):
        return self.steps.alloc_kv(max_seq_len)

    def free_kv(self, kv) -> None:
        self.steps.free_kv(kv)

    def truncate_kv(self, kv, length: int) -> None:
        self.steps.truncate_kv(kv, length)

    def move_kv(self, kv, moves: list[tuple[int, int]]) -> None:
        self.steps.move_kv(kv, moves)

    def fork_kv(self, kv, length: int, capacity: int | None = None):
        return self.steps.fork_kv(kv, length, capacity)

    def kv_stats(self) -> dict:
        return self.steps.kv_stats()

    def check_kv_room(self, batch: list) -> None:
        pool = None if self.mode == "cpu" else self.steps.backend.kv
        if pool is None:
            return
        writes = [(getattr(kv, "device", kv), start, start + len(ids)) for kv, ids, start in batch]
        pool.check_room([(kv, lo, hi) for kv, lo, hi in writes if kv is not None])

    def forward(self, batch: list, logits: str = "all", trees: list | None = None) -> list[np.ndarray]:
        """batch: (kv, token ids [n_i], start position) per session → logits [n_i, V] float32 each, or with
        logits="last" each session's last row, [1, V]; trees: per session a TokenTree or None."""
        return self.steps.forward(batch, logits, trees)

    def forward_greedy(self, batch: list) -> np.ndarray:
        return self.steps.forward_greedy(batch)

    def forward_argmax(self, batch: list, trees: list | None = None) -> list[np.ndarray]:
        return self.steps.forward_argmax(batch, trees)

    def forward_sample(self, batch: list, states: list) -> np.ndarray | None:
        return self.steps.forward_sample(batch, states)

    def generate_greedy(self, batch: list, steps: int) -> np.ndarray | None:
        return self.steps.generate_greedy(batch, steps)

    def generate_sampled(self, batch: list, steps: int, states: list) -> np.ndarray | None:
        return self.steps.generate_sampled(batch, steps, states)

    def close(self) -> None:
        """Give the device's arena, graphs and pinned buffers back (the engine calls this on close)."""
        self.steps.close()
