"""gpu mode's steps of a few tokens on one session (prefill chunks, speculative verification passes) as
graphs: one captured per (bucket of token counts, logits kind, attention kernel), replayed at any position.

Launched eagerly, such a step costs a Python driver call a kernel, about six a layer, where a one-token
step is one graph replay.  Nothing in its launch list depends on where the session stands: every kernel
reads the step's token ids, positions and KV table rows from the params block in device memory
(step_io.py), staged by the host before the replay; grids and scalar arguments depend on the token count
alone; the KV table entries the step writes through are committed and uploaded before it (kv_paged.py).

Buckets: 1..8 tokens exactly (the GEMV kernels: q8_gemv_m<k>, q4_gemv_m<next power of two>), then 16,
32, 48 and 64 (the tensor-core GEMMs' 16-token tiles, whose tile and K-split choices are those of any
count of the same tiles), a step padded up to its bucket.  Padded rows come first, so the step's own
rows are the bucket's last and logits="last" is lm_head on row bucket - 1 in every replay.  A padded row
is token 0 at position 0 of the scratch cache, as a decode graph's padded slots: it appends its key and
value there and attends only there, and no kernel mixes rows (split attention reads each row's own
table row; the flash kernel walks the runs of one session's rows apart).

Kinds: "last" (lm_head on the last row, its logits out inside the graph), "all" (lm_head on every row,
the step's own rows copied out after the replay: one copy of k rows, not of the bucket's), "argmax"
(argmax_split on every row, 4 bytes a row out inside the graph).  Attention is the kernel the eager
step would get (flash_attention.prefers_flash on the step's own rows, not the padded ones): part of the key.

The step runs eagerly instead (whole_step.py) with several sessions, a token tree, more tokens than the
largest bucket, timed streaming (KESTREL_PROF or a trace with streamed weights), graphs off
(KESTREL_STEP_GRAPHS=0, use_graphs off), and for a mixture-of-experts model where the step would be padded
(a padded row would be routed, and counted, as a token).  A bench's forced attention kernel
(AttentionChoice.kernel) is a switch of the eager launch lists.  Launch lists rebuilt (WholeStep.clear_launches)
drop the graphs made of them.
"""
from __future__ import annotations

import sys

import numpy as np

from kestrel_stream.cuda import driver
from kestrel_stream.cuda.errors import CudaError
from kestrel_stream.cuda.flash_attention import AttentionChoice, prefers_flash
from kestrel_stream.cuda.kernels import GEMV_MAX_TOKENS
from kestrel_stream.obs import load_stages, prof

EXACT_TOKENS = tuple(range(1, GEMV_MAX_TOKENS + 1))
PADDED_TOKENS = (16, 32, 48, 64)
KINDS = ("last", "all", "argmax")


