"""Mixture-of-experts models in mode offload on the numpy device emulation (fake_cuda) against the CPU
engine: attention (qkv, o, rope, attention over the device KV pool) on the GPU, the router and the chosen
experts on the host, for Qwen3-MoE (a dense layer between routed ones) and Mixtral; a prefill and decode
steps of one session, a batch of sessions in one step, the homes the cost model picks under a budget of
every non-expert weight and homes given; gpu mode becomes offload for them, gated and layers=N refuse."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fake_cuda
import scheduler
from bench.synthetic import random_q8_weights
from hf_oracle import assert_logits_match
from kestrel_stream.loading.presets import PRESETS
from kestrel_stream.run.device.budget import plan_offload_memory, weight_items
from kestrel_stream.run.engine import Engine
from kestrel_stream.run.step_executor import StepExecutor
from test_offload_emulated import emulated  # noqa: F401  (a fixture)
from test_offload_emulated import run as offload_run

# Mixtral's tiny preset has head_dim 16, which the GPU attention kernels do not serve: its twin with 32
MODELS = {"qwen3-moe-tiny": PRESETS["qwen3-moe-tiny"],
          "mixtral-tiny": dataclasses.replace(PRESETS["mixtral-tiny"], head_dim=32)}
PROMPTS = ([5, 3, 200, 17, 42, 8, 1, 99, 250, 7, 64, 31], [9, 8, 7, 6, 5], [11])
MAX_SEQ_LEN, MAX_BATCH, DECODE_STEPS = 32, 4, 5
# the pool's figures with overheads scaled to these small layers, so the bytes decide
POOL = dataclasses.replace(scheduler.profile.H200_POOL, round_trip_us=0.05, gpu_launch_us=0.05, host_call_us=0.05)


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    weights = random_q8_weights(MODELS[request.param], seed=7)
    cpu = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    return weights, cpu, [run(cpu, prompt) for prompt in PROMPTS]


def run(engine, prompt) -> np.ndarray:
    return offload_run(engine, prompt, DECODE_STEPS)


def non_expert_budget(config) -> int:
    """A budget whose weight part holds every weight but the experts and routers (the KV pool's least and
    the step's activations besides)."""
    needs = plan_offload_memory(config, budget_bytes=1 << 40, free_bytes=1 << 41, profile=POOL, max_tokens=64,
                                max_sessions=256, max_seq_len=MAX_SEQ_LEN, attention_splits=16,
                                max_batch=MAX_BATCH).needs
    items = weight_items(config)
    return needs.total + 2 * 256 * (len(items) + 8) + sum(i.nbytes for i in items)


def offload_engine(weights, mode: str = "offload") -> Engine:
    executor = StepExecutor(weights, mode, POOL, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH,
                            vram_budget=non_expert_budget(weights.config))
    engine = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    engine.device, engine.mode, engine.executor = "cuda", executor.mode, executor
    return engine


def test_attention_resident_and_experts_on_the_host_match_the_cpu_engine(model, emulated):
    weights, _, reference = model
    c = weights.config
    engine = offload_engine(weights)
    placement = engine.executor.placement
    expected = tuple("attention" if c.moe_layer(i) else "resident" for i in range(c.num_hidden_layers))
    assert placement.homes == expected and placement.head == "resident", placement.describe()
    assert placement.routed_bytes and not placement.streamed_bytes and not placement.host_bytes
    plan = engine.executor.plan(1)
    assert {p.side for p in plan.placements.values() if p.group in ("router", "experts")} == {"cpu"}
    assert {p.side for p in plan.placements.values() if p.group in ("qkv", "o", "lm_head")} == {"gpu"}
    for prompt, expected_logits in zip(PROMPTS, reference):
        assert_logits_match(run(engine, prompt), expected_logits)
    stats = engine.executor.stats
    assert stats["cpu_weight_read_bytes"] > 0 and stats["gpu_weight_read_bytes"] > 0
    assert not stats.get("streamed_bytes")
    engine.close()


def test_a_decode_step_moves_and_waits_as_its_plan_says(model, emulated):
    """The plan is what runs: a decode step's syncs (one per host segment: each routed layer's MLP and
    embed) and its H2D and D2H bytes are the plan's."""
    weights, _, _ = model
    engine = offload_engine(weights)
    s = engine.new_session()
    s.prefill(PROMPTS[0])
    before = dict(engine.executor.stats)
    s.decode(3)
    after = engine.executor.stats
    plan = engine.executor.plan(1)
    routed = sum(weights.config.moe_layer(i) for i in range(weights.config.num_hidden_layers))
    assert plan.syncs_per_step == routed + 1
    for counter, planned in (("syncs", plan.syncs_per_step), ("h2d_bytes", plan.h2d_bytes_per_step),
                             ("d2h_bytes", plan.d2h_bytes_per_step)):
        assert after[counter] - before[counter] == planned, counter
    s.close()
    engine.close()


def test_a_batch_of_sessions_in_one_step_equals_each_on_the_cpu_engine(model, emulated):
    """Prompts of three sessions in one step, then three decode tokens in each of several steps: each
    session's logits are its own (the step's tokens share the experts on the host)."""
    weights, cpu, _ = model
    engine = offload_engine(weights)
    x = engine.executor
    kvs = [x.alloc_kv(MAX_SEQ_LEN) for _ in PROMPTS]
    cpu_kvs = [cpu.executor.alloc_kv(MAX_SEQ_LEN) for _ in PROMPTS]
    batch = [(kv, np.array(p), 0) for kv, p in zip(kvs, PROMPTS)]
    cpu_batch = [(kv, np.array(p), 0) for kv, p in zip(cpu_kvs, PROMPTS)]
    positions = [len(p) for p in PROMPTS]
    for _ in range(4):
        ours, theirs = x.forward(batch), cpu.executor.forward(cpu_batch)
        for a, b in zip(ours, theirs):
            assert_logits_match(a, b)
        tokens = [int(np.argmax(b[-1])) for b in theirs]
        batch = [(kv, np.array([t]), pos) for kv, t, pos in zip(kvs, tokens, positions)]
        cpu_batch = [(kv, np.array([t]), pos) for kv, t, pos in zip(cpu_kvs, tokens, positions)]
        positions = [pos + 1 for pos in positions]
    for kv in kvs:
        x.free_kv(kv)
    engine.close()


GIVEN = {"qwen3-moe-tiny": ("MSH", "HAM:host", "AHA"), "mixtral-tiny": ("MH", "HA:host", "MM")}


@pytest.mark.parametrize("which", range(3))
def test_homes_given_run_as_given(model, emulated, which):
    """KESTREL_OFFLOAD_HOMES: qkv and o of routed layers streamed through the ring (M), on the host (H) or
    resident (A), a dense layer's every home, lm_head on the host; every step size keeps them."""
    weights, _, reference = model
    homes = GIVEN["mixtral-tiny" if weights.config.arch == "mixtral" else "qwen3-moe-tiny"][which]
    emulated.setenv("KESTREL_OFFLOAD_HOMES", homes)
    engine = offload_engine(weights)
    placement = engine.executor.placement
    assert "".join(scheduler.offload.HOME_LETTERS[h] for h in placement.homes) == homes.split(":")[0]
    if "M" in homes or "S" in homes:
        assert placement.streamed_bytes and placement.ring_bytes
    for prompt, expected in zip(PROMPTS, reference):
        assert_logits_match(run(engine, prompt), expected)
    if "M" in homes or "S" in homes:
        assert engine.executor.stats.get("streamed_bytes", 0) > 0
    assert engine.executor.placement_for(7).homes == placement.homes
    engine.close()


def test_gpu_mode_runs_a_moe_model_as_offload_and_says_so(model, emulated, capsys):
    weights, _, reference = model
    engine = offload_engine(weights, mode="gpu")
    assert engine.executor.mode == "offload"
    assert "mixture-of-experts model" in capsys.readouterr().err
    assert_logits_match(run(engine, PROMPTS[1]), reference[1])
    engine.close()


@pytest.mark.parametrize("mode", ["gated", "layers=1"])
def test_gated_and_layers_modes_refuse_a_moe_model_naming_offload(model, emulated, mode):
    weights, _, _ = model
    with pytest.raises(ValueError, match=r"mixture-of-experts.*run it in mode offload"):
        StepExecutor(weights, mode, POOL, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)


def test_a_head_dim_the_attention_kernels_do_not_serve_is_refused(emulated):
    weights = random_q8_weights("mixtral-tiny", seed=1)
    with pytest.raises(ValueError, match="head_dim=16"):
        StepExecutor(weights, "offload", POOL, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH,
                     vram_budget=non_expert_budget(weights.config))


def assert_batched_decode_matches(engine, cpu) -> None:
    """Three sessions of different prompt lengths decoding one token together: each row the CPU engine's."""
    sessions = [engine.new_session() for _ in range(3)]
    for i, s in enumerate(sessions):
        s.prefill(PROMPTS[0][:4 + i])
    batched = engine.decode_batch([(s, 11) for s in sessions])
    for i, row in enumerate(batched):
        with cpu.new_session() as s:
            s.prefill(PROMPTS[0][:4 + i])
            assert_logits_match(row[None], s.decode(11)[None])


def test_split_layers_run_their_host_experts_as_one_native_call(model, emulated, monkeypatch):
    """Some experts of each layer resident on the device (by routing frequency), the others on the host:
    a decode step's host segment (the host part of a split layer, which adds the device part's moe_out)
    is one call of the native library, and the logits are the CPU engine's."""
    from kestrel_stream.options import Options
    from kestrel_stream.run.host.native_program import NativeProgram
    from test_moe_device_emulated import expert_budget
    weights, _, reference = model
    inputs = []
    real = NativeProgram.run_state
    monkeypatch.setattr(NativeProgram, "run_state", lambda self, state, *rest: inputs.append(self.inputs) or real(self, state, *rest))
    executor = StepExecutor(weights, "offload", POOL, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH,
                            vram_budget=expert_budget(weights.config, 3),
                            options=Options.from_env().with_(host_kernels="native"))
    engine = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    engine.device, engine.mode, engine.executor = "cuda", executor.mode, executor
    assert any(op.name.endswith("experts[cpu]") for seg in executor.plan(1).segments for op in seg.ops)
    for prompt, expected_logits in zip(PROMPTS, reference):
        assert_logits_match(run(engine, prompt), expected_logits)
    assert any("moe_out" in names for names in inputs)
    engine.close()
