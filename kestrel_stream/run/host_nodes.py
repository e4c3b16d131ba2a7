"""A mixed step's host work inside its graph: each host segment's op list, and each norm input a device op
reads where the host wrote x, as items the host library's own thread serves (native/host_serve.c) when the
graph hands them over by two pinned words, with the arguments they read kept alive here.

run/mixed.py captures a step whose host segments all bind to op lists over the pinned state
(NativeProgram.node) into one graph from its first device segment on.  At each host item the graph writes
the item's number into `arrived` once its copies have brought what the item reads to the host
(driver.write_value) and waits until `done` holds it (driver.wait_value) before the copies that take the
results back; the library's thread spins on `arrived`, runs the item, writes `done`.  A hand-off costs both
sides a few microseconds of polling pinned memory, where a host sync and Python's turn around each segment
cost tens (as does a host function node, CUDA's own thread woken per node: measured slower than the
segment-by-segment step on the H200).  The host waits once, for the whole step, on a blocking event: its
thread sleeps while the library's thread and pool have the cores.  The norm item runs eagerly too, so a
step's numbers are the same either way.
"""
from __future__ import annotations

import ctypes

import numpy as np

_i, _f, _p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
ITEM_PROGRAM, ITEM_NORM = 0, 1          # host_serve.c's item kinds


class ProgramNode(ctypes.Structure):
    """ks_program_node's argument: an op list, the step it runs over, the first failure (0: none)."""
    _fields_ = [("ops", _p), ("n_ops", _i), ("step", _p), ("status", _i)]


class NormNode(ctypes.Structure):
    """ks_norm_node's: xn [T, H] = x * w and inv_rms [T] = 1/rms of x's rows."""
    _fields_ = [("x", _p), ("w", _p), ("xn", _p), ("inv_rms", _p), ("T", _i), ("H", _i), ("eps", _f)]


class Item(ctypes.Structure):
    _fields_ = [("kind", _i), ("arg", _p)]


class ItemList(ctypes.Structure):
    """ks_host_list_t: the two words, the items in the graph's order, a link share's ready word."""
    _fields_ = [("arrived", _p), ("done", _p), ("items", _p), ("n", _i), ("link_ready", _p)]


class HostNodes:
    """The library's host items over one device backend's pinned state (PinnedState), and the words a step
    graph hands them over by."""

    def __init__(self, kernels, pinned):
        from kestrel_stream.cuda import driver          # (the structs above serve the CPU engine too: no CUDA there)
        self.driver = driver
        self.kernels, self.pinned = kernels, pinned
        self._norms: dict = {}           # (id(norm), T) -> (its NormNode, the norm and the copy it keeps alive)
        self.handoffs = 0                # hand-offs captured so far (each one word down, one back)
        # arrived, done, and a link share's ready, done (uint32 each; expert_link.py); not allocatable in a capture
        self._words = driver.PinnedBuffer(64)
        self._words.view(np.uint32, (4,))[:] = 0
        self.words = [self._words.address + 4 * i for i in range(4)]
        self._device_words = [driver.host_word(address) for address in self.words]

    def norm(self, norm: np.ndarray, eps: float, tokens: int) -> NormNode:
        """The item making the device's xn / 1/rms of `norm` from the pinned x of a `tokens`-token step."""
        key = (id(norm), tokens)
        made = self._norms.get(key)
        if made is None:
            w = np.ascontiguousarray(norm, np.float32)
            node = NormNode(x=self.pinned.buffers["x"].address, w=w.ctypes.data, xn=self.pinned.xn.ctypes.data,
                            inv_rms=self.pinned.inv_rms.ctypes.data, T=tokens, H=w.size, eps=eps)
            made = self._norms[key] = (node, norm, w)
        return made[0]

    def run_norm(self, node: NormNode) -> None:
        self.kernels.norm_call(ctypes.byref(node))

    # ---- inside a capture: the graph's side of each hand-off ----------------------------------------
    def hand_over(self, stream, items: list, kind: int, node, meanwhile=None, then: tuple = ()) -> None:
        """The next item of a captured step: the device writes its number once what it reads is on the host
        (the copies enqueued before), and waits for the host's before anything after; meanwhile(n): what the
        device does in between (a link share, expert_link.py), n the item's number.  then: (kind, node) items
        the host runs right after it in the same hand-off (the library's thread serves every item up to the
        number the device wrote)."""
        items.append((kind, node))
        number = len(items)
        items.extend(then)
        self.driver.write_value(stream, self._device_words[0], len(items))
        if meanwhile is not None:
            meanwhile(number)
        self.driver.wait_value(stream, self._device_words[1], len(items))
        self.handoffs += 1

    @property
    def link_words(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """A link share's ready and done words: (host addresses, device addresses)."""
        return (self.words[2], self.words[3]), (self._device_words[2], self._device_words[3])

    def item_list(self, items: list) -> tuple:
        """The list the library's thread serves for a step graph's items (and what it points at)."""
        table = (Item * len(items))(*[Item(kind, ctypes.addressof(node)) for kind, node in items])
        held = ItemList(arrived=self.words[0], done=self.words[1], items=ctypes.addressof(table), n=len(items),
                        link_ready=self.words[2])
        return held, table, items

    # ---- each replay: the host's side -----------------------------------------------------------------
    def begin(self, made: tuple) -> None:
        """Before the graph's launch: the words back to 0 and the list to the library's thread."""
        self._words.view(np.uint32, (4,))[:] = 0
        if self.kernels.serve_begin(ctypes.byref(made[0])) != 0:
            raise OSError("host library: no thread to serve a step graph's host items")

    def end(self, aborted: bool = False) -> int:
        """After the step's wait (or its failure: the thread stops waiting): 0, or -(the item whose word
        never came)."""
        if aborted:
            self.kernels.serve_abort()
        return self.kernels.serve_end()

    def close(self) -> None:
        if self._words is not None:
            self._words.free()
            self._words = None
