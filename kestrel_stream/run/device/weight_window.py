"""The VRAM residency window of `gpu` mode: resident weights, a ring of streaming slots, and the step's copies.

One concern, the window's mechanism (its policy is scheduler/window.py): the images, the ring and the
events that order a slot's copy against the kernels reading it belong together, since a change to one
is a race in another.

Every Q8 weight is laid out once, at load, as a device image -- qs [rows, cols]
int8, then scales [rows, cols/32] fp16 at the next 256-byte boundary (gate_up
with its rows interleaved (gate j, up j) for the SiLU epilogue; a 4/6-bit block
weight the same way: every part's qs, then every part's meta, model/quant4.image_layout) -- in page-locked
host memory (cuMemHostAlloc: the quantized cache's read-only memory maps cannot
be registered, and the interleave needs a copy anyway).  Resident images go up
into one arena block (the preload, overlapped with building them: upload_images);
streamed images stay pinned and are copied every step.

The ring: streamed item k of a step (k = 0, 1, ... in step order) lives in slot
k % slot_count, so every launch reads a fixed address and one captured graph
serves every step.  Per slot, a `loaded` event (copy stream, after its copy) and
a `released` event (compute stream, after the one kernel reading it):

    compute: ... wait loaded[k%S] → GEMV k → record released[k%S] ...
    copy:    wait released[c%S] (c >= S: item c-S is done with the slot) → copy c → record loaded[c%S]

Copy c is enqueued when compute reaches item c - prefetch_distance, and also
waits until item c - prefetch_distance - 1 released its slot, so a copy runs at
most `prefetch_distance` items ahead.  The host enqueues in step order, so when
a stream waits on an event, the event's latest record is the one meant (the
proof is in enqueue_step).  Inside stream capture the same calls build the
graph: the copy stream joins the capture by waiting on `fork` (recorded on the
capturing stream) and rejoins it through `join` before the capture ends.

Cross-step priming: weights do not depend on tokens, so the first `primed` =
min(prefetch_distance + 1, n) items of the NEXT step are copied at the end of
this one, each into its slot (item j < S lives in slot j) once this step's last
reader of that slot released it.  The link stays busy through the step's tail
(the layers after the last streamed item, lm_head, sampling) instead of idling
there and then making the next step wait for item 0.  Invariant: when a step's
first op runs on the compute stream, slots 0..primed-1 hold items 0..primed-1
and those copies are complete -- the window primes them once at creation, and
every step re-primes them before the `join` its compute stream waits on.  That
wait comes after the step's outputs (enqueue_step's `then`): the host waits for
an event recorded with them, not for the primes, so the copies keep the link
busy while the host takes the outputs and enqueues the next step.

Copy/compute busy times need timing events, which cannot be read out of a graph
replay; with KESTREL_PROF=1 or a trace active, streamed steps run eagerly with
timing events (`timing`), otherwise only bytes/hits/misses are counted.
"""
from __future__ import annotations

import time

import numpy as np

from kestrel_stream.obs import prof
from kestrel_stream.obs import trace
from kestrel_stream.run.device.budget import ALIGN
from kestrel_stream.run.device.block_weights import device_qweight, write_block_image
from kestrel_stream.model.quant import QTensor
from kestrel_stream.model.quant4 import image_bytes_of
from kestrel_stream.cuda import driver
from kestrel_stream.cuda.kernels import QWeight
from kestrel_stream.run.device.ops import fused_tensor
from kestrel_stream.run.device.image_writer import ImageWriter, write_image  # noqa: F401  (write_image: re-exported)
from scheduler.ops import step_ops


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def weight_tensors(weights) -> dict[str, tuple[QTensor, bool]]:
    """Window item name (the step program's op) -> (tensor, rows interleaved as gate/up pairs), in step order."""
    return {op.name: (fused_tensor(weights, op), op.group == "gate_up") for op in step_ops(weights.config, 1)
            if op.group or (op.kind == "embed" and not weights.tied)}


def step_launch_items(config) -> list:
    """The window item each launch of a gpu mode step reads (None: no Q8 weight, or the embed table)."""
    return [op.name if op.group else None for op in step_ops(config, 1) if op.launches]


