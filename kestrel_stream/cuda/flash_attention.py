"""The tensor-core attention of kernels_ptx/flash_attention.cu, and which attention a step gets.

A step's attention is the split-key kernel (attention.cu: decode, one query row per session, keys
spread over many blocks) or the flash kernel (query tiles of one session sharing every K/V tile on
tensor cores).  Which one depends on how the step's rows are grouped into sessions, which the
launch list (built once per token count) does not know: `AttentionChoice` stands in the list for
both and picks when it is enqueued, from the step's staged rows (`StepChoice`: once per step).  Graph captures are decode steps
(one row per session), so a capture always gets the split kernel.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

FLASH_HEAD_DIMS = (64, 128)     # flash_attention.cu's DEFINE_FLASH_ATTENTION lines
FLASH_ROWS = 64                 # (token, q head) rows per block: FLASH_ROWS // group tokens
FLASH_THREADS = 128
FLASH_SIGNATURE = "pppppiiiiiifip"
# The fewest query rows per session (and tokens per step) for which the flash kernel replaces the
# split kernel, per head dim.  Not yet measured on the GPU: 16 = one mma row tile of tokens, the
# size at which a K/V tile is shared by enough rows to pay for itself.  bench/prefill.py
# --attention split|flash measures both sides.
FLASH_MIN_ROWS = {64: 16, 128: 16}


# Split-key attention launches n_kv x tokens x splits blocks.  One session's decode needs the key
# splits to fill the GPU; a step of many sessions brings n_kv x tokens blocks already, and each split
# more only adds partial writes, a merge and blocks that wait for a slot.  A step gets the splits that
# make about SPLIT_TARGET_BLOCKS blocks (bench/fewtok_decode.py --split-blocks measures the choice).
SPLIT_TARGET_BLOCKS = 1024


def split_count(tokens: int, n_kv: int, max_splits: int) -> int:
    """Key splits of a split-kernel step of `tokens` query rows (1..max_splits)."""
    return max(1, min(max_splits, -(-SPLIT_TARGET_BLOCKS // (n_kv * max(tokens, 1)))))


def partial_floats(max_tokens: int, n_heads: int, n_kv: int, head_dim: int, max_splits: int) -> int:
    """Floats split attention's partials take for steps of up to `max_tokens` rows: the most (row, split)
    pairs a step launches (split_count falls as rows grow, so the largest step is not the one with the
    most pairs) x q heads x (head_dim accumulators + max + sum)."""
    pairs = max(t * split_count(t, n_kv, max_splits) for t in range(1, max(max_tokens, 1) + 1))
    return pairs * n_heads * (head_dim + 2)


def flash_supported(head_dim: int, kv_dtype: str, group: int) -> bool:
    """Whether flash_attention.cu serves this model's attention (paged f16 KV, <= 8 q heads per kv head)."""
    return head_dim in FLASH_HEAD_DIMS and kv_dtype == "f16" and 1 <= group <= 8


def tile_tokens(group: int) -> int:
    """Query tokens per block for `group` q heads per kv head."""
    return FLASH_ROWS // group


def shortest_run(table_rows: np.ndarray) -> int:
    """Length of the shortest run of equal entries (one session's consecutive rows) in a step's rows."""
    if len(table_rows) == 0:
        return 0
    starts = np.flatnonzero(table_rows[1:] != table_rows[:-1]) + 1
    return int(np.diff(np.concatenate(([0], starts, [len(table_rows)]))).min())


def prefers_flash(head_dim: int, table_rows: np.ndarray) -> bool:
    """The measured choice (FLASH_MIN_ROWS) for a step whose rows' sessions are `table_rows`."""
    return shortest_run(table_rows) >= FLASH_MIN_ROWS[head_dim]


def split_head(head_dim: int, table_rows: np.ndarray) -> int:
    """The rows of a step that the split kernel takes when the rest go to the flash kernel: up to the end of its
    last run shorter than FLASH_MIN_ROWS (0: every run long enough, the whole step on the flash kernel; all of
    them: the last run is short, the whole step on the split kernel).  A serving step holds its decodes (a row a
    session) first and its prompt chunks after them: the decodes on the split kernel, the chunks on the flash
    kernel, where one kernel for all would be the split kernel's key loop for every row of every chunk."""
    n = len(table_rows)
    if n == 0:
        return 0
    starts = np.concatenate(([0], np.flatnonzero(table_rows[1:] != table_rows[:-1]) + 1))
    ends = np.concatenate((starts[1:], [n]))
    short = np.flatnonzero(ends - starts < FLASH_MIN_ROWS[head_dim])
    return int(ends[short[-1]]) if len(short) else 0


