"""A device layer for WeightWindow that runs nothing: it records every copy, kernel, event record and stream
wait as a node of a happens-before graph, and checks the ring's slots for races over every interleaving.

Semantics follow CUDA's: ops on one stream run in order; a wait orders the waiting stream after the
event's latest record at the time of the wait call (a wait on a never-recorded event is a no-op).  A
capture (`capture(stream)`) records instead of enqueueing; a captured stream may wait only on records of
the same capture.  A graph launch on a stream adds the captured ops as new nodes: the capturing stream's
after the stream's earlier work, every other captured stream's on a lane of its own, reached only through
its waits (the fork), and the whole replay must be joined into the capturing stream's last op.

check_slots then asks, for every kernel reading a ring slot, that every copy into that slot is ordered
with the read (before or after it in every interleaving) and that the latest copy ordered before the
read wrote the weight the kernel expects.
"""
from __future__ import annotations

import types
from contextlib import contextmanager

import numpy as np


class OrderLog:
    def __init__(self, size: int = 64 << 20):
        self.nodes: list[dict] = []          # creation order; every edge points back
        self.ancestors: list[int] = []       # bitmask of the nodes each node is ordered after
        self.last: dict = {}                 # lane -> its last node
        self.capture: list | None = None     # (stream, kind, payload) while a capture records
        self.replays = 0
        self.base, self.top, self.size = 1 << 32, 0, size

    # ---- nodes ----------------------------------------------------------------------------------------
    def add(self, lane, kind: str, after: tuple = (), **info) -> int:
        preds = [p for p in (self.last.get(lane), *after) if p is not None]
        mask = 0
        for p in preds:
            mask |= self.ancestors[p] | (1 << p)
        self.nodes.append(dict(lane=lane, kind=kind, preds=preds, **info))
        self.ancestors.append(mask)
        self.last[lane] = len(self.nodes) - 1
        return self.last[lane]

    def before(self, a: int, b: int) -> bool:
        """a happens before b in every interleaving."""
        return bool(self.ancestors[b] >> a & 1)

    def enqueue(self, stream, kind: str, **info) -> None:
        if stream.capturing:
            self.capture.append((stream, kind, info))
        else:
            self.add(stream, kind, **info)

    # ---- the device layer WeightWindow uses (window.driver) -----------------------------------------
    def module(self):
        log = self

        class Stream:
            def __init__(self, name=None):
                self.name, self.capturing = name or "stream", False

            def wait(self, event):
                if event.latest is None:
                    return
                where, index = event.latest
                if self.capturing:
                    assert where == "capture", \
                        f"{self.name}: a captured stream waits on {event.name} recorded outside the capture"
                    log.capture.append((self, "wait", dict(on=index, event=event.name)))
                else:
                    assert where == "node", f"{self.name}: waits on {event.name}, last recorded inside a capture"
                    log.add(self, "wait", after=(index,), event=event.name)

            def synchronize(self):
                pass

        class Event:
            def __init__(self, timing=False, name="event"):
                self.name, self.latest = name, None

            def record(self, stream):
                if stream.capturing:
                    log.capture.append((stream, "record", dict(event=self.name)))
                    self.latest = ("capture", len(log.capture) - 1)
                else:
                    self.latest = ("node", log.add(stream, "record", event=self.name))

            def elapsed_ms(self, since):
                assert self.latest is not None and since.latest is not None, "elapsed time of an unrecorded event"
                return 0.0

            def synchronize(self):
                pass

            def destroy(self):
                pass

        class PinnedBuffer:
            def __init__(self, nbytes):
                self.nbytes = nbytes
                self.bytes = np.zeros(max(nbytes, 1), np.uint8)
                self.address = self.bytes.ctypes.data

            def free(self):
                pass

        def h2d_async(dst, src, nbytes, stream, **labels):
            address = src.address if isinstance(src, PinnedBuffer) else src.ctypes.data
            log.enqueue(stream, "copy", dst=dst, src=address, nbytes=nbytes)

        return types.SimpleNamespace(Stream=Stream, Event=Event, PinnedBuffer=PinnedBuffer, h2d_async=h2d_async)

    def alloc(self, nbytes: int) -> int:
        address = self.base + self.top
        self.top += -(-max(nbytes, 1) // 256) * 256
        assert self.top <= self.size
        return address

    # ---- capture and replay ---------------------------------------------------------------------------
    @contextmanager
    def capturing(self, stream):
        assert self.capture is None, "nested capture"
        self.capture, stream.capturing = [], True
        holder = types.SimpleNamespace(graph=None)
        try:
            yield holder
            holder.graph = (stream, self.capture)
        finally:
            self.capture, stream.capturing = None, False

    def launch(self, graph, stream) -> None:
        """One replay of a captured graph on `stream`."""
        origin, recorded = graph
        assert stream is origin
        self.replays += 1
        first = len(self.nodes)
        node_of: dict[int, int] = {}
        for i, (s, kind, info) in enumerate(recorded):
            lane = stream if s is origin else (f"replay {self.replays}", s.name)
            if s is not origin and lane not in self.last:
                assert kind == "wait", f"{s.name} enqueued {kind} into the capture before joining it"
            after = (node_of[info["on"]],) if kind == "wait" else ()
            node_of[i] = self.add(lane, kind, after=after, **{k: v for k, v in info.items() if k != "on"})
        end = self.last[stream]
        for n in range(first, len(self.nodes)):
            assert n == end or self.before(n, end), \
                f"replay {self.replays}: {self.nodes[n]} is not joined into the graph's end"

    # ---- kernels ----------------------------------------------------------------------------------------
    def kernel(self, stream, reads: int, weight: str | None) -> None:
        self.enqueue(stream, "kernel", reads=reads, weight=weight)

    # ---- the check ------------------------------------------------------------------------------------
    def check_slots(self, window) -> int:
        """Assert every read of a ring slot sees its own weight in every interleaving; returns the reads checked."""
        S, stride, base = window.slot_count, window.slot_stride, window.ring_base
        item_at = {view.ctypes.data: name for (view, _), name in zip(window.copies, window.streamed)}
        slot_of = lambda address: (address - base) // stride if base <= address < base + S * stride else None
        writes = {s: [] for s in range(S)}
        for i, node in enumerate(self.nodes):
            if node["kind"] == "copy" and slot_of(node["dst"]) is not None:     # else the preload's
                writes[slot_of(node["dst"])].append(i)
        reads = 0
        for i, node in enumerate(self.nodes):
            slot = slot_of(node["reads"]) if node["kind"] == "kernel" else None
            if slot is None:
                continue
            for w in writes[slot]:
                assert self.before(w, i) or self.before(i, w), \
                    f"copy of {item_at[self.nodes[w]['src']]} into slot {slot} races the read of {node['weight']}"
            landed = [w for w in writes[slot] if self.before(w, i)]
            assert landed, f"{node['weight']} read slot {slot} before any copy into it"
            latest = [w for w in landed if all(v == w or self.before(v, w) for v in landed)]
            assert len(latest) == 1, f"copies into slot {slot} are not ordered"
            assert item_at[self.nodes[latest[0]]["src"]] == node["weight"], \
                f"{node['weight']} read slot {slot} holding {item_at[self.nodes[latest[0]]['src']]}"
            reads += 1
        return reads

    def count(self, kind: str, lane=None) -> int:
        """The nodes of `kind` (on `lane` only, when given)."""
        return sum(node["kind"] == kind and (lane is None or node["lane"] is lane) for node in self.nodes)


class Launch:
    """A kernel reading one weight (or none): what the window needs of a launch list's entry."""

    def __init__(self, log: OrderLog, qweight, weight: str | None):
        self.log, self.weight = log, weight
        self.name = f"reads {weight}"
        self.labels = {"weight": weight} if weight else {}
        self.storage = np.array([qweight.qs if qweight is not None else 0], np.uint64)

    def enqueue(self, stream) -> None:
        self.log.kernel(stream, int(self.storage[0]), self.weight)
