"""gpu mode's steps that no decode graph runs, launched eagerly: prompt chunks beside decodes, token trees, more
sessions than a graph holds, timed streamed steps.

The rows go in chunks of `max_tokens` (resident weights) or of one `logits_rows` span each (streamed weights,
whose ring runs in step order); within a chunk lm_head runs on the wanted rows alone, once per span of
`logits_rows` of them (the logits buffer's rows), again over the step's last xn rows for each further span.
What comes back for the wanted rows is their logits, or each one's token taken on the device after lm_head
(argmax_split, or a draw with the row's sampling state; the other rows of a span draw with the greedy padding
state, unused): 4 bytes a row.

WholeStep (whole_step.py) holds one; it runs the WholeStep's staging, launch lists, outputs and sampler.
"""
from __future__ import annotations

import numpy as np

from kestrel_stream.obs import prof
from kestrel_stream.run.device.sample_state import GREEDY_STATE


class EagerRows:
    """WholeStep's eager path over a step's rows (module docstring)."""

    def __init__(self, x):
        self.x = x                      # the WholeStep: its staging, launch lists, outputs, sampler, counters

    def run(self, rows, fields, wanted: np.ndarray, logits: str, out: np.ndarray, pick=None,
               states: list | None = None) -> None:
        """A step's launch list run eagerly over `rows`: resident weights in chunks of max_tokens, lm_head run
        again over the xn rows for each further logits_rows of wanted rows; streamed ones (the ring's order), a
        chunk per logits_rows span.  Into `out` [len(wanted), V] the wanted rows' logits, or with `pick`
        ("argmax", "sample": `states` one a wanted row) [len(wanted)] their tokens, taken on the device over the
        span of rows lm_head ran on (the rows between wanted ones draw with the sampler's padding, unused)."""
        x = self.x
        V = x.config.vocab_size
        resident = not x.window.streamed
        chunk_tokens = x.max_tokens if logits == "last" or resident else x.logits_rows
        for lo, hi in self.chunks(len(rows), wanted, chunk_tokens, whole=resident):
            chunk = rows[lo:hi]
            x.stage(chunk, len(chunk), None if fields is None else tuple(f[lo:hi] for f in fields))
            for n, inside in enumerate(self.lm_head_groups(wanted, lo, hi)):    # indices into wanted
                first = int(wanted[inside[0]]) - lo if inside.size else 0
                count = int(wanted[inside[-1]]) - lo - first + 1 if inside.size else 0
                if pick == "sample" and count:
                    span = [GREEDY_STATE] * count
                    for i in inside:
                        span[int(wanted[i]) - lo - first] = states[i]
                    x.sampler.stage(span)
                if n == 0:
                    kernel_count, weight_read = x._enqueue_step(len(chunk), pick if count else False,
                                                                   lm_rows=(first, count))
                else:
                    kernel_count, weight_read = self.enqueue_lm_head(len(chunk), (first, count), pick)
                x.outputs.wait(x.stream, whole_stream=prof.enabled)
                x._count(kernel_count, kernel_count, weight_read, tokens=len(chunk) if n == 0 else 0,
                            d2h=count * (4 if pick else V * 4))
                if pick:
                    out[inside] = x.outputs.tokens_view[wanted[inside] - lo - first]
                    if pick == "sample":
                        x.counters.h2d_bytes += count * x.sample_state_bytes
                elif logits == "all":           # the rows first.. are wanted[inside], consecutive
                    out[inside[0]:inside[0] + count] = x.outputs.logits_view[:count]
                else:
                    out[inside] = x.outputs.logits_view[wanted[inside] - lo - first]

    def chunks(self, n_rows: int, wanted: np.ndarray, chunk_tokens: int, whole: bool = False):
        """(lo, hi) row ranges of at most chunk_tokens rows; unless `whole`, ones in which the wanted rows span
        at most logits_rows (a chunk ends early after the last wanted row that still fits)."""
        x = self.x
        lo = 0
        while lo < n_rows:
            hi = min(lo + chunk_tokens, n_rows)
            inside = wanted[(wanted >= lo) & (wanted < hi)]
            if not whole and inside.size and inside[-1] - inside[0] >= x.logits_rows:
                hi = int(inside[inside - inside[0] < x.logits_rows][-1]) + 1
            yield lo, hi
            lo = hi

    def lm_head_groups(self, wanted: np.ndarray, lo: int, hi: int) -> list[np.ndarray]:
        """The indices into `wanted` of rows lo..hi-1, in runs whose rows span less than logits_rows (the
        logits buffer's rows): one lm_head launch and copy out each; one empty run where none is wanted."""
        x = self.x
        inside = np.flatnonzero((wanted >= lo) & (wanted < hi))
        if not inside.size:
            return [inside]
        groups, start = [], 0
        for i in range(1, len(inside)):
            if wanted[inside[i]] - wanted[inside[start]] >= x.logits_rows:
                groups.append(inside[start:i])
                start = i
        return groups + [inside[start:]]

    def enqueue_lm_head(self, tokens: int, lm_rows: tuple[int, int], pick=None) -> tuple[int, int]:
        """lm_head alone over rows lm_rows = (first, count) of the step just run (its xn and 1/rms rows are
        still there), then those logits (or with `pick`, _enqueue_outputs', their tokens) out; returns (kernels,
        weight bytes they read).  Resident weights."""
        x = self.x
        launches = [launch for launch in x.step_launches(tokens, lm_rows) if launch.labels.get("op") == "lm_head"]
        for launch in launches:
            launch.enqueue(x.stream)
        x._enqueue_outputs(lm_rows[1], pick)
        return sum(l.launch_count for l in launches) + bool(pick), sum(l.labels.get("bytes", 0) for l in launches)

    def picks(self, batch, states: list | None) -> np.ndarray | None:
        """Each session's next token where no decode graph runs the step (prompt chunks beside decodes, more
        sessions than a graph, a timed streamed step): its last row's argmax (states None) or draw, taken on the
        device after lm_head, 4 bytes a row back; one session's few tokens replay its argmax graph where one is
        ready.  None under KESTREL_VERIFY (it checks logits): the caller takes them."""
        x = self.x
        if x.verifier is not None:
            return None
        x.device.make_current()
        rows = x._rows(batch)
        x._reserve((kv, start, start + len(np.atleast_1d(t))) for kv, t, start in batch)
        if (states is None and (bucket := x.step_graphs.bucket(batch, None)) is not None
                and x.step_graphs.ready(batch[0], bucket, "argmax")):
            return x._finish(rows, x.step_graphs.run(batch[0], bucket, "argmax").astype(np.int64)[-1:])
        wanted = np.cumsum([len(np.atleast_1d(t)) for _, t, _ in batch]) - 1
        tokens = np.empty(len(batch), np.int64)
        self.run(rows, None, wanted, "last", tokens, "argmax" if states is None else "sample", states)
        return x._finish(rows, tokens)
