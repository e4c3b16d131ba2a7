"""Chained greedy decoding in `gpu` mode: many decode steps per host sync.

A greedy step's output is its input's successor, so the next step need not
wait for the host: after the step's argmax, `chain_advance` (kernels_ptx/
elementwise.cu) writes each row's token into the step parameters in device
memory (token id, position + 1) and appends it to a device history.  The
"chain" graph of a batch bucket is the decode step without its parameter
upload and its copy out: step kernels, argmax, advance.  A run stages the
parameters once, launches the chain graph `n` times back to back and copies
the history out with one sync, so the host's per-step work (Python, graph
launch, sync wake-up) overlaps the GPU's instead of adding to it: syncs per
token fall to 1/n.  The steps are the same kernels as `forward_greedy`'s, so
the tokens are the same.
"""
from __future__ import annotations

import numpy as np

from kestrel_stream.cuda import driver
from kestrel_stream.cuda.kernels import Launch

MAX_STEPS_PER_SYNC = 256   # history capacity: tokens per row between two host syncs


class GreedyChain:
    def __init__(self, executor, max_steps_per_sync: int = MAX_STEPS_PER_SYNC):
        self.x = executor
        self.steps_per_sync = max_steps_per_sync
        T = executor.max_batch
        self.counter = executor.arena.array((1,), np.int32)
        self.history = executor.arena.array((max_steps_per_sync * T,), np.int32)
        self.host_history = driver.PinnedBuffer(max_steps_per_sync * T * 4)
        self._zero = driver.PinnedBuffer(4)
        self._zero.view(np.int32, (1,))[0] = 0
        self._graphs: dict[int, driver.Graph] = {}
        self._kernels: dict[int, int] = {}
        self._advance: dict[int, Launch] = {}

    def _advance_launch(self, tokens: int) -> Launch:
        x = self.x
        if tokens not in self._advance:
            kvbase, ids, pos = x.step_params.pointers(tokens)
            launch = x.kernels.launch(
                "chain_advance", (1,), (32,), "ppppppqi",
                [ids, pos, kvbase, x.outputs.argmax_out.ptr, self.counter.ptr,
                 self.history.ptr, x.scratch_kv.base_elements, tokens])
            launch.label(op="chain_advance")
            launch.programmatic = x.argmax_launch(tokens).programmatic
            self._advance[tokens] = launch
        return self._advance[tokens]

    def _pick_launch(self, bucket: int) -> Launch:
        """The kernel that writes each row's next token into argmax_out (sampled_chain.py: a draw)."""
        return self.x.argmax_launch(bucket)

    def _graph(self, bucket: int) -> driver.Graph:
        if bucket not in self._graphs:
            x = self.x
            with driver.capture(x.stream) as captured:
                launches = x.step_launches(bucket)
                pick, advance = self._pick_launch(bucket), self._advance_launch(bucket)
                x.window.enqueue_step(launches, x.stream,
                                      then=lambda: (pick.enqueue(x.stream), advance.enqueue(x.stream)))
            self._graphs[bucket] = captured.graph
            self._kernels[bucket] = x.kernel_count(launches) + 2, x.weight_read_bytes(launches)
            x.counters.graphs_captured += 1
        return self._graphs[bucket]

    def run(self, rows: list, steps: int) -> np.ndarray:
        """rows: (kv, token, position) per session; `steps` greedy decode steps → int64 [steps, rows]."""
        x = self.x
        bucket = next(b for b in x.buckets if b >= len(rows))
        x.stage(rows, bucket)
        graph = self._graph(bucket)
        out = np.empty((steps, len(rows)), np.int64)
        history = self.host_history.view(np.int32, (self.steps_per_sync, bucket))
        _, staged_ids, staged_pos = x.step_params.views(bucket)
        kernels, weight_read = self._kernels[bucket]
        done = 0
        while done < steps:
            n = min(self.steps_per_sync, steps - done)
            params_bytes = x.step_params.upload(bucket, x.stream)
            driver.h2d_async(self.counter.ptr, self._zero, 4, x.stream)
            for _ in range(n):
                graph.launch(x.stream)
            driver.d2h_async(self.host_history, self.history.ptr, n * bucket * 4, x.stream)
            x.stream.synchronize()
            out[done:done + n] = history[:n, :len(rows)]
            for i in range(len(rows)):   # the next run of the chain starts where this one stopped
                staged_ids[i] = out[done + n - 1, i]
                staged_pos[i] += n
            done += n
            c = x.counters
            c.syncs += 1
            c.launches += n
            c.kernels += n * kernels
            c.gpu_weight_read_bytes += n * weight_read
            c.h2d_bytes += params_bytes + 4
            c.d2h_bytes += n * bucket * 4
            c.graph_replays += n
            c.steps += n
            c.tokens += n * len(rows)
            for _ in range(n):
                x.window.account(c)
        return out

    def close(self) -> None:
        for graph in self._graphs.values():
            graph.destroy()
        self._graphs.clear()
        self.host_history.free()
        self._zero.free()
