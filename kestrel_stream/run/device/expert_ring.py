"""Mode offload's experts' ring: a routed layer homed experts (scheduler/offload.py) has its every expert
copied from a pinned image into a ring slot of the expert pool before its router and experts run on the GPU.

The images: per routed layer that may stream (homed attention at one token), its E experts in the pool's
layout (expert_pool.py: gate_up qs, gate_up meta, down qs, down meta, E strides each), so a layer goes up
as four copies into ring slot r's four regions (ExpertStore.ring_regions).  Ring slot r's slot table maps
expert e to pool slot first + r E + e, so the route, experts and combine launches of a streamed layer read
that table and need no routing knowledge on the host.

The protocol is the window ring's (stream_ring.py), on a copy stream of its own, over the plan's
streamed experts ops in step order:

    begin:  copies 0 .. S-1 on the copy stream (after `fork`: nothing of an earlier step reads a slot)
    before item p (compute stream):  wait loaded[p % S]
    after item p:  record released[p % S]; copy p + S waits for it, then goes out

so while layer p computes, layer p + 1's experts cross PCIe; no host thread waits for a copy.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from kestrel_stream.cuda import driver
from kestrel_stream.run.device.expert_store import write_expert


def layer_of(name: str) -> int:
    """"L7.experts" -> 7."""
    return int(name[1:].split(".", 1)[0])


class ExpertRing:
    def __init__(self, store, weights, layers=None, pages: str = "pinned"):
        """store: the ExpertStore with ring_slots; layers: the routed layers that may stream (default all).
        Pinning an image can fail (the driver's CudaError): the images pinned before it are freed, the error
        goes to the caller (the executor's, which names the bytes)."""
        self.store, self.slot_count = store, store.ring_slots
        assert self.slot_count >= 1, "an experts' ring needs slots in the expert pool"
        self.images = layer_images(store, weights, store.layers if layers is None else layers, pages=pages)
        self.copy_stream = driver.Stream("experts copy h2d")
        self.loaded = [driver.Event(name=f"experts slot {s} loaded") for s in range(self.slot_count)]
        self.released = [driver.Event(name=f"experts slot {s} released") for s in range(self.slot_count)]
        self.fork = driver.Event(name="experts ring fork")
        self.order: dict[str, int] = {}
        self.names: list[str] = []
        self.issued = 0
        self.bytes_per_step = 0

    @property
    def image_bytes(self) -> int:
        return sum(buffer.nbytes for buffer, _ in self.images.values())

    def streams(self, name: str) -> bool:
        return name in self.order

    def slot(self, layer: int) -> int:
        """The ring slot of a layer's experts in this step's order."""
        return self.order[f"L{layer}.experts"] % self.slot_count

    def begin(self, names: list[str], stream: driver.Stream) -> None:
        """A step streaming the experts ops `names` in this order: the first S layers' copies go out now."""
        unknown = [n for n in names if layer_of(n) not in self.images]
        assert not unknown, f"no pinned image of the experts of {unknown[:3]}"
        self.names, self.order = list(names), {n: p for p, n in enumerate(names)}
        self.issued = self.bytes_per_step = 0
        if not names:
            return
        self.fork.record(stream)
        self.copy_stream.wait(self.fork)
        while self.issued < min(self.slot_count, len(self.names)):
            self._issue(self.issued)

    def before(self, name: str, stream: driver.Stream) -> None:
        stream.wait(self.loaded[self.order[name] % self.slot_count])

    def after(self, name: str, stream: driver.Stream) -> None:
        p = self.order[name]
        self.released[p % self.slot_count].record(stream)
        if p + self.slot_count < len(self.names):
            assert self.issued == p + self.slot_count, (self.issued, p)
            self._issue(p + self.slot_count)

    def _issue(self, p: int) -> None:
        S, layer = self.slot_count, layer_of(self.names[p])
        if p >= S:
            self.copy_stream.wait(self.released[p % S])
        buffer, parts = self.images[layer]
        for (dst, nbytes), (offset, size) in zip(self.store.ring_regions(p % S), parts):
            assert nbytes == size, (nbytes, size)
            driver.h2d_async(dst, buffer.view(np.uint8, (size,), offset), size, self.copy_stream,
                             op="experts", layer=layer)
            self.bytes_per_step += size
        self.loaded[p % S].record(self.copy_stream)
        self.issued = p + 1

    def close(self) -> None:
        self.copy_stream.synchronize()
        self._free_images()

    def _free_images(self) -> None:
        for buffer, _ in self.images.values():
            buffer.free()
        self.images = {}


IMAGE_THREADS = 8          # threads filling pinned images (numpy's copies release the GIL; memory-bound beyond)


def layer_images(store, weights, layers, threads: int | None = None,
                 pages: str = "pinned") -> dict[int, tuple[driver.PinnedBuffer, list]]:
    """Each routed layer's every expert in the expert pool's layout (expert_pool.py), pinned: its buffer and
    four regions' (offset, bytes): gate_up qs, gate_up meta, down qs, down meta, E slots each.  The buffers
    are pinned here one after another (the calling thread has the context) while `threads` threads fill those
    pinned so far (default: min(IMAGE_THREADS, the cores)).  pages "registered" (KESTREL_EXPERT_IMAGES): each
    buffer an anonymous mapping on huge pages, filled first and then pinned (driver.RegisteredBuffer), where
    cuMemHostAlloc's pages are pinned (and small) before the fill.  A failure frees every buffer and raises the
    first error."""
    E = store.config.num_experts
    parts = [(store.gate_up, True), (store.down, False)]
    sizes = [E * n for part, _ in parts for n in (part.qs_slot, part.meta_slot)]
    offsets = np.cumsum([0] + sizes).tolist()
    regions = list(zip(offsets[:-1], sizes))

    def fill(layer: int, buffer: driver.PinnedBuffer) -> None:
        moe = weights.layers[layer].moe
        for k, ((part, interleave), w, rows) in enumerate(zip(parts, (moe.gate_up, moe.down),
                                                               (moe.gate_up_rows, moe.down_rows))):
            qs = buffer.view(np.uint8, (E, part.qs_slot), offsets[2 * k])
            meta = buffer.view(np.uint8, (E, part.meta_slot), offsets[2 * k + 1])
            for e in range(E):
                write_expert(qs[e], meta[e], w, *rows(e), interleave)

    layers = list(layers)
    threads = threads or min(IMAGE_THREADS, os.cpu_count() or 1, max(1, len(layers)))
    images: dict[int, tuple[driver.PinnedBuffer, list]] = {}
    with ThreadPoolExecutor(threads, thread_name_prefix="expert-images") as pool:
        filled = []
        try:
            for layer in layers:
                buffer = (driver.RegisteredBuffer if pages == "registered" else driver.PinnedBuffer)(offsets[-1])
                images[layer] = buffer, list(regions)
                filled.append(pool.submit(fill, layer, buffer))
            for job, (buffer, _) in zip(filled, images.values()):
                job.result()
                if pages == "registered":
                    buffer.pin()
        except BaseException:
            for job in filled:
                job.cancel()
            wait(filled)
            for buffer, _ in images.values():
                buffer.free()
            raise
    return images


def host_expert_images(store, weights, images: dict) -> dict:
    """layer -> e -> expert e of the layer's image as the host kernels read it in place, for the layers whose
    experts are Q8_0 (gate|up and down): ((gate qs, scales), (up qs, scales)) -- [I, H] int8 and [I, H/32]
    float16, rows two apart (the pool interleaves them) -- and (down qs, scales) [H, I], [H, I/32].  The host
    then keeps no split copy of those experts of its own."""
    def parts(layer: int, e: int):
        buffer, ((gq, _), (gm, _), (dq, _), (dm, _)) = images[layer]
        moe = weights.layers[layer].moe
        (lo, hi), (d_lo, d_hi) = moe.gate_up_rows(e), moe.down_rows(e)
        rows, H, I = hi - lo, moe.gate_up.shape[1], moe.down.shape[1]
        assert rows % 2 == 0 and d_hi - d_lo == H
        qs = buffer.view(np.int8, (rows, H), gq + e * store.gate_up.qs_slot)
        scales = buffer.view(np.float16, (rows, H // 32), gm + e * store.gate_up.meta_slot)
        down = (buffer.view(np.int8, (H, I), dq + e * store.down.qs_slot),
                buffer.view(np.float16, (H, I // 32), dm + e * store.down.meta_slot))
        return ((qs[0::2], scales[0::2]), (qs[1::2], scales[1::2])), down
    return {layer: (lambda e, layer=layer: parts(layer, e)) for layer in images
            if store.formats[layer] == ("Q8_0", "Q8_0")}
