"""gpu mode's steps: the plan is one device segment, every op of the step on the device backend.

The executor (run/step_executor.py) hands every step of a whole-step plan to WholeStep, which holds what
those steps use of the device backend (backend.py) and the graphs, chains and sampler built on it.

Static buffers, sized at load for `max_tokens` = max(max_batch, prefill_chunk)
tokens, live in the one device arena beside the weights; the KV cache is a
pool of blocks committed as sessions grow (kv_paged.py), f16 by default.  A
step's per-token scalars (token id, position, KV base) are written by the host
into a pinned staging block; the step's first node copies that block to the
device, and every kernel reads them from there, so one captured graph per
decode batch-size bucket (1, 2, 4, 8 sessions on the GEMV kernels; 16, 32, 64
on the tensor-core GEMM, up to max_batch) serves every later step.  Decode:
fill staging, one graph launch, one host wait for the step's outputs (its only
sync: step_io.py), copy logits out; a bigger batch replays the largest bucket in chunks.  One session's
step of up to 64 tokens replays a graph per bucket of token counts too (step_graphs.py).  Longer prefills,
mixed batches and token trees run the same launch list eagerly (eager_rows.py), lm_head on the wanted rows
alone; each session's next token in such a step is taken on the device too (forward_greedy, forward_sample).

Rows whose argmax is all a caller needs (greedy verification of drafted tokens) get it on the device:
argmax_split over the chunk's logits rows, 4 bytes a row back (forward_argmax).

The launch list of a step and why it looks as it does: launches.py.  One concern, one file: every way
a gpu-mode step is run and what it hands back (logits, argmax rows, tokens, chains) over the same
staged rows, launch lists and outputs.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from kestrel_stream.cuda import driver
from kestrel_stream.obs import load_stages, prof
from kestrel_stream.run.device.greedy_chain import GreedyChain
from kestrel_stream.run.device.launches import argmax_launch, step_launches
from kestrel_stream.run.device.sampled_chain import SampledChain
from kestrel_stream.run.device.eager_rows import EagerRows
from kestrel_stream.run.device.sampler import STATE_WORDS, DeviceSampler
from kestrel_stream.run.device.step_graphs import StepGraphs
from kestrel_stream.run.steps import Steps
from kestrel_stream.run.token_tree import step_tree_fields
from scheduler.ops import PARAMS_BYTES_PER_TOKEN

if TYPE_CHECKING:
    from kestrel_stream.cuda.kernels import Launch
    from kestrel_stream.run.device.backend import DeviceBackend
    from kestrel_stream.run.device.kv_paged import PagedKV as GpuKV


class WholeStep(Steps):
    """gpu mode's steps over one device backend: eager launch lists, one graph per decode bucket, greedy
    and sampled chains, the device sampler."""
    use_graphs = True     # False: every step launches its kernels eagerly (the bench's baseline)

    def __init__(self, backend: DeviceBackend, counters, *, max_batch: int, rope_fused: bool, verify: bool):
        self.backend = b = backend
        self.config, self.weights, self.options, self.counters = b.weights.config, b.weights, b.options, counters
        self.max_batch, self.max_tokens, self.logits_rows, self.rope_fused = (max_batch, b.max_tokens,
                                                                              b.logits_rows, rope_fused)
        self.device, self.kernels, self.stream, self.arena = b.device, b.kernels, b.stream, b.arena
        self.window, self.kv, self.device_ops = b.window, b.kv, b.ops
        self.logits, self.step_params, self.outputs = b.logits, b.step_params, b.outputs
        self.token_outputs = b.token_outputs
        # programmatic dependent launch between the step's kernels (sm_90+); KESTREL_PDL=0 turns it off
        self.programmatic = self.options.programmatic_launch
        self.scratch_kv = self.kv.open(1)        # padded slots decode token 0 at its position 0
        self.kv.prepare(self.scratch_kv, 0, 1)
        self._launches: dict[int, list[Launch]] = {}
        self._weight_read: dict = {}        # id of a cached launch list -> the weight bytes its kernels read
        self._kernel_count: dict = {}       # id of a cached launch list -> the launches it makes
        self._graphs: dict[tuple[int, bool], driver.Graph] = {}      # (bucket, greedy) -> the captured step
        self._graph_kernels: dict[tuple[int, bool], int] = {}
        self._graph_weight_read: dict[tuple[int, bool], int] = {}    # the weight bytes a replay's kernels read
        self._prof_events = (driver.Event(timing=True), driver.Event(timing=True)) if prof.enabled else ()
        # decode graphs per bucket of sessions up to max_batch (at most logits_rows): 1..8 on the GEMV
        # kernels, 16..64 on the tensor-core GEMM; a bigger batch replays the largest in chunks
        self.graph_rows = min(self.max_batch, self.logits_rows)
        self.buckets = sorted({min(1 << i, self.graph_rows) for i in range(self.graph_rows.bit_length() + 1)})
        self.chain = GreedyChain(self)
        self.sampler = DeviceSampler(self, lambda tokens: self.step_launches(tokens)[-1].programmatic)
        self.sample_state_bytes = STATE_WORDS * 4       # a row's sampling state, uploaded inside the graph
        self.sampled_chain = SampledChain(self)
        self.step_graphs = StepGraphs(self, self.options.step_graphs)    # one session's steps of 1..64 tokens
        self.eager = EagerRows(self)    # steps no graph runs: prompt chunks beside decodes, token trees, ...
        load_stages.record("  buffers, KV pool, launches, chains (all)",
                           time.perf_counter() - self.backend.buffers_started)
        self.verifier = None
        if verify:
            from kestrel_stream.run.verify import Verifier
            self.verifier = Verifier(self.weights, self.counters)

    def clear_launches(self) -> None:
        self._launches.clear()
        self.step_graphs.clear()

    # ---- KV caches: the backend's paged pool, every layer ----------------------------------------------
    def alloc_kv(self, max_seq_len: int) -> GpuKV:
        kv = self.kv.open(max_seq_len)
        if self.verifier:
            self.verifier.track(kv)
        return kv

    def free_kv(self, kv: GpuKV) -> None:
        self.kv.close(kv)
        if self.verifier:
            self.verifier.forget(kv)

    def truncate_kv(self, kv: GpuKV, length: int) -> None:
        self.kv.truncate(kv, length)        # whole blocks past `length` go back to the pool

    def move_kv(self, kv: GpuKV, moves: list[tuple[int, int]]) -> None:
        self.device.make_current()
        self.kv.move(kv, moves)
        if self.verifier:
            self.verifier.move(kv, moves)

    def fork_kv(self, kv: GpuKV, length: int, capacity: int | None = None) -> GpuKV:
        """A new cache of `capacity` positions (default kv's) sharing `kv`'s first `length` positions' blocks
        (copy-on-write: kv_pool.prepare_write)."""
        child = self.kv.fork(kv, length, capacity or kv.capacity)
        if self.verifier:
            self.verifier.fork(kv, child, length)
        return child

    def kv_stats(self) -> dict:
        return self.kv.stats()

    def routing_counts(self) -> np.ndarray | None:
        """The device routers' counts (every routed layer's router runs on the device in gpu mode)."""
        return self.backend.experts.counts() if self.backend.experts is not None else None

    # ---- the launch lists (launches.py), built once per token count ------------------------------
    def step_launches(self, tokens: int, lm_rows: tuple[int, int] | None = None) -> list[Launch]:
        key = tokens if lm_rows is None or lm_rows == (0, tokens) else (tokens, *lm_rows)
        if key not in self._launches:
            self._launches[key] = step_launches(self, tokens, lm_rows)
            self._weight_read[id(self._launches[key])] = sum(l.labels.get("bytes", 0) for l in self._launches[key])
            self._kernel_count[id(self._launches[key])] = sum(l.launch_count for l in self._launches[key])
        return self._launches[key]

    def kernel_count(self, launches: list[Launch]) -> int:
        """The launches a launch list of step_launches makes (a library GEMM entry makes several)."""
        return self._kernel_count[id(launches)]

    def weight_read_bytes(self, launches: list[Launch]) -> int:
        """The weight bytes a launch list of step_launches reads."""
        return self._weight_read[id(launches)]

    def _enqueue_step(self, tokens: int, greedy: bool = False, lm_rows: tuple[int, int] | None = None) -> tuple[int, int]:
        """Params H2D, every kernel, the logits of lm_rows = (first, count) (default: every row) or,
        greedy, each row's argmax, D2H on the compute stream; returns (kernels, weight bytes they read)."""
        self.step_params.upload(tokens, self.stream)
        launches = self.step_launches(tokens, lm_rows)

        rows = tokens if lm_rows is None else lm_rows[1]   # the logits rows lm_head writes

        def outputs() -> None:      # before the compute stream waits for the window's primes
            self._enqueue_outputs(rows, greedy)
        self.window.enqueue_step(launches, self.stream, then=outputs)   # streamed weights: copies + slot events
        return self.kernel_count(launches) + (1 if greedy else 0), self.weight_read_bytes(launches)

    def _enqueue_outputs(self, rows: int, pick) -> None:
        """The step's `rows` logits rows out, or (pick "sample", or any other true value: the argmax) each row's
        token, 4 bytes a row."""
        if not pick:
            self.outputs.enqueue_logits(rows, self.stream)
        elif pick == "sample":                              # sampler.py: the sampled token instead
            self.outputs.enqueue_tokens(lambda stream: self.sampler.enqueue(rows, stream), rows, self.stream)
        else:
            self.outputs.enqueue_tokens(self.argmax_launch(rows).enqueue, rows, self.stream)

    def argmax_launch(self, tokens: int) -> Launch:
        key = ("argmax", tokens)
        if key not in self._launches:
            self._launches[key] = argmax_launch(self, tokens, self.step_launches(tokens)[-1].programmatic)
        return self._launches[key]

    def stage(self, rows: list[tuple[GpuKV, int, int]], padded: int, tree_fields=None) -> None:
        """The rows' params; tree_fields: their token-tree masks (token_tree.step_tree_fields), None: plain,
        uploaded here (outside any capture) where they change."""
        # padded slots decode token 0 at position 0 of the scratch cache
        self.step_params.stage([(kv.base_elements, token, position) for kv, token, position in rows], padded,
                               (self.scratch_kv.base_elements, 0, 0))
        self.counters.h2d_bytes += self.step_params.stage_tree(tree_fields, self.stream)

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
        self.stage(rows, bucket)
        key = (bucket, greedy)
        if key not in self._graphs:
            with load_stages.stage("graph capture"), driver.capture(self.stream) as captured:
                self._graph_kernels[key], self._graph_weight_read[key] = self._enqueue_step(bucket, greedy)
            self._graphs[key] = captured.graph
            self.counters.graphs_captured += 1
        started = time.perf_counter()
        if prof.enabled:
            self._prof_events[0].record(self.stream)
        self._graphs[key].launch(self.stream)
        if prof.enabled:
            self._prof_events[1].record(self.stream)
        self.outputs.wait(self.stream, whole_stream=prof.enabled)
        waited = time.perf_counter()
        self._count(1, self._graph_kernels[key], self._graph_weight_read[key], tokens=bucket,
                    d2h=bucket * 4 if greedy else bucket * self.config.vocab_size * 4)
        if greedy == "sample":                      # the rows' sampling states went up inside the graph
            self.counters.h2d_bytes += bucket * self.sample_state_bytes
        self.counters.graph_replays += 1
        if not prof.enabled:
            return {}
        # one offloaded call per step: the replay's GPU time, the rest of the wait (+ the copy out, by the caller)
        gpu_us = self._prof_events[1].elapsed_ms(self._prof_events[0]) * 1e3
        return {"gemm": gpu_us, "d2h+sync": max((waited - started) * 1e6 - gpu_us, 0.0)}

    def forward(self, batch: list[tuple[GpuKV, np.ndarray, int]], logits: str = "all",
                trees: list | None = None) -> list[np.ndarray]:
        """batch: (kv, token ids [n_i], start position) per session → logits [n_i, V] float32 each, or
        with logits="last" each session's last row, [1, V]: lm_head runs on the wanted rows only (their
        span within each chunk), and prefill chunks are then max_tokens long instead of logits_rows.
        trees: per session a TokenTree (run/token_tree.py) or None."""
        self.device.make_current()
        rows = self._rows(batch)
        fields = None if trees is None else step_tree_fields(batch, trees)
        self._reserve((kv, start, start + len(np.atleast_1d(t))) for kv, t, start in batch)
        V = self.config.vocab_size
        bounds = np.cumsum([0] + [len(np.atleast_1d(t)) for _, t, _ in batch])
        wanted = bounds[1:] - 1 if logits == "last" else np.arange(len(rows))    # rows whose logits return
        out = np.empty((len(wanted), V), np.float32)
        if fields is None and self._replayable(batch, rows):          # a decode step: every row is wanted
            for lo in range(0, len(rows), self.graph_rows):
                chunk = rows[lo:lo + self.graph_rows]
                stages = self._replay(chunk, greedy=False)
                started = time.perf_counter()
                out[lo:lo + len(chunk)] = self.outputs.logits_view[:len(chunk)]
                if prof.enabled:
                    prof.record_call({**stages, "reduce": (time.perf_counter() - started) * 1e6})
        elif ((bucket := self.step_graphs.bucket(batch, trees)) is not None           # one session's few tokens
              and self.step_graphs.ready(batch[0], bucket, logits)):
            out[:] = self.step_graphs.run(batch[0], bucket, logits)
        else:
            self.eager.run(rows, fields, wanted, logits, out)
        self.counters.steps += 1
        self.counters.tokens += len(rows)
        if logits == "last":
            outputs = [out[i:i + 1] for i in range(len(batch))]
        else:
            outputs = [out[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
        if self.verifier:
            self.verifier.check(batch, outputs, logits, trees)
        return outputs

    def _device_rows(self, batch, steps: int = 1, whole_graph: bool = True, chained: bool = False):
        """The rows of a decode step whose next token the device picks (argmax or draw), with KV blocks for
        `steps` positions each; None where the caller takes the logits instead: a plan with host segments,
        not a replayable decode step, KESTREL_VERIFY, more sessions than one graph (whole_graph),
        KESTREL_PROF (chained)."""
        self.device.make_current()
        rows = self._rows(batch)
        if (self.verifier is not None or (chained and prof.enabled) or not self._replayable(batch, rows)
                or (whole_graph and len(rows) > self.graph_rows)):
            return None
        for kv, _, position in rows:
            if position + steps > kv.capacity:
                raise ValueError(f"KV cache holds {kv.capacity} positions; {steps} steps from {position} "
                                 f"need {position + steps}")
        self._reserve((kv, position, position + steps) for kv, _, position in rows)   # positions advance on the device
        return rows

    def _finish(self, rows, tokens: np.ndarray) -> np.ndarray:
        self.counters.steps += 1
        self.counters.tokens += len(rows)
        return tokens

    def forward_greedy(self, batch: list[tuple[GpuKV, np.ndarray, int]]) -> np.ndarray:
        """Each session's greedy next token, int64 [len(batch)]: a decode step takes the argmax on the
        device and copies 4 bytes per token back instead of the logits."""
        rows = self._device_rows(batch, whole_graph=False)
        if rows is None:
            picked = self.eager.picks(batch, None)
            return picked if picked is not None else super().forward_greedy(batch)
        tokens = np.empty(len(rows), np.int64)
        for lo in range(0, len(rows), self.graph_rows):
            chunk = rows[lo:lo + self.graph_rows]
            stages = self._replay(chunk, greedy=True)
            if prof.enabled:
                prof.record_call({**stages, "reduce": 0.0})
            tokens[lo:lo + len(chunk)] = self.outputs.tokens_view[:len(chunk)]
        return self._finish(rows, tokens)

    def forward_argmax(self, batch: list[tuple[GpuKV, np.ndarray, int]], trees: list | None = None) -> list[np.ndarray]:
        """Every row's argmax, int64 [n_i] per session: the step's launches then argmax_split over its
        logits rows on the device, 4 bytes a row back (chunks of logits_rows rows, one sync each)."""
        if self.verifier is not None:          # KESTREL_VERIFY compares logits
            return super().forward_argmax(batch, trees)
        self.device.make_current()
        rows = self._rows(batch)
        fields = None if trees is None else step_tree_fields(batch, trees)
        self._reserve((kv, start, start + len(np.atleast_1d(t))) for kv, t, start in batch)
        if ((bucket := self.step_graphs.bucket(batch, trees)) is not None           # one session's few tokens
                and self.step_graphs.ready(batch[0], bucket, "argmax")):
            return [self._finish(rows, self.step_graphs.run(batch[0], bucket, "argmax").astype(np.int64))]
        tokens = np.empty(len(rows), np.int64)
        for lo in range(0, len(rows), self.logits_rows):
            chunk = rows[lo:lo + self.logits_rows]
            self.stage(chunk, len(chunk), None if fields is None else tuple(f[lo:lo + len(chunk)] for f in fields))
            kernel_count, weight_read = self._enqueue_step(len(chunk), greedy=True, lm_rows=(0, len(chunk)))
            self.outputs.wait(self.stream, whole_stream=prof.enabled)
            self._count(kernel_count, kernel_count, weight_read, tokens=len(chunk), d2h=len(chunk) * 4)
            tokens[lo:lo + len(chunk)] = self.outputs.tokens_view[:len(chunk)]
        self._finish(rows, tokens)
        bounds = np.cumsum([0] + [len(np.atleast_1d(t)) for _, t, _ in batch])
        return [tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def forward_sample(self, batch: list[tuple[GpuKV, np.ndarray, int]], states: list[np.ndarray]) -> np.ndarray | None:
        """Each session's next token drawn on the device (states: device/sample_state.pack_state, one a
        session), int64 [len(batch)]: a decode step's graph, else the eager launch list (eager_rows.py); None
        under KESTREL_VERIFY: the caller samples from forward's logits."""
        rows = self._device_rows(batch)
        if rows is None:
            return self.eager.picks(batch, states)
        self.sampler.stage(states)
        self._replay(rows, greedy="sample")
        return self._finish(rows, self.outputs.tokens_view[:len(rows)].astype(np.int64))

    def generate_sampled(self, batch: list[tuple[GpuKV, np.ndarray, int]], steps: int,
                         states: list[np.ndarray]) -> np.ndarray | None:
        """generate_greedy's chain with each step's token drawn on the device (sampled_chain.py)."""
        if any(position + steps > kv.capacity for kv, _, position in batch):
            return None
        rows = self._device_rows(batch, steps, chained=True)
        return None if rows is None else self.sampled_chain.run_sampled(rows, steps, states)

    def generate_greedy(self, batch: list[tuple[GpuKV, np.ndarray, int]], steps: int) -> np.ndarray | None:
        """`steps` greedy decode steps chained on the device (greedy_chain.py): each session's next
        `steps` tokens, int64 [steps, len(batch)], one host sync per GreedyChain.steps_per_sync steps.
        None where this configuration steps one token at a time instead (_device_rows; a timed streamed
        step): the caller then steps."""
        rows = self._device_rows(batch, steps, chained=True)
        return None if rows is None else self.chain.run(rows, steps)

    def close(self) -> None:
        """Give the graphs, chains, sampler and the backend's memory back."""
        self.device.make_current()
        self.stream.synchronize()
        self.chain.close()
        self.sampler.close()
        self.sampled_chain.close()
        self.step_graphs.close()
        for graph in self._graphs.values():
            graph.destroy()
        self._graphs.clear()
        self.backend.close()

    def _count(self, launches: int, kernels: int, weight_read: int, tokens: int, d2h: int) -> None:
        """One synced pass over `tokens` rows: `launches` as issued, the `kernels` they ran, params up."""
        c = self.counters
        c.syncs += 1
        c.launches += launches
        c.kernels += kernels
        c.gpu_weight_read_bytes += weight_read
        c.h2d_bytes += PARAMS_BYTES_PER_TOKEN * tokens
        c.d2h_bytes += d2h
        self.window.account(c)
