"""The streaming window's copy/compute ordering, checked without a GPU.

A fake device layer records what WeightWindow enqueues (copies, event records,
stream waits, kernels) with CUDA's semantics -- a wait blocks on the event's
latest record at the time of the wait call -- and replays the two streams in
random interleavings over a fake device memory.  Every GEMV "kernel" checks it
reads its own weight's image: a copy that overwrites a slot before its last
reader ran, or a kernel that runs before its copy landed, fails the test.
"""
from __future__ import annotations

import random
import types

import numpy as np
import pytest

from kestrel_stream.run.executor import StepCounters

from kestrel_stream.run.device.budget import arena_needs, budget_for_weight_fraction, image_bytes, plan_arena
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.run.device import weight_window as stream_window
from kestrel_stream.run.device.weight_window import WeightWindow, step_launch_items, weight_tensors, write_image
from bench.synthetic import random_q8_weights

SMALL = ModelConfig(arch="qwen3", hidden_size=256, intermediate_size=256, num_hidden_layers=6,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=256,
                    tie_word_embeddings=True)


class Device:
    """Fake device memory, streams and events; `run` executes what was enqueued in a random legal order."""

    def __init__(self, seed: int, size: int = 64 << 20):
        self.memory = np.zeros(size, np.uint8)
        self.base = 1 << 32
        self.top = 0
        self.streams = []
        self.rng = random.Random(seed)
        self.kernel_errors = []
        self.kernels_run = 0

    # device layer
    def module(self):
        device = self

        class Stream:
            def __init__(self, name=None):
                self.ops, self.done, self.capturing = [], 0, False
                device.streams.append(self)

            def wait(self, event):
                if event.latest is not None:
                    self.ops.append(("wait", event.latest))

            def synchronize(self):
                device.run()

        class Event:
            def __init__(self, timing=False, name="event"):
                self.latest = None

            def record(self, stream):
                self.latest = (stream, len(stream.ops))   # everything enqueued on stream so far

            def synchronize(self):
                device.run()

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
            data = src.bytes if isinstance(src, PinnedBuffer) else src
            stream.ops.append(("copy", dst, data, nbytes))

        return types.SimpleNamespace(Stream=Stream, Event=Event, PinnedBuffer=PinnedBuffer, h2d_async=h2d_async)

    def alloc(self, nbytes):
        address = self.base + self.top
        self.top += -(-max(nbytes, 1) // 256) * 256
        assert self.top <= len(self.memory)
        return address

    def read(self, address, nbytes):
        return self.memory[address - self.base:address - self.base + nbytes]

    def run(self):
        while True:
            ready = [s for s in self.streams if s.done < len(s.ops) and self._ready(s.ops[s.done])]
            if not ready:
                assert all(s.done == len(s.ops) for s in self.streams), "deadlock: a wait that never completes"
                return
            stream = self.rng.choice(ready)
            op = stream.ops[stream.done]
            if op[0] == "copy":
                _, dst, data, nbytes = op
                self.read(dst, nbytes)[:] = data[:nbytes]
            elif op[0] == "kernel":
                self.kernels_run += 1
                error = op[1](self)
                if error:
                    self.kernel_errors.append(error)
            stream.done += 1

    @staticmethod
    def _ready(op):
        return op[0] != "wait" or op[1][0].done >= op[1][1]


class FakeLaunch:
    """A launch whose first argument is its weight's qs address; running it checks the bytes there."""

    def __init__(self, name, qweight, expected, weight=None):
        self.name, self.qweight, self.expected = name, qweight, expected
        self.labels = {"weight": weight} if weight else {}        # the window item it reads (device_ops.py)
        self.storage = np.array([qweight.qs if qweight else 0], np.uint64)

    def enqueue(self, stream):
        stream.ops.append(("kernel", self.check))

    def check(self, device):
        if self.qweight is None:
            return None
        rows, cols = self.qweight.rows, self.qweight.cols
        image = self.expected
        qs_ok = np.array_equal(device.read(self.qweight.qs, rows * cols), image[:rows * cols])
        scale_at = self.qweight.scales - self.qweight.qs
        scales_ok = np.array_equal(device.read(self.qweight.scales, rows * cols // 16),
                                   image[scale_at:scale_at + rows * cols // 16])
        return None if qs_ok and scales_ok else f"{self.name} read another weight's bytes"


def build(monkeypatch, seed, fraction, slots, distance, broken=False):
    device = Device(seed)
    monkeypatch.setattr(stream_window, "driver", device.module())
    weights = random_q8_weights(SMALL, seed=3)
    needs = arena_needs(SMALL, 8, 2, 16, 16)
    budget = budget_for_weight_fraction(SMALL, needs, fraction, slots)
    _, plan = plan_arena(SMALL, needs, budget, slots, distance, small_item_bytes=0)
    arena = types.SimpleNamespace(alloc=device.alloc)
    cls = WeightWindow
    if broken:                            # no slot-reuse guard, no pacing: the race the events prevent
        cls = type("Unguarded", (WeightWindow,), {})
        cls._issue = lambda self, c, timed: _unguarded(self, c)
    compute = device.module().Stream("compute")
    window = cls(weights, arena, plan, compute)
    tensors = weight_tensors(weights)
    images = {}
    for name, (w, interleave) in tensors.items():
        images[name] = np.zeros(image_bytes(*w.shape), np.uint8)
        write_image(images[name], w, interleave)
    launches = []
    for index, name in enumerate(step_launch_items(SMALL)):
        table = "lm_head" if index == 0 else name       # the embed kernel gathers from the (resident) table
        launches.append(FakeLaunch(f"launch {index}", window.qweight(table) if table else None,
                                   images.get(table), name))
    return device, window, compute, launches, plan


def _unguarded(window, c):
    slot = c % window.slot_count
    host_image, nbytes = window.copies[c]
    stream_window.driver.h2d_async(window.ring_base + slot * window.slot_stride, host_image, nbytes,
                                   window.copy_stream)
    window.loaded[slot].record(window.copy_stream)


@pytest.mark.parametrize("slots,distance", [(1, 0), (2, 0), (2, 1), (3, 1), (3, 2)])
@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_every_kernel_reads_its_own_weight_in_any_interleaving(monkeypatch, slots, distance, fraction):
    for seed in range(4):
        device, window, compute, launches, plan = build(monkeypatch, seed, fraction, slots, distance)
        assert window.streamed and len(window.streamed) == len(plan.streamed)
        counters = StepCounters()
        for _ in range(3):                # steps: the ring restarts at slot 0 every step
            window.enqueue_step(launches, compute)
            compute.synchronize()
            window.account(counters)
        stats = counters.as_dict()
        assert device.kernel_errors == []
        assert device.kernels_run == 3 * len(launches)
        assert stats["window_misses"] == 3 * len(plan.streamed)
        assert stats["window_hits"] == 3 * len(plan.resident)
        assert stats["streamed_bytes"] == 3 * window.streamed_bytes_per_step


def test_the_checker_catches_a_missing_release_wait(monkeypatch):
    caught = 0
    for seed in range(8):
        device, window, compute, launches, _ = build(monkeypatch, seed, 0.25, 2, 1, broken=True)
        window.enqueue_step(launches, compute)
        compute.synchronize()
        caught += bool(device.kernel_errors)
    assert caught > 0


def test_everything_resident_enqueues_launches_only(monkeypatch):
    device, window, compute, launches, plan = build(monkeypatch, 0, 1.0, 2, 1)
    assert plan is None and window.streamed == [] and window.copy_stream is None
    window.enqueue_step(launches, compute)
    assert [op[0] for op in compute.ops] == ["copy"] + ["kernel"] * len(launches)   # the preload, then kernels
    compute.synchronize()
    assert device.kernel_errors == []


def test_preload_report_names_the_shortfall_and_the_flag(monkeypatch):
    _, window, _, _, plan = build(monkeypatch, 0, 0.5, 2, 1)
    line, warning = window.preload_report(plan.budget_bytes, 1000)
    assert line.startswith(f"preload: {len(plan.resident)}/{window.total_items} weights warmed in ")
    assert f"device cache {window.resident_bytes / 1e6:.1f} MB / {len(plan.resident)} entries" in line
    assert warning.startswith("WARNING: only") and "--vram-budget" in warning and "short" in warning
    _, window, _, _, _ = build(monkeypatch, 0, 1.0, 2, 1)
    line, warning = window.preload_report(None, 1000)
    assert warning is None and f"{window.total_items}/{window.total_items} weights" in line


def test_device_image_is_qs_then_aligned_scales_with_gate_up_rows_interleaved():
    weights = random_q8_weights(SMALL, seed=5)
    w = weights.layers[0].w_gate_up
    rows, cols = w.shape
    image = np.zeros(image_bytes(rows, cols), np.uint8)
    write_image(image, w, interleave=True)
    pairs = np.stack([np.arange(rows // 2), rows // 2 + np.arange(rows // 2)], axis=1).reshape(-1)
    np.testing.assert_array_equal(image[:rows * cols].view(np.int8).reshape(rows, cols), w.qs[pairs])
    scales_at = -(-rows * cols // 256) * 256
    np.testing.assert_array_equal(image[scales_at:].view(np.float16).reshape(rows, cols // 32), w.scales[pairs])
    down = weights.layers[0].w_down
    image = np.zeros(image_bytes(*down.shape), np.uint8)
    write_image(image, down, interleave=False)
    np.testing.assert_array_equal(image[:down.qs.size].view(np.int8).reshape(down.shape), down.qs)