PRELOAD_CHUNK_BYTES = 64 << 20


def upload_images(items, device_base: int, stream, chunk_bytes: int | None = None,
                  writer: ImageWriter | None = None) -> tuple[float, float]:
    """Resident images to the device through two pinned staging buffers in turn, each holding groups of
    images of up to `chunk_bytes` (an image bigger than that is a group alone): while one uploads, the
    host writes the next images into the other (after its event), so building overlaps the upload and
    no pinned copy of every resident weight is needed.

    items: (offset from device_base, QTensor, interleave) in offset order, images back to back at
    aligned offsets.  Returns (seconds writing images, seconds of upload not hidden behind them)."""
    if not items:
        return 0.0, 0.0
    sizes = [_align(image_bytes_of(w)) for _, w, _ in items]
    # a chunk holds every image but those of the largest size (a vocabulary-sized embed or lm_head)
    distinct = sorted(set(sizes))
    chunk_bytes = max(chunk_bytes or PRELOAD_CHUNK_BYTES, distinct[-2] if len(distinct) > 1 else 0)
    groups, current, used = [], [], 0           # consecutive items that fit one buffer
    for item, size in zip(items, sizes):
        if current and used + size > chunk_bytes:
            groups.append(current)
            current, used = [], 0
        current.append(item)
        used += size
    groups.append(current)
    # Buffer 0 holds the largest group, buffer 1 the largest group of at most a chunk; groups alternate
    # between them, but one bigger than a chunk (an image of the largest size) always takes buffer 0, so
    # those make one buffer their size, not both (pinning costs by the byte)
    group_bytes = [group[-1][0] - group[0][0] + image_bytes_of(group[-1][1]) for group in groups]
    chunked = [n for n in group_bytes if n <= chunk_bytes] or group_bytes
    buffer_bytes = [max(group_bytes)] + ([max(chunked)] if len(groups) > 1 else [])
    buffers = [driver.PinnedBuffer(n) for n in buffer_bytes]
    uploaded = [driver.Event(name=f"preload buffer {i}") for i in range(len(buffers))]
    in_flight = [False] * len(buffers)
    writing_s = 0.0
    started = time.perf_counter()
    b = len(buffers) - 1                        # the first group takes buffer 0
    for k, group in enumerate(groups):
        # the other buffer than the last group's, unless that is buffer 1 and the group does not fit it
        b = 1 - b if len(buffers) == 2 and (b == 1 or group_bytes[k] <= buffer_bytes[1]) else 0
        if in_flight[b]:
            uploaded[b].synchronize()
        t = time.perf_counter()
        first = group[0][0]
        jobs = [(buffers[b].bytes[offset - first:offset - first + image_bytes_of(w)], w, interleave)
                for offset, w, interleave in group]
        if writer is None:
            with ImageWriter() as own:
                own.write_images(jobs)
        else:
            writer.write_images(jobs)
        writing_s += time.perf_counter() - t
        last_offset, last_w, _ = group[-1]
        nbytes = last_offset - first + image_bytes_of(last_w)
        driver.h2d_async(device_base + first, buffers[b], nbytes, stream)
        uploaded[b].record(stream)
        in_flight[b] = True
    stream.synchronize()
    total_s = time.perf_counter() - started
    for buf, event in zip(buffers, uploaded):
        event.destroy()
        buf.free()
    return writing_s, total_s - writing_s