def flash_attention_launch(kernels, q: int, tables: int, table_row: int, pos: int, out: int, tokens: int,
                           layer: int, n_layers: int, n_heads: int, n_kv: int, head_dim: int, block_shift: int,
                           window: int = 0, scale: float | None = None, tree: int = 0):
    """Causal attention of `tokens` query rows over the paged f16 pool (kernels_ptx/kv_cache.cuh), the
    arguments of paged_attention_launch less the split workspace: no partials, no tickets."""
    group = n_heads // n_kv
    assert flash_supported(head_dim, "f16", group) and n_heads % n_kv == 0, (head_dim, n_heads, n_kv)
    grid = (n_kv, -(-tokens // tile_tokens(group)))
    return kernels.launch(f"flash_attention_paged_d{head_dim}_f16", grid, (FLASH_THREADS,), FLASH_SIGNATURE,
                          [q, tables, table_row, pos, out, tokens, layer, n_layers, n_heads, n_kv, window,
                           1.0 / float(np.sqrt(head_dim)) if scale is None else scale, block_shift, tree])


class StepChoice:
    """Which kernel one step's attention uses, decided by its first layer's launch when enqueued (from
    the staged rows: one decision per step, not per layer) and read by every later layer's."""

    def __init__(self, staged_table_rows: Callable[[], np.ndarray], head_dim: int):
        self.staged_table_rows, self.head_dim = staged_table_rows, head_dim
        self.flash = False
        self.head = 0           # rows [0, head) on the split kernel, the rest on the flash kernel (split_head)

    def decide(self) -> bool:
        rows = self.staged_table_rows()
        self.head = split_head(self.head_dim, rows)
        self.flash = self.head == 0
        return self.flash


class AttentionChoice:
    """A step's attention launch: `flash` where the staged rows come in runs of at least
    FLASH_MIN_ROWS per session (prefill chunks), `split` in every graph capture and where no run is, and where
    short runs (decodes) come before long ones (chunks), both: `split_rows(d)` over the first d rows and
    `flash_rows(d)` over the rest (StepChoice.head), launches made for that d and kept for the next steps.

    kernel: "auto" (that choice), or "split" / "flash" to force one (benches, tests).  Labels and the
    programmatic flag go to every launch; each traces under its own kernel name."""
    launch_count = 1
    KEPT_HEADS = 8              # the (split, flash) pairs kept, by head rows

    def __init__(self, split, flash, step: StepChoice, first_layer: bool, split_rows=None, flash_rows=None):
        self.split, self.flash, self.step, self.first_layer = split, flash, step, first_layer
        self.split_rows, self.flash_rows = split_rows, flash_rows
        self.kernel = "auto"
        self._pairs: dict[int, tuple] = {}

    @property
    def name(self) -> str:
        return self.split.name

    @property
    def labels(self) -> dict:
        return self.split.labels

    def label(self, **labels) -> "AttentionChoice":
        self.split.label(**labels)
        self.flash.label(**labels)
        for pair in self._pairs.values():
            for launch in pair:
                launch.label(**labels)
        return self

    @property
    def programmatic(self) -> bool:
        return self.split.programmatic

    @programmatic.setter
    def programmatic(self, enabled: bool) -> None:
        self.split.programmatic = enabled
        self.flash.programmatic = enabled
        for pair in self._pairs.values():
            for launch in pair:
                launch.programmatic = enabled

    def chosen(self, stream) -> tuple:
        """The launches this step runs on `stream` (the first layer's call decides for the step)."""
        if self.kernel != "auto":
            return (self.flash if self.kernel == "flash" else self.split),
        if stream.capturing:
            return self.split,
        if self.first_layer:
            self.step.decide()
        head, rows = self.step.head, len(self.step.staged_table_rows()) if self.split_rows else 0
        if self.step.flash:
            return self.flash,
        if self.split_rows is None or head >= rows:
            return self.split,
        return self._pair(head)

    def _pair(self, head: int) -> tuple:
        pair = self._pairs.get(head)
        if pair is None:
            if len(self._pairs) >= self.KEPT_HEADS:
                self._pairs.clear()
            pair = self._pairs[head] = (self.split_rows(head), self.flash_rows(head))
            for launch in pair:
                launch.label(**self.split.labels)
                launch.programmatic = self.split.programmatic
        return pair

    def enqueue(self, stream) -> None:
        for launch in self.chosen(stream):
            launch.enqueue(stream)

    def submit(self, stream) -> None:
        for launch in self.chosen(stream):
            launch.submit(stream)


def attention_choice(kernels, split, step: StepChoice, *, q: int, tables: int, table_row: int, pos: int,
                     out: int, tokens: int, layer: int, n_layers: int, n_heads: int, n_kv: int, head_dim: int,
                     block_shift: int, kv_dtype: str, window: int, scale: float, tree: int = 0, split_rows=None,
                     tree_row_bytes: int = 0):
    """`split` (paged_attention_launch) itself where the flash kernel cannot serve the step (float32
    KV, another head dim or GQA group, fewer tokens than FLASH_MIN_ROWS), else an AttentionChoice.
    split_rows(d): the split launch over the step's first d rows (None: a step is never shared between the
    kernels); the flash kernel then takes the rest, its row pointers moved past them (q and out float32
    [tokens, n_heads * head_dim], the table rows int64 and positions int32 a row, tree_row_bytes a tree row)."""
    if not flash_supported(head_dim, kv_dtype, n_heads // n_kv) or tokens < FLASH_MIN_ROWS[head_dim]:
        return split
    flash = flash_attention_launch(kernels, q, tables, table_row, pos, out, tokens, layer, n_layers, n_heads,
                                   n_kv, head_dim, block_shift, window, scale, tree)
    row = 4 * n_heads * head_dim

    def flash_rows(d: int):
        return flash_attention_launch(kernels, q + d * row, tables, table_row + 8 * d, pos + 4 * d, out + d * row,
                                      tokens - d, layer, n_layers, n_heads, n_kv, head_dim, block_shift, window,
                                      scale, tree + tree_row_bytes * d if tree else 0)
    return AttentionChoice(split, flash, step, first_layer=layer == 0, split_rows=split_rows,
                           flash_rows=flash_rows if split_rows is not None else None)
