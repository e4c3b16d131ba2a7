"""Mode offload's link share of a routed layer's host experts: inside a step graph with host items
(run/host_nodes.py) of up to LINK_MAX_TOKENS tokens, some of the experts the host would compute go to the
device, which reads them straight from pinned images over PCIe (zero-copy) while the host's cores compute
the others.  At one token: the last `count` of the token's host-side choices; at T tokens: count / k of the
experts the host would compute, the most used first (each read once serves all its tokens, which is what
makes a share of several sessions' step worth more than one token's).  Both draw on the host memory pool,
where the cores alone leave the link idle (scheduler/offload.py's roofline: cores and DMA together carry up
to ~1.5x what the cores carry alone).

The host decides the share when its item starts (native/host_moe.c: share_link writes the grouping, slot
table and the step's route rows into pinned memory, then the `ready` word); the graph, at that layer's item,
waits for `ready`, copies them to the device (one copy; the route rows are the host item's own: where the
router ran on the host, the device's are stale), runs the expert GEMVs over the layer's image and moe_combine
into each token's sum of their weighted rows, written straight into pinned memory, then writes `done` (its
fence makes the sums visible first); the host adds them to its own before its item ends.  Eager steps (the
first of a size, a trace) leave the share unarmed: the host computes every choice.  Steps whose expert
kernels would be the grouped GEMM (many tokens an expert) do not share (ExpertLink.takes).  The same hand-off
carries the layer's resident experts (run/item_graphs.py: defer): captured after the item's word instead of
before it, they run on the device while the host computes its own, their sum copied down before `done`.

Per layer: its image (expert_ring.layer_images) and its LinkSpec (its item number).  Shared by every layer
(one hand-off at a time): the pinned grouping, table, route rows and sums, the device copy of the first three.
Beside an experts' ring the images are the ring's (the same layout), made only for layers it has none of.
"""
from __future__ import annotations

import sys

import numpy as np

from kestrel_stream.cuda import driver
from kestrel_stream.cuda.moe_kernels import PoolPart, combine_launch, experts_kernel, experts_launch, group_ints
from kestrel_stream.native.routed import LinkSpec
from kestrel_stream.run.device.expert_ring import layer_images
from scheduler.link_tuner import LinkTuner

LINK_MAX_TOKENS = 16           # steps up to this many tokens share (decode, a few sessions together)