class StepGraphs:
    """The graphs of one WholeStep `x`'s single-session steps; enabled: Options.step_graphs."""

    def __init__(self, x, enabled: bool):
        self.x, self.enabled = x, enabled
        most = min(x.max_tokens, x.logits_rows)        # "all" and "argmax" take a logits row per token
        self.buckets = [b for b in EXACT_TOKENS + PADDED_TOKENS if b <= most]
        self._graphs: dict[tuple[int, str, bool], driver.Graph] = {}
        self._launches: dict[tuple[int, str, bool], list] = {}      # kept: the window checks a list once by id
        self._costs: dict[tuple[int, str, bool], tuple[int, int]] = {}   # kernels, weight bytes they read
        self._flash_for: dict[int, bool] = {}   # tokens -> whether the step's attention is the flash kernel

    def bucket(self, batch, trees=None) -> int | None:
        """The bucket whose graph serves the step `batch` ((kv, ids, start) per session), or None: eager."""
        x = self.x
        x.window.timing = x.window.wants_timing()     # timed streamed steps run eagerly
        if not (self.enabled and x.use_graphs) or trees is not None or len(batch) != 1 or x.window.timing:
            return None
        tokens = len(np.atleast_1d(batch[0][1]))
        bucket = next((b for b in self.buckets if b >= tokens), None)
        if bucket is None or (bucket != tokens and x.config.is_moe):
            return None
        return bucket

    def ready(self, session, bucket: int, kind: str) -> bool:
        """Whether the key of this step has its graph (captured now on first use).  A capture the driver
        refuses turns step graphs off for this engine, said in one line: the steps run eagerly."""
        k = len(np.atleast_1d(session[1]))
        if k not in self._flash_for:
            self._flash_for[k] = self._flash(bucket, k)
        key = (bucket, kind, self._flash_for[k])
        if key in self._graphs:
            return True
        try:
            self._capture(key)
        except CudaError as e:
            self.enabled = False
            print(f"kestrel-stream: one session's step graphs off ({e}); its steps launch eagerly",
                  file=sys.stderr)
            return False
        return True

    def run(self, session, bucket: int, kind: str) -> np.ndarray:
        """session: the step's (kv, token ids [k], start position).  Stages its rows after bucket - k padded
        ones, replays the key's graph (captured on first use), waits: the step's one sync.  Returns views of
        the pinned outputs: "last" logits [1, V], "all" [k, V], "argmax" int32 [k]."""
        assert kind in KINDS, kind
        x, (kv, ids, start) = self.x, session
        ids = np.atleast_1d(ids)
        k = len(ids)
        x.step_params.stage_session(kv.base_elements, ids, start, bucket, (x.scratch_kv.base_elements, 0, 0))
        x.counters.h2d_bytes += x.step_params.stage_tree(None, x.stream)     # zeros where a tree step was
        if k not in self._flash_for:
            self._flash_for[k] = self._flash(bucket, k)
        key = (bucket, kind, self._flash_for[k])
        if key not in self._graphs:
            self._capture(key)
        self._graphs[key].launch(x.stream)
        if kind == "all":
            x.outputs.enqueue_logits(k, x.stream, first_row=bucket - k)
        x.outputs.wait(x.stream, whole_stream=prof.enabled)
        kernels, weight_read = self._costs[key]
        V = x.config.vocab_size
        x._count(1, kernels, weight_read, tokens=bucket,
                 d2h={"last": V * 4, "all": k * V * 4, "argmax": bucket * 4}[kind])
        x.counters.graph_replays += 1
        if kind == "argmax":
            return x.outputs.tokens_view[bucket - k:bucket]
        return x.outputs.logits_view[:1 if kind == "last" else k]

    def captured(self) -> list[tuple[int, str, bool]]:
        """The (bucket, kind, flash attention) keys captured so far."""
        return sorted(self._graphs)

    def _flash(self, bucket: int, tokens: int) -> bool:
        """Whether the step's attention is the flash kernel: where the bucket's launch list leaves the choice
        to the step (attention_choice), the eager rule on the step's own rows."""
        choosing = any(isinstance(launch, AttentionChoice) for launch in self.x.step_launches(bucket))
        return choosing and prefers_flash(self.x.config.head_dim, np.zeros(tokens, np.int64))

    def _capture(self, key: tuple[int, str, bool]) -> None:
        """Params up, every kernel (the attention choice made), the kind's outputs: one graph."""
        x, (bucket, kind, flash) = self.x, key
        listed = x.step_launches(bucket, (bucket - 1, 1) if kind == "last" else None)
        launches = [(launch.flash if flash else launch.split) if isinstance(launch, AttentionChoice) else launch
                    for launch in listed]

        def outputs() -> None:      # before the compute stream waits for the window's primes
            if kind == "last":
                x.outputs.enqueue_logits(1, x.stream)
            elif kind == "argmax":
                x.outputs.enqueue_tokens(x.argmax_launch(bucket).enqueue, bucket, x.stream)
        with load_stages.stage("graph capture"), driver.capture(x.stream) as captured:
            x.step_params.upload(bucket, x.stream)
            x.window.enqueue_step(launches, x.stream, then=outputs)
        self._graphs[key], self._launches[key] = captured.graph, launches
        self._costs[key] = x.kernel_count(listed) + (kind == "argmax"), x.weight_read_bytes(listed)
        x.counters.graphs_captured += 1

    def clear(self) -> None:
        """Forget the graphs and their launch lists (WholeStep.clear_launches: the launch lists changed)."""
        for graph in self._graphs.values():
            graph.destroy()
        for cache in (self._graphs, self._launches, self._costs, self._flash_for):
            cache.clear()

    close = clear
