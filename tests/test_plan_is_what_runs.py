"""The plan is what runs: for every mode, several decode batch sizes and prompt lengths, the plan's launches,
syncs, H2D and D2H bytes and the weight bytes read on each side per step equal what the executor counted on
the emulated device (tests/fake_cuda.py).

A decode batch runs as the executor's chunks (gpu mode: graph buckets of at most 8 sessions, padded to
the bucket), each chunk one step of the plan of its size; the expected counts sum the plans of those
chunks.  In gpu mode the step's kernels sit in one graph: the plan's launches are the graph's kernels.
"""
from __future__ import annotations

import dataclasses

import pytest

import fake_cuda
import scheduler
from bench.synthetic import random_q8_weights
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.run.device.budget import budget_for_weight_fraction, gpu_mode_needs
from kestrel_stream.run.device.step_graphs import EXACT_TOKENS, PADDED_TOKENS
from kestrel_stream.run.engine import Engine
from kestrel_stream.run.compat import HybridExecutor

CONFIG = ModelConfig(arch="qwen3", hidden_size=256, intermediate_size=256, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=256,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                     max_position_embeddings=64)
MAX_SEQ_LEN, MAX_BATCH = 16, 12
BATCHES = (1, 3, 8, 12)
MODES = ("cpu", "gpu", "gpu-eager", "gpu-window", "gpu-window-35", "gated", "gated-fast-link", "gated-split",
         "layers=1", "layers=3")
# per-step counters: (the executor's name, the plan's)
COUNTERS = (("syncs", "syncs_per_step"), ("h2d_bytes", "h2d_bytes_per_step"), ("d2h_bytes", "d2h_bytes_per_step"),
            ("gpu_weight_read_bytes", "gpu_weight_read_bytes"), ("cpu_weight_read_bytes", "cpu_weight_read_bytes"))
# the seed's threshold between the q and the k/v projections of a one-token step: the qkv group splits
SPLIT_MINFLOP = 1e5
# a link so fast that the cost model offloads groups of this small model: gated mode with GPU segments
FAST_LINK = dataclasses.replace(scheduler.H200_MEASURED, round_trip_us=1.0, host_weight_GBps=0.5,
                                host_gflops=5.0, gpu_launch_us=0.5)


@pytest.fixture(scope="module")
def weights():
    return random_q8_weights(CONFIG, seed=5)


def build(weights, mode: str) -> Engine:
    if mode == "cpu":
        return Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    if mode.startswith("gpu"):
        budget = None
        if mode.startswith("gpu-window"):       # half (35 %) of the weights resident, the rest streamed
            needs = gpu_mode_needs(CONFIG, MAX_BATCH, MAX_SEQ_LEN)
            budget = budget_for_weight_fraction(CONFIG, needs, 0.35 if mode.endswith("-35") else 0.5)
        engine = Engine(weights, device="cuda", mode="gpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH,
                        vram_budget=budget)
        engine.executor.use_graphs = mode != "gpu-eager"
        return engine
    engine = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    profile = FAST_LINK if mode == "gated-fast-link" else scheduler.H200_MEASURED
    options = engine.options.with_(minflop=SPLIT_MINFLOP if mode == "gated-split" else None)
    mode = mode.removesuffix("-fast-link").removesuffix("-split")
    engine.device, engine.mode = "cuda", mode
    engine.executor = HybridExecutor(weights, mode, profile, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH,
                                     options=options)
    return engine


def chunks(engine, batch: int) -> list[int]:
    """The token counts of the steps the executor runs one decode batch as."""
    x = engine.executor.steps
    if engine.mode != "gpu":
        step = getattr(x, "max_tokens", batch)
        return [min(step, batch - lo) for lo in range(0, batch, step)]
    if not x.use_graphs:
        return [min(x.max_tokens, batch - lo) for lo in range(0, batch, x.max_tokens)]
    sizes = [min(x.graph_rows, batch - lo) for lo in range(0, batch, x.graph_rows)]
    return [next(b for b in x.buckets if b >= n) for n in sizes]


def ran_one_step(engine, step) -> dict:
    """The executor's counters over one call of step(), after a first call that warms weights and graphs."""
    step()
    before = engine.executor.counters.as_dict()
    step()
    after = engine.executor.counters.as_dict()
    return {key: after[key] - before.get(key, 0) for key in after}