class ExpertLink:
    def __init__(self, store, weights, count: int | str, layers, pages: str = "pinned", shared: dict | None = None):
        """store: the ExpertStore (its pool layout, formats); count: choices a token the device reads over the
        link, "auto" (scheduler/link_tuner.py: measured while serving), or "defer" (no expert over the link,
        no images: the hand-off alone, for the resident experts' deferral); layers: the routed layers whose
        host experts share (every one with host experts); pages: the images' (expert_ring.layer_images);
        shared: images already pinned in the same layout (the experts' ring's), read rather than made again
        and left to their owner to free."""
        c = store.config
        E, k, H = c.num_experts, c.num_experts_per_tok, c.hidden_size
        self.tuners = {1: LinkTuner(max(1, k // 2))} if count == "auto" else {}     # step size -> its tuner
        self.store, self.fixed, self.config = store, int(count) if str(count).isdigit() else 0, c
        self.layers = set(layers)
        self.images, self.parts, shared = {}, {}, shared or {}
        self.shared = {layer: shared[layer] for layer in layers if layer in shared} if count != "defer" else {}
        try:
            self.images = layer_images(store, weights, [layer for layer in layers if layer not in self.shared]
                                       if count != "defer" else (), pages=pages)
            for layer, (buffer, regions) in {**self.shared, **self.images}.items():
                base = driver.host_word(buffer.address)          # the device's address of the mapped image
                (gq, _), (gm, _), (dq, _), (dm, _) = regions
                self.parts[layer] = (PoolPart(base + gq, base + gm, store.gate_up.qs_slot, store.gate_up.meta_slot),
                                     PoolPart(base + dq, base + dm, store.down.qs_slot, store.down.meta_slot))
        except BaseException:
            self.close()
            raise
        T = self.max_tokens = LINK_MAX_TOKENS
        self.group_bytes, self.table_bytes = 4 * group_ints(E, T, k), 4 * E
        self.copy_bytes = self.group_bytes + self.table_bytes + 4 * 2 * k * T     # grouping, table, route rows
        self.pinned = driver.PinnedBuffer(self.copy_bytes + 4 * H * T)
        self.pinned.view(np.int32, (E,), self.group_bytes)[:] = -1
        self.scratch = np.zeros(2 * E, np.int32)          # share_link's counts (host memory, not pinned)
        self._takes: dict = {}
        # the grouping, table and route rows copied in one piece (adjacent here as in the pinned buffer); the
        # sum written by moe_combine straight into the pinned buffer (mapped), where the host reads it
        self.memory = driver.Arena(self.copy_bytes + 1024)
        self.groups = self.memory.alloc(self.copy_bytes)
        self.table = self.groups + self.group_bytes
        self.route = self.table + self.table_bytes
        self.out = driver.host_word(self.pinned.address + self.copy_bytes)
        self.specs: dict[int, LinkSpec] = {}
        lay = store.layout
        self.expert_bytes = lay.gate_up_qs + lay.gate_up_meta + lay.down_qs + lay.down_meta

    @property
    def tuner(self) -> LinkTuner | None:
        """The one-token steps' tuner (auto), or None."""
        return self.tuners.get(1)

    @property
    def count(self) -> int:
        """The choices a token the next one-token replay gives the device."""
        return self.count_at(1)

    def count_at(self, tokens: int) -> int:
        """The count a replay of `tokens` tokens gives the device (above one: a share, count / k)."""
        if not self.tuners:
            return self.fixed
        if tokens not in self.tuners:
            k = self.config.num_experts_per_tok
            self.tuners[tokens] = LinkTuner(max(1, k - 1), steps=self.tuner.steps, tokens=tokens, chosen=k)
        return self.tuners[tokens].count

    def arm(self, specs, tokens: int) -> None:
        """Before a replay of `tokens` tokens: its layers' specs (spec, item, whether it shares) armed at that
        size's count (0 where the step does not share: the hand-off only), timings cleared."""
        count = self.count_at(tokens)
        for spec, item, shares in specs:
            spec.armed, spec.shared, spec.item, spec.calls, spec.ns = 1, 0, item, 0, 0
            spec.count = count if shares else 0

    def disarm(self, specs, tokens: int) -> None:
        """After a replay (or its failure): its specs unarmed; the size's tuner measures what its calls took."""
        for spec, _, _ in specs:
            spec.armed = 0
        tuner = self.tuners.get(tokens)
        if tuner is not None and all(shares for _, _, shares in specs):
            settled = tuner.settled
            tuner.observe(sum(spec.calls for spec, _, _ in specs), sum(spec.ns for spec, _, _ in specs))
            if tuner.settled and not settled and tuner.changed:      # a retune that keeps the count says nothing
                print(f"kestrel-stream: {tuner.describe()}", file=sys.stderr)

    @property
    def image_bytes(self) -> int:
        """The bytes of the images it made (not those it shares)."""
        return sum(buffer.nbytes for buffer, _ in self.images.values())

    @property
    def all_images(self) -> dict:
        """Every image it reads: those it made and those it shares."""
        return {**self.shared, **self.images}

    def takes(self, kernels, layer: int, tokens: int) -> bool:
        """Whether a step of `tokens` tokens shares the layer's experts: at most max_tokens, and its expert
        kernels the GEMVs (which read each expert once per 8 tokens; the grouped GEMM is left to VRAM)."""
        if layer not in self.parts:          # "defer": no images
            return False
        key = (self.store.formats[layer], tokens)
        if key not in self._takes:
            c = self.config
            shape = dict(experts=c.num_experts, chosen=c.num_experts_per_tok, tokens=tokens)
            self._takes[key] = tokens <= self.max_tokens and not any(
                experts_kernel(kernels, fmt, **shape).startswith("moe_mma_") for fmt in key[0])
        return self._takes[key]

    def spec(self, layer: int, ready: int, done: int) -> LinkSpec:
        """The layer's ks_link_t (host addresses of the words `ready` and `done`), made once."""
        if layer not in self.specs:
            address = self.pinned.address
            self.specs[layer] = LinkSpec(count=self.count, armed=0, item=0, groups=address,
                                         table=address + self.group_bytes, out=address + self.copy_bytes,
                                         ready=ready, done=done, max_tokens=self.max_tokens,
                                         scratch=self.scratch.ctypes.data,
                                         route=address + self.group_bytes + self.table_bytes)
        return self.specs[layer]

    def step_bytes(self, spec) -> int:
        """The expert bytes a replay read over the link for the layer of `spec` (its host wrote how many)."""
        return spec.shared * self.expert_bytes

    def enqueue(self, stream, kernels, layer: int, tokens: int, item: int, words: tuple[int, int], buffers,
                state, shares: bool = True) -> None:
        """Inside a capture of a `tokens`-token step, at the layer's host item `item`: wait for the host's
        share, run it on the device over the layer's image, write its sums, say so (shares=False: say so
        only).  words: the device's addresses of ready and done; buffers: the step's MoeBuffers (route, act,
        expert_out); state: its DeviceState (xn, 1/rms)."""
        if not shares:
            driver.write_value(stream, words[1], item)
            return
        c = self.config
        E, k, H, I = c.num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
        gate_up_fmt, down_fmt = self.store.formats[layer]
        gate_up_part, down_part = self.parts[layer]
        table = dict(slot_of=self.table, groups=self.groups, experts=E, chosen=k, tokens=tokens)
        driver.wait_value(stream, words[0], item)
        nbytes = self.copy_bytes
        driver.h2d_async(self.groups, self.pinned.view(np.uint8, (nbytes,)), nbytes, stream)
        launches = [
            experts_launch(kernels, gate_up_fmt, gate_up_part, x=state.xn, ldx=H, gather=True, inv_rms=state.inv_rms,
                           y=buffers.act, ldy=I, rows=2 * I, cols=H, silu=True, **table),
            experts_launch(kernels, down_fmt, down_part, x=buffers.act, ldx=I, gather=False, inv_rms=0,
                           y=buffers.expert_out, ldy=H, rows=H, cols=I, silu=False, **table),
            combine_launch(kernels, route=self.route, groups=self.groups, slot_of=self.table,
                           expert_out=buffers.expert_out, res=0, y=self.out, normw_out=0, xn_out=0, inv_rms_out=0,
                           eps=c.rms_norm_eps, hidden=H, experts=E, chosen=k, tokens=tokens)]
        for launch in launches:
            launch.enqueue(stream)
        driver.write_value(stream, words[1], item)

    def close(self) -> None:
        for buffer, _ in self.images.values():
            buffer.free()
        self.images = {}
        if getattr(self, "pinned", None) is not None:
            self.pinned.free()
            self.pinned = None
        if getattr(self, "memory", None) is not None:
            self.memory.release()
            self.memory = None