class WeightWindow:
    def __init__(self, weights, arena: driver.Arena, plan, compute_stream: driver.Stream):
        tensors = weight_tensors(weights)
        self.plan = plan
        self.streamed = list(plan.streamed) if plan else []
        on_host = set(plan.on_host) if plan else set()       # a mixed mode's host-side weights: not uploaded
        self.resident = [name for name in tensors if name not in self.streamed and name not in on_host]
        self.slot_count = plan.slot_count if self.streamed else 0
        self.prefetch_distance = plan.prefetch_distance if self.streamed else 0
        self.total_items = len(tensors)
        self.qweights: dict[str, QWeight] = {}

        def offsets(names):
            sizes = [_align(image_bytes_of(tensors[n][0])) for n in names]
            return dict(zip(names, np.cumsum([0] + sizes[:-1]).tolist())), sum(sizes)

        # resident: one arena block, filled from two pinned staging buffers in turn
        resident_at, self.resident_bytes = offsets(self.resident)
        self.resident_base = arena.alloc(self.resident_bytes)
        for name, offset in resident_at.items():
            self.qweights[name] = self._qweight(self.resident_base + offset, tensors[name][0])
        # streamed: pinned images kept for the step's copies, and the ring of slots
        stream_at, streamed_host_bytes = offsets(self.streamed)
        self.host = driver.PinnedBuffer(streamed_host_bytes) if self.streamed else None
        self.copies = []        # (pinned host view, image bytes) of streamed item k
        for name, offset in stream_at.items():
            w, _ = tensors[name]
            self.copies.append((self.host.bytes[offset:offset + image_bytes_of(w)], image_bytes_of(w)))
        with ImageWriter() as writer:
            resident_images_s, self.preload_s = upload_images(
                [(offset, *tensors[name]) for name, offset in resident_at.items()], self.resident_base,
                compute_stream, writer=writer)
            start = time.perf_counter()
            writer.write_images([(view, *tensors[name]) for (view, _), name in zip(self.copies, stream_at)])
        self.streamed_bytes_per_step = sum(nbytes for _, nbytes in self.copies)
        self.slot_stride = max((_align(n) for _, n in self.copies), default=0)
        self.ring_base = arena.alloc(self.slot_count * self.slot_stride) if self.streamed else 0
        for k, name in enumerate(self.streamed):
            self.qweights[name] = self._qweight(self.ring_base + (k % self.slot_count) * self.slot_stride,
                                                tensors[name][0])
        self.images_s = resident_images_s + time.perf_counter() - start      # preload_s: the upload not hidden

        self.copy_stream = driver.Stream("window copy h2d") if self.streamed else None
        self.loaded = [driver.Event(name=f"slot {s} loaded") for s in range(self.slot_count)]
        self.released = [driver.Event(name=f"slot {s} released") for s in range(self.slot_count)]
        self.fork, self.join = driver.Event(name="window fork"), driver.Event(name="window join")
        self.timing = False            # set per step by the executor (eager steps only)
        self._timed = None             # timing events of the last eager step, read after its sync
        self._checked: set[int] = set()
        self.compute_stream = compute_stream
        # items 0..primed-1 are loaded when a step starts; the step re-primes slot j after its last reader
        S, n = self.slot_count, len(self.streamed)
        self.primed = min(self.prefetch_distance + 1, n)
        self.prime_order = sorted((j + (n - 1 - j) // S * S, j) for j in range(self.primed))   # (last reader, slot)
        self.prime_bytes = sum(nbytes for _, nbytes in self.copies[:self.primed])
        if self.streamed:
            self._prime_at_load()

    @staticmethod
    def _qweight(address: int, w: QTensor) -> QWeight:
        return device_qweight(address, w)

    def qweight(self, name: str) -> QWeight:
        return self.qweights[name]

    def wants_timing(self) -> bool:
        return bool(self.streamed) and (prof.enabled or trace.active is not None)

    # ---- the step ---------------------------------------------------------------------------------
    def _prime_at_load(self) -> None:
        """The first step's items 0..primed-1 into their slots; the compute stream waits for them (no host
        sync), so whatever runs on it next -- an eager step or a graph replay -- finds them loaded."""
        for j in range(self.primed):
            self._copy(j)
        self.join.record(self.copy_stream)
        self.compute_stream.wait(self.join)

    def enqueue_step(self, launches: list, stream: driver.Stream, then=None) -> None:
        """Every launch on `stream`; streamed weights copied on the copy stream, ordered by the slot events.
        then(): enqueues the step's outputs (the copy out, the token pick) on `stream` after the launches and
        before it waits for the next step's primes, so a host waiting for the outputs (an event recorded
        in then) does not wait for those copies, which go on through the host's turn.

        Why each wait sees the record it means (P = prefetch_distance < S = slot_count, n items,
        p = primed = min(P+1, n); the host enqueues items in step order):
        - In-step copy c (p <= c < n) is enqueued while compute is at item k = c - P >= 1, after items
          0..k-1 were enqueued.  released[c%S]'s latest record is then item c-S's (c-S <= k-1, and the
          slot's next reader is item c); released[(c-P-1)%S]'s is item k-1's (its next is k-1+S > k).
        - Compute waits for item k >= p on loaded[k%S], whose latest record is copy k's: copies up to
          k+P are enqueued and the slot's next copy is k+S > k+P (primes record no `loaded`).
        - Items k < p have no wait: by the invariant (module docstring) they were loaded before the
          step's first op -- the previous step ended with `stream` waiting on `join`, recorded on the
          copy stream after its primes, and the window's creation ended the same way.  A graph replay
          is ordered on the compute stream like an eager step, and its primes are nodes of the graph
          joined into it before the capture ends, so replays stay self-contained.  A capture runs
          nothing: the slots keep what the last step that ran left there.
        - The prime of slot j (j < p) waits on released[j] after item L_j, the slot's last reader this
          step (the largest k < n with k % S == j), was enqueued: its latest record is L_j's.  The
          slot's in-step copies precede it on the copy stream (FIFO, and in a graph the same lane).
          Primes wait until every in-step copy is enqueued, so none of this step's copies queues
          behind the next step's on the copy stream.
        - Copies into slots >= p at the start of a step need no slot wait: their last readers ran in
          earlier steps, before `fork`.  Steps of any token count (or batch bucket) share the ring and
          the streamed order (asserted), so the invariant holds across them in any sequence; n < S
          or n <= P only shrink p and the in-step copies (with n <= P every item is a prime).
        Every step copies each streamed item once (in-step items p..n-1 and the primes of 0..p-1), so
        a step's bytes are streamed_bytes_per_step; the creation's prime (prime_bytes) is load work.
        Timing: a step's copy pairs are indexed by item (primes by the item they load next step);
        the stall pairs of items k < p are not recorded, the wait on `join` (for the primes) is one.
        """
        if not self.streamed:
            for launch in launches:
                launch.enqueue(stream)
            if then is not None:
                then()
            return
        assert stream is self.compute_stream, "the priming invariant orders steps on the window's compute stream"
        items = [launch.labels.get("weight") for launch in launches]     # device_ops labels each projection
        if id(launches) not in self._checked:      # every streamed launch reads its slot's address
            for launch, name in zip(launches, items):
                assert name is None or int(launch.storage[0]) == self.qweights[name].qs, (launch.name, name)
            order = [name for name in items if name in self.streamed]
            assert order == self.streamed, "streamed items must be read in ring order"
            self._checked.add(id(launches))
        S, P, n, primed = self.slot_count, self.prefetch_distance, len(self.streamed), self.primed
        position = {name: k for k, name in enumerate(self.streamed)}
        timed = self._timing_events(n) if self.timing else None
        self.copy_stream.capturing = getattr(stream, "capturing", False)   # it joins the capture through fork
        self.fork.record(stream)
        self.copy_stream.wait(self.fork)
        if timed:
            timed["start"].record(stream)
        issued, primes = primed, list(self.prime_order)
        for launch, name in zip(launches, items):
            k = position.get(name) if name is not None else None
            if k is None:
                launch.enqueue(stream)
                continue
            while issued <= min(k + P, n - 1):
                self._issue(issued, timed)
                issued += 1
            if k >= primed:
                if timed:
                    timed["wait"][k][0].record(stream)
                stream.wait(self.loaded[k % S])
                if timed:
                    timed["wait"][k][1].record(stream)
            launch.enqueue(stream)
            self.released[k % S].record(stream)
            while issued == n and primes and primes[0][0] <= k:
                self._prime(primes.pop(0)[1], timed)
        assert not primes, "every primed slot has a last reader"
        self.join.record(self.copy_stream)
        if then is not None:
            then()
        if timed:                                   # compute waiting for the primes is a stall too
            timed["join"][0].record(stream)
        stream.wait(self.join)
        self.copy_stream.capturing = False
        if timed:
            timed["join"][1].record(stream)
            timed["end"].record(stream)
            self._timed = timed

    def _issue(self, c: int, timed) -> None:
        S, P = self.slot_count, self.prefetch_distance
        slot = c % S
        if c >= S:                                  # the slot's previous item was read
            self.copy_stream.wait(self.released[slot])
        pace = c - P - 1
        if pace >= 0 and pace != c - S:             # compute reached item c - P
            self.copy_stream.wait(self.released[pace % S])
        self._copy(c, timed)
        self.loaded[slot].record(self.copy_stream)

    def _prime(self, j: int, timed) -> None:
        """Next step's item j into slot j, once this step's last reader of the slot released it."""
        self.copy_stream.wait(self.released[j])
        self._copy(j, timed)

    def _copy(self, c: int, timed=None) -> None:
        if timed:
            timed["copy"][c][0].record(self.copy_stream)
        host_image, nbytes = self.copies[c]
        driver.h2d_async(self.ring_base + (c % self.slot_count) * self.slot_stride, host_image, nbytes,
                         self.copy_stream)
        if timed:
            timed["copy"][c][1].record(self.copy_stream)

    def _timing_events(self, n: int) -> dict:
        if getattr(self, "_timing_pool", None) is None:
            pair = lambda: (driver.Event(timing=True), driver.Event(timing=True))
            self._timing_pool = {"start": driver.Event(timing=True), "end": driver.Event(timing=True), "join": pair(),
                                 "copy": [pair() for _ in range(n)], "wait": [pair() for _ in range(n)]}
        return self._timing_pool

    # ---- counters (after each pass's sync) ----------------------------------------------------------
    def account(self, counters) -> None:
        """One pass through the step's weights: bytes streamed, hits/misses, and busy times when timed
        (counters: a StepCounters)."""
        c = counters
        c.streamed_bytes = (c.streamed_bytes or 0) + self.streamed_bytes_per_step
        c.h2d_bytes += self.streamed_bytes_per_step
        c.window_hits = (c.window_hits or 0) + len(self.resident)
        c.window_misses = (c.window_misses or 0) + len(self.streamed)
        timed, self._timed = self._timed, None
        if timed:
            copy_ms = sum(end.elapsed_ms(begin) for begin, end in timed["copy"])
            stall_ms = sum(end.elapsed_ms(begin) for begin, end in timed["wait"][self.primed:] + [timed["join"]])
            span_ms = timed["end"].elapsed_ms(timed["start"])
            c.copy_busy_ms = (c.copy_busy_ms or 0.0) + copy_ms
            c.compute_busy_ms = (c.compute_busy_ms or 0.0) + max(span_ms - stall_ms, 0.0)
            c.step_span_ms = (c.step_span_ms or 0.0) + span_ms

    # ---- load report ----------------------------------------------------------------------------------
    def preload_report(self, budget_bytes: int | None, needs_bytes: int) -> tuple[str, str | None]:
        """(the preload line, a WARNING line or None)."""
        mb = 1e6
        gb_s = self.resident_bytes / self.preload_s / 1e9 if self.preload_s > 0 else 0.0
        line = (f"preload: {len(self.resident)}/{self.total_items} weights warmed in {self.preload_s:.2f} s; "
                f"device cache {self.resident_bytes / mb:.1f} MB / {len(self.resident)} entries "
                f"({gb_s:.1f} GB/s from pinned host images built in {self.images_s:.2f} s)")
        if not self.streamed:
            return line, None
        line += (f"; ring {self.slot_count} x {self.slot_stride / mb:.1f} MB, prefetch distance "
                 f"{self.prefetch_distance}, streaming {self.streamed_bytes_per_step / mb:.1f} MB/step "
                 f"({self.primed} primed during the step before)")
        wanted = self.resident_bytes + self.streamed_bytes_per_step + needs_bytes
        warning = (f"WARNING: only {len(self.resident)}/{self.total_items} weights stay resident: the VRAM budget "
                   f"{(budget_bytes or 0) / mb:.1f} MB is {(wanted - (budget_bytes or 0)) / mb:.1f} MB short, so "
                   f"{len(self.streamed)} weights ({self.streamed_bytes_per_step / mb:.1f} MB) cross PCIe every "
                   f"decode step; raise --vram-budget to about {wanted / mb:.0f} MB "
                   f"to keep all {self.total_items} resident")
        return line, warning

    def close(self) -> None:
        if self.host is not None:
            self.host.free()
            self.host = None
