"""Mode offload's streaming: the items a step's plan streams, through the window's ring, in the plan's order.

The window (weight_window.py) holds the pinned images of every item the offload placement may stream and a
ring of S slots; which of them a step streams depends on its size (scheduler/offload.py moves layers between
the host and the ring as steps grow), so here the slot of an item is its position in the step's order, not
in the window's list:

    begin:  copies 0 .. S-1 on the copy stream (the slots are free: the previous step's host sync came
            after its last reader)
    before item p (compute stream):  wait loaded[p % S]
    after item p:  record released[p % S]; copy p + S waits for it, then goes out

With S slots every copy runs up to S-1 items ahead of the GPU, so while the host computes its layers the
copy engine fills the slots of the streamed layers after them.  Each wait sees the record it means: when
compute waits for item p, copies up to p + S - 1 are issued, and the slot's next copy is p + S; when copy
p + S is issued, item p's release was just recorded and no later reader of that slot is enqueued.  No
host thread waits for a copy: the compute stream does.

The launches of an item read its slot's address (qweight), so they are built per step size (mixed.py
keys its launches by op and token count).
"""
from __future__ import annotations

from kestrel_stream.cuda import driver
from kestrel_stream.cuda.kernels import QWeight
from kestrel_stream.run.device.block_weights import device_qweight
from kestrel_stream.run.device.weight_window import WeightWindow, weight_tensors


class StreamRing:
    def __init__(self, window: WeightWindow, weights):
        self.window = window
        self.slot_count = window.slot_count
        self.index = {name: k for k, name in enumerate(window.streamed)}     # the window's pinned images
        self.tensors = weight_tensors(weights)
        self.order: dict[str, int] = {}
        self.issued = 0
        self.names: list[str] = []
        self.bytes_per_step = 0

    def streams(self, name: str) -> bool:
        return name in self.order

    def qweight(self, name: str, position: int) -> QWeight:
        """Item `name`'s device weight when it is the step's `position`-th streamed item."""
        w = self.window
        return device_qweight(w.ring_base + (position % self.slot_count) * w.slot_stride, self.tensors[name][0])

    def begin(self, names: list[str], stream: driver.Stream) -> None:
        """A step streaming `names` in this order: the first S copies go out now."""
        unknown = [n for n in names if n not in self.index]
        assert not unknown, f"not in the window's streamed images: {unknown[:3]}"
        self.names, self.order, self.issued = list(names), {n: p for p, n in enumerate(names)}, 0
        self.bytes_per_step = 0
        if not self.names:           # nothing to stream (in a capture, a copy stream it joined must end joined)
            return
        copy = self.window.copy_stream
        self.window.fork.record(stream)          # nothing of an earlier step still reads a slot
        copy.wait(self.window.fork)
        while self.issued < min(self.slot_count, len(self.names)):
            self._issue(self.issued)

    def begin_step(self, plan, stream: driver.Stream) -> None:
        """A step of `plan`: the items its device segments stream, in their order (begin)."""
        self.begin([op.name for segment in plan.segments if segment.side == "gpu" for op in segment.ops
                    if op.name in self.index], stream)

    def before(self, name: str, stream: driver.Stream) -> None:
        stream.wait(self.window.loaded[self.order[name] % self.slot_count])

    def after(self, name: str, stream: driver.Stream) -> None:
        p = self.order[name]
        self.window.released[p % self.slot_count].record(stream)
        if p + self.slot_count < len(self.names):
            assert self.issued == p + self.slot_count, (self.issued, p)
            self._issue(p + self.slot_count)

    def _issue(self, p: int) -> None:
        w, S = self.window, self.slot_count
        if p >= S:
            w.copy_stream.wait(w.released[p % S])
        host_image, nbytes = w.copies[self.index[self.names[p]]]
        driver.h2d_async(w.ring_base + (p % S) * w.slot_stride, host_image, nbytes, w.copy_stream)
        w.loaded[p % S].record(w.copy_stream)
        self.bytes_per_step += nbytes
        self.issued = p + 1
