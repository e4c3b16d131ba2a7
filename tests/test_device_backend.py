"""Every mode that offloads runs on one executor class (run/step_executor.py) over one device backend
(run/device_backend.py), on the emulated device: gpu mode and the mixed modes share its arena, window and
paged KV pool.  layers=N keeps its GPU layers'
float32 keys and values in the pool; the window holds exactly the weights the mode's plans run on the GPU;
a weight a forced plan adds is uploaded on its first use, and the logits stay the CPU engine's."""
from __future__ import annotations

import pytest

import scheduler
from hf_oracle import assert_logits_match
from kestrel_stream.run.device.budget import plan_mixed_memory, weight_items
from kestrel_stream.run.device.backend import DeviceBackend
from kestrel_stream.run.compat import DeviceExecutor
from kestrel_stream.run.step_executor import StepExecutor
from kestrel_stream.run.compat import GpuExecutor
from kestrel_stream.run.compat import HybridExecutor
from kestrel_stream.run.engine import Engine
from test_executors_emulated import (CONFIGS, FAST_LINK, MAX_BATCH, MAX_SEQ_LEN, PROMPTS, emulated,  # noqa: F401
                                     gpu_engine, hybrid_engine, run)
from bench.synthetic import random_q8_weights


@pytest.fixture(scope="module")
def weights():
    return random_q8_weights(CONFIGS["qwen3"], seed=3)


@pytest.fixture(scope="module")
def reference(weights):
    cpu = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    return run(cpu, PROMPTS[0])[0]


def gpu_projections(plan) -> set:
    return {op.name.split("[")[0] for op in plan.ops_on("gpu") if op.group}


@pytest.mark.parametrize("mode", ["gpu", "gated", "layers=1"],
                         ids=["gpu-mode", "gated", "layers=1"])        # an id "gpu" is the gpu mark
def test_every_offloading_mode_builds_the_device_backend(weights, emulated, mode):
    engine = gpu_engine(weights) if mode == "gpu" else hybrid_engine(weights, mode, FAST_LINK)
    backend = engine.executor.backend
    assert type(engine.executor) is StepExecutor is DeviceExecutor is GpuExecutor is HybridExecutor, "one class"
    assert isinstance(backend, DeviceBackend)
    assert engine.executor.backend.window is backend.window and not backend.window.streamed
    if mode != "gpu":
        wanted = set().union(*(gpu_projections(engine.executor.plan(t)) for t in (1, 2, 4, 8, 16, 32, 64)))
        assert wanted and set(backend.window.resident) == wanted, "resident: what the plans run on the GPU"
        assert engine.executor.stats["weight_uploads"] == len(wanted)
    engine.close()


def test_layers_mode_keeps_its_gpu_layers_kv_in_the_float32_pool(weights, emulated, reference):
    engine = hybrid_engine(weights, "layers=1")
    x = engine.executor
    assert x.kv_stats()["kv_dtype"] == "f32" and x.kv_stats()["kv_blocks_used"] == 0
    assert x.backend.kv.block_bytes == x.backend.kv.block_size * 2 * weights.config.kv_size * 4, "one layer's k and v"
    ours, _ = run(engine, PROMPTS[0])
    assert_logits_match(ours, reference)
    s = engine.new_session()
    s.prefill(PROMPTS[0])                                # 12 positions: one block of 16
    assert x.kv_stats()["kv_blocks_used"] == 1
    s.truncate(0)
    assert x.kv_stats()["kv_blocks_used"] == 0, "a truncated session gives its blocks back"
    engine.close()


def test_a_weight_a_forced_plan_adds_is_uploaded_on_first_use(weights, emulated, reference):
    engine = hybrid_engine(weights, "gated", scheduler.H200_MEASURED, prefill_chunk=MAX_BATCH)   # steps <= 4 tokens
    x = engine.executor
    assert not x.backend.window.resident, "the measured link keeps this small model's short steps on the host"
    x.set_group_choice({"gate_up": True})
    before = x.stats["weight_uploads"]
    ours, _ = run(engine, PROMPTS[0])
    layers = weights.config.num_hidden_layers
    assert x.stats["weight_uploads"] - before == layers, "each layer's gate_up once"
    assert_logits_match(ours, reference)
    run(engine, PROMPTS[0])
    assert x.stats["weight_uploads"] - before == layers, "and kept"
    assert x.stats["gpu_weight_read_bytes"] > 0
    engine.close()


def test_the_mixed_modes_memory_plan_holds_only_what_the_plans_put_on_the_gpu():
    c = CONFIGS["qwen3"]
    items = {i.name: i.nbytes for i in weight_items(c)}
    plan = lambda resident, layers: plan_mixed_memory(            # noqa: E731
        c, resident=resident, max_tokens=64, kv_layers=layers, max_sessions=256, sessions=8, max_seq_len=32,
        attention_splits=16)
    none, layer0 = plan(set(), 0), plan({"L0.qkv", "L0.o", "L0.gate_up", "L0.down"}, 1)
    assert none.window.resident == () and set(none.window.on_host) == set(items) and none.kv is None
    assert layer0.window.resident == ("L0.qkv", "L0.o", "L0.gate_up", "L0.down") and not layer0.window.streamed
    assert layer0.arena_bytes - none.arena_bytes >= sum(items[n] for n in layer0.window.resident)
    assert layer0.kv.block_bytes == 16 * 2 * c.kv_size * 4, "float32 k and v of one layer per position"
    assert layer0.kv.max_blocks == 8 * 2, "8 sessions of 32 positions"
