"""One mixed step's state between the host and the device (run/mixed.py walks the segments that move it).

State tensors (rows = tokens of the step): x [T, H] residual, qkv [T, q+2kv], attn [T, q], act [T, I] =
silu(gate)·up, logits [T, V]; each with a pinned host copy, a device copy and a record of which copy is
current.  Entering a host segment downloads what it reads from the device with one sync; entering a GPU
segment uploads what it reads, asynchronously (by a copy_words kernel in mode offload, where the copy
engine is busy with the ring's weights).  The device's xn / 1/rms of the next norm come from the GEMV that
wrote x there, or from the host when x was last written on the host.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from kestrel_stream.cuda import driver
from kestrel_stream.obs import prof
from kestrel_stream.run.host_nodes import ITEM_NORM

if TYPE_CHECKING:
    from kestrel_stream.run.device.backend import DeviceBackend


class SegmentState:
    """One step's state between the sides: the pinned host copies, the device copies, which is current,
    and the moves between them (the host program's StepState on the host side)."""

    def __init__(self, backend: DeviceBackend, counters, rows, gpu_layers: int, rope, kernel_copy=None,
                 tree_fields=None, nodes=None):
        """kernel_copy(dst, src address, nbytes) -> a Launch copying by the SMs (mode offload: the copy engine
        is busy with the ring's weights, and a small upload queued behind them would wait for all of them);
        None: uploads are async copies.  tree_fields: the rows' token-tree masks (token_tree.step_tree_fields)
        or None: rows are at their slots' positions, or at slot - skip.  nodes: the native host nodes
        (run/host_nodes.HostNodes; None: numpy makes the host's xn)."""
        b = backend
        self.nodes = nodes
        # while a step graph is captured (run/mixed.py): moves are enqueued with no host wait, and host work
        # goes in as items handed over to the host library's thread (host_nodes.py), listed here in order
        self.graphing = False
        self.items: list = []
        self.links: list = []                         # the link shares captured, (spec, item, shares) (expert_link.py)
        self.deferred = None                          # a device experts op left for its host item's hand-off
        self.kernel_copy = kernel_copy
        self.backend, self.counters, self.stream, self.gpu_layers = b, counters, b.stream, gpu_layers
        self.dev, self.pinned, self.host, self.widths = b.arrays, b.pinned.buffers, b.pinned.views, b.pinned.widths
        self.T = len(rows)
        self.valid = {name: set() for name in self.widths}
        self.local: dict[str, np.ndarray] = {}       # host-only state of a host segment (q)
        self.xn_norm = None                           # the norm whose xn the device holds
        self.uploads_in_flight: set = set()
        self.call = None                              # KESTREL_PROF's stages of the current GPU segment
        self.ids = np.array([t for _, t, _ in rows], np.int64)
        positions = np.array([p for _, _, p in rows], np.int64)
        self.tree_fields = tree_fields
        if tree_fields is not None:
            positions = positions - tree_fields[0]
        # sessions as runs of consecutive rows: (kv, first row, last row + 1, start position)
        runs = []
        for i, (kv, _, pos) in enumerate(rows):
            if runs and runs[-1][0] is kv and runs[-1][2] == i:
                runs[-1][2] = i + 1
            else:
                runs.append([kv, i, i + 1, pos])
        self.runs = [tuple(run) for run in runs]
        self.cos, self.sin = rope(positions)
        self.lm_rows = None                           # the rows lm_head computes (None: every row of the chunk)
        # each logits row's token taken on the device: (kind, enqueue(rows, stream) of the kernels writing the
        # tokens into argmax_out, where their 4 bytes a row come back: device/step_io.TokenOutputs), kind "argmax"
        # or "sample"; None: the logits come back (outputs_to_host)
        self.pick = None
        self.picked = False                           # the tokens came back in place of the logits

    # ---- the host program's view (program.StepState) ------------------------------------------------
    def read(self, name: str) -> np.ndarray:
        return self.local[name] if name in self.local else self.host[name][:self.T]

    @property
    def logit_rows(self) -> int:
        """Rows of logits the step computes: lm_head's rows, packed from row 0."""
        return self.T if self.lm_rows is None else len(self.lm_rows)

    def write(self, name: str, value: np.ndarray) -> None:
        if name not in self.widths:
            self.local[name] = value
            return
        self._host_writes(name)
        self.host[name][:len(value)] = value

    def add(self, name: str, value: np.ndarray) -> None:
        self._host_writes(name)
        self.host[name][:self.T] += value

    def write_rows(self, name: str, lo: int, hi: int, value: np.ndarray, width: int) -> None:
        """A split group's host part: its rows beside the GPU part's (downloaded first when it ran)."""
        if self.valid[name] == {"dev"}:
            self.to_host([name])
            self.valid[name] = {"host"}
        else:
            self._host_writes(name)
        self.host[name][:self.T, lo:hi] = value

    def host_kv(self, kv) -> tuple:
        return kv.host, self.gpu_layers

    # ---- moving state between the sides -------------------------------------------------------------
    def to_host(self, names) -> None:
        """Download every named state the host reads that only the device has; one sync."""
        pending = [n for n in names if n in self.valid and self.valid[n] == {"dev"}]   # not made yet: skipped
        if not pending:
            return
        start = time.perf_counter()
        for name in pending:
            nbytes = (self.logit_rows if name == "logits" else self.T) * self.widths[name] * 4
            if nbytes:
                driver.d2h_async(self.pinned[name], self.dev[name].ptr, nbytes, self.stream)
            self.counters.d2h_bytes += nbytes
            self.valid[name].add("host")
        if self.graphing:
            self.uploads_in_flight.clear()
            return
        self.stream.synchronize()
        self.counters.syncs += 1
        self.uploads_in_flight.clear()
        if self.call is not None:
            self.call["d2h+sync"] = (time.perf_counter() - start) * 1e6
            self.finish_call()

    def outputs_to_host(self) -> None:
        """The step's outputs back: each logits row's token (its argmax or a draw), 4 bytes a row, where `pick`
        asks for it and the device alone holds the logits (lm_head ran there); else the logits rows.  One sync
        (none in a capture)."""
        if self.pick is None or self.valid["logits"] != {"dev"}:
            self.to_host(["logits"])
            return
        _, enqueue, tokens = self.pick
        enqueue(self.logit_rows, self.stream)
        driver.d2h_async(tokens.host_tokens, tokens.argmax_out.ptr, 4 * self.logit_rows, self.stream)
        self.counters.d2h_bytes += 4 * self.logit_rows
        self.picked = True
        if not self.graphing:
            self.stream.synchronize()
            self.counters.syncs += 1

    def _h2d(self, dst: int, src_address: int, src, nbytes: int) -> None:
        if self.kernel_copy is None:
            driver.h2d_async(dst, src, nbytes, self.stream)
        else:
            self.kernel_copy(dst, src_address, nbytes).enqueue(self.stream)

    def to_device(self, name: str) -> None:
        if "dev" not in self.valid[name]:
            nbytes = self.T * self.widths[name] * 4
            self._h2d(self.dev[name].ptr, self.pinned[name].address, self.pinned[name], nbytes)
            self.counters.h2d_bytes += nbytes
            self.valid[name].add("dev")
            self.uploads_in_flight.add(name)

    def xn_to_device(self, norm: np.ndarray, eps: float) -> None:
        """Make the device's xn / 1/rms those of `norm` over x, computing them on the host if x was written there."""
        if self.xn_norm is norm:
            return
        T, pinned = self.T, self.backend.pinned
        self.to_host(["x"])
        self._wait_upload("xn")
        if self.nodes is not None:        # the library's: the same numbers eagerly and as a graph's node
            node = self.nodes.norm(norm, eps, T)
            if self.graphing:
                self.nodes.hand_over(self.stream, self.items, ITEM_NORM, node)
            else:
                self.nodes.run_norm(node)
        else:
            x = self.host["x"][:T]
            pinned.xn[:T] = x * norm
            pinned.inv_rms[:T] = 1.0 / np.sqrt(np.mean(np.square(x), axis=-1) + np.float32(eps))
        self.xn_made(norm)

    def norm_item(self, norm: np.ndarray, eps: float) -> tuple:
        """Inside a capture: the item making xn / 1/rms of `norm` from the pinned x, for a host item to take
        along (HostNodes.hand_over's `then`); xn_made(norm) after that hand-off uploads them."""
        return ITEM_NORM, self.nodes.norm(norm, eps, self.T)

    def xn_made(self, norm: np.ndarray) -> None:
        """The host made xn / 1/rms of `norm` in their pinned copies (or an item handed over will have): up to
        the device."""
        T, pinned = self.T, self.backend.pinned
        hidden = self.widths["x"]
        self._h2d(self.dev["xn"].ptr, pinned.xn.ctypes.data, pinned.xn, T * hidden * 4)
        self._h2d(self.dev["inv_rms"].ptr, pinned.inv_rms.ctypes.data, pinned.inv_rms, T * 4)
        self.counters.h2d_bytes += T * (hidden + 1) * 4
        self.uploads_in_flight.add("xn")
        self.xn_norm = norm

    def device_wrote(self, op, prepared_norm) -> None:
        for name in op.writes:
            if name in self.widths:
                self.valid[name] = {"dev"}
        if prepared_norm is not None:             # o / down's epilogue: xn and 1/rms of the next norm
            self.xn_norm = prepared_norm

    def host_wrote(self, name: str) -> None:
        """A host item wrote `name`'s pinned copy (in the graph's order, after the uploads before it)."""
        self._host_writes(name)

    def _wait_upload(self, name: str) -> None:
        """Before the host overwrites `name`'s pinned copy: wait for an async upload still reading it."""
        if name in self.uploads_in_flight and not self.graphing:
            self.stream.synchronize()
            self.counters.syncs += 1
            self.uploads_in_flight.clear()

    def _host_writes(self, name: str) -> None:
        self._wait_upload(name)
        self.valid[name] = {"host"}
        if name == "x":
            self.xn_norm = None

    def finish_call(self) -> None:
        call, self.call = self.call, None
        if prof.enabled:
            uploads = call.pop("uploads", 0)
            prof.record_call(call, uploads=uploads)


def uploads_go_first(ops, prepared, state: "SegmentState") -> bool:
    """Whether every upload of a device segment can go before all its launches: no op takes its norm input
    (xn) from the host after an earlier op of the segment wrote x on the device (the host would need that x
    back midway).  Follows SegmentState's record of the copies without touching it."""
    x_on_host = "host" in state.valid.get("x", ())
    xn_norm = state.xn_norm
    for op, (reads, prologue, _, _, _, prepares) in zip(ops, prepared):
        if "xn" in reads and xn_norm is not prologue:
            if not x_on_host:
                return False
            xn_norm = prologue
        if "x" in op.writes:
            x_on_host = False
        if prepares is not None:
            xn_norm = prepares
    return True