def assert_the_plans_ran(engine, mode: str, ran: dict, plans: list, label: str, d2h_bytes: int | None = None) -> None:
    """d2h_bytes: what the step copies out, where that is not the plans' (a padded step's own rows)."""
    launches = ran["kernels"] if mode in ("gpu", "gpu-window", "gpu-window-35") else ran["launches"]
    assert launches == sum(p.launches_per_step for p in plans), label
    assert (launches > 0) == (mode not in ("cpu", "gated")), "the modes that offload launch kernels"
    for ours, planned in COUNTERS:
        want = sum(p.counters()[planned] for p in plans)
        assert ran.get(ours, 0) == (d2h_bytes if ours == "d2h_bytes" and d2h_bytes is not None else want), \
            f"{label}: {ours}"
    weights_read = ran.get("gpu_weight_read_bytes", 0) + ran.get("cpu_weight_read_bytes", 0)
    assert weights_read >= len(plans) * engine.weights.lm_head.nbytes, "every step reads lm_head on one side"
    if mode.startswith("gpu-window"):
        assert engine.executor.backend.window.streamed, "the budget should stream some weights"


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("mode", MODES)
def test_plan_counters_equal_the_executors(weights, monkeypatch, mode, batch):
    fake_cuda.install(monkeypatch, mode="deferred")
    engine = build(weights, mode)
    sessions = [engine.new_session() for _ in range(batch)]
    first_tokens = iter((3, 7))         # the warm-up step's, then the counted step's

    def step():
        first = next(first_tokens)
        engine.decode_batch([(s, first + i) for i, s in enumerate(sessions)])

    ran = ran_one_step(engine, step)
    plans = [engine.executor.plan(n) for n in chunks(engine, batch)]
    assert_the_plans_ran(engine, mode, ran, plans, f"{mode} batch {batch}")
    if mode == "gated-split" and batch == 1:
        assert any(op.name.endswith("[gpu]") for op in plans[0].ops_on("gpu")), "the qkv group should split"
    assert ran["steps"] == 1 and ran["tokens"] == batch
    engine.close()


@pytest.mark.parametrize("prompt_len", (5, 14))
@pytest.mark.parametrize("mode", MODES)
def test_a_prompts_step_runs_the_plan_of_its_token_count(weights, monkeypatch, mode, prompt_len):
    """A prefill wanting every logits row (prompt_len <= the chunk sizes here: one step; 14 tokens take the
    tensor-core kernels in gpu mode).  In gpu mode with graphs the step replays the graph of its bucket of
    token counts (run/device/step_graphs.py: 5 tokens exactly, 14 padded to 16): the plan of the bucket's
    count runs, and the prompt's own logits rows come back."""
    fake_cuda.install(monkeypatch, mode="deferred")
    engine = build(weights, mode)
    prompt = list(range(1, prompt_len + 1))
    ran = ran_one_step(engine, lambda: engine.new_session().prefill(prompt))
    plan = engine.executor.plan(prompt_len)
    if mode in ("gpu", "gpu-window", "gpu-window-35"):
        bucket = next(b for b in EXACT_TOKENS + PADDED_TOKENS if b >= prompt_len)
        assert ran["graph_replays"] == 1
        assert_the_plans_ran(engine, mode, ran, [engine.executor.plan(bucket)], f"{mode} prompt {prompt_len}",
                             d2h_bytes=plan.d2h_bytes_per_step)
    else:
        assert_the_plans_ran(engine, mode, ran, [plan], f"{mode} prompt {prompt_len}")
    assert ran["steps"] == 1 and ran["tokens"] == prompt_len
    engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("batch", (1, 8, 12))
@pytest.mark.parametrize("mode", ("gpu", "gpu-eager", "gpu-window", "gated-fast-link", "gated-split", "layers=1"))
def test_on_the_device_the_plan_is_what_runs(weights, mode, batch):
    """The same comparison on a real GPU (skipped without one)."""
    engine = build(weights, mode)
    sessions = [engine.new_session() for _ in range(batch)]
    first_tokens = iter((3, 7))

    def step():
        first = next(first_tokens)
        engine.decode_batch([(s, first + i) for i, s in enumerate(sessions)])

    ran = ran_one_step(engine, step)
    assert_the_plans_ran(engine, mode, ran, [engine.executor.plan(n) for n in chunks(engine, batch)],
                         f"{mode} batch {batch} on the device")
    engine.close()


@pytest.mark.parametrize("mode", ("gpu-window", "gpu-window-35"))
def test_the_windows_prime_at_load_is_outside_the_step_counters(weights, monkeypatch, mode):
    """The window copies the first step's first streamed items once at load (window.prime_bytes); every step
    then re-primes the next one's, so even the first step counts exactly its plan's H2D bytes."""
    fake_cuda.install(monkeypatch, mode="deferred")
    engine = build(weights, mode)
    window = engine.executor.backend.window
    assert window.prime_bytes == sum(nbytes for _, nbytes in window.copies[:window.primed]) > 0
    before = engine.executor.counters.as_dict()
    engine.decode_batch([(engine.new_session(), 3)])
    after = engine.executor.counters.as_dict()
    ran = {key: after[key] - before.get(key, 0) for key in after}
    assert_the_plans_ran(engine, mode, ran, [engine.executor.plan(1)], f"{mode}: the first step")
    assert ran["streamed_bytes"] == window.streamed_bytes_per_step
    engine.close()
