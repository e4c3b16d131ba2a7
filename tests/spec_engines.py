"""Engines of one model in every placement the speculative tests run through, on the CPU or the emulated
device (fake_cuda installed by the caller): cpu; gpu (every weight resident); layers=1 (the hybrid: one
layer's attention on the device, the rest on the host); window (gpu mode with half the weights streamed
through the residency window); offload (mode offload: resident, streamed and host-computed layers)."""
from __future__ import annotations

import dataclasses

import scheduler
from kestrel_stream.run.device.budget import (budget_for_weight_fraction, gpu_mode_needs, plan_offload_memory,
                                              weight_items)
from kestrel_stream.run.engine import Engine
from kestrel_stream.run.step_executor import StepExecutor

MODES = ("cpu", "gpu", "layers=1", "window", "offload")
WINDOW_FRACTION = OFFLOAD_FRACTION = 0.5
MAX_BATCH = 4
# the offload pool's figures with overheads scaled to tiny layers, so bytes decide (test_offload_emulated's)
POOL = dataclasses.replace(scheduler.profile.H200_POOL, round_trip_us=0.05, gpu_launch_us=0.05, host_call_us=0.05)


def device_engine(weights, mode: str, max_seq_len: int = 64) -> Engine:
    """An engine of `weights` in `mode` (MODES)."""
    if mode == "cpu":
        return Engine(weights, device="cpu", max_seq_len=max_seq_len, max_batch=MAX_BATCH)
    if mode in ("gpu", "layers=1"):
        return Engine(weights, device="cuda", mode=mode, max_seq_len=max_seq_len, max_batch=MAX_BATCH)
    c = weights.config
    if mode == "window":
        needs = gpu_mode_needs(c, MAX_BATCH, max_seq_len)
        executor = StepExecutor(weights, "gpu", max_seq_len=max_seq_len, max_batch=MAX_BATCH,
                                vram_budget=budget_for_weight_fraction(c, needs, WINDOW_FRACTION),
                                small_item_bytes=1024)     # tiny layers: streamed too, not kept resident
        assert executor.window_plan is not None and executor.window_plan.streamed, "the window streams nothing"
    else:
        assert mode == "offload", mode
        needs = plan_offload_memory(c, budget_bytes=1 << 40, free_bytes=1 << 41, profile=POOL, max_tokens=64,
                                    max_sessions=256, max_seq_len=max_seq_len, attention_splits=16,
                                    max_batch=MAX_BATCH).needs
        items = weight_items(c)
        budget = needs.total + 2 * 256 * (len(items) + 8) + int(OFFLOAD_FRACTION * sum(i.nbytes for i in items))
        executor = StepExecutor(weights, "offload", POOL, max_seq_len=max_seq_len, max_batch=MAX_BATCH,
                                vram_budget=budget)
        assert executor.placement.host_bytes or executor.placement.streamed_bytes, executor.placement.describe()
    engine = Engine(weights, device="cpu", max_seq_len=max_seq_len, max_batch=MAX_BATCH)
    engine.executor.close()
    engine.device, engine.mode, engine.executor = "cuda", executor.mode, executor
    return engine
