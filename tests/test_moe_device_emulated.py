"""Mixture-of-experts models with their experts on the device (fake_cuda's emulation) against the CPU engine
on the numpy reference arithmetic (2e-3 relative, the same argmax): gpu mode with every expert in VRAM for
tiny random Qwen3-MoE (a dense layer between routed ones) and Mixtral, in Q8_0 and in llama.cpp's Q4_K_M
expert formats (Q4_K gate/up, Q6_K down); a prefill, greedy decode steps (replayed graphs and the device's
greedy chain) and a batch of sessions, there with the grouped tensor-core GEMM (moe_mma.cu) on every step of
two tokens or more; mode offload keeping the experts its room holds resident on the GPU
(a routed layer's router and those experts there, the others on the host) with the moves and waits its
plan says, and choosing them again by routing frequency.  tests/test_gpu_moe.py runs these checks on a GPU.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fake_cuda
from bench.synthetic import random_blocks, random_q8_weights
from hf_oracle import assert_logits_match
from kestrel_stream.loading.presets import PRESETS
from kestrel_stream.model.quant4 import BlockTensor
from kestrel_stream.options import Options
from kestrel_stream.run.device import expert_pool
from kestrel_stream.run.engine import Engine
from kestrel_stream.run.step_executor import StepExecutor
from test_moe_offload_emulated import POOL, assert_batched_decode_matches, non_expert_budget

# Mixtral's tiny preset has head_dim 16, which the GPU attention kernels do not serve: its twin with 32
MODELS = {"qwen3-moe-tiny": PRESETS["qwen3-moe-tiny"],
          "mixtral-tiny": dataclasses.replace(PRESETS["mixtral-tiny"], head_dim=32)}
PROMPTS = ([5, 3, 200, 17, 42, 8, 1, 99, 250, 7, 64, 31], [9, 8, 7, 6, 5], [11])
MAX_SEQ_LEN, MAX_BATCH, DECODE_STEPS = 32, 4, 5
NUMPY = Options.from_env().with_(host_kernels="numpy")     # the reference arithmetic, on the host parts too


@pytest.fixture
def emulated(monkeypatch):
    fake_cuda.install(monkeypatch, mode="deferred")
    return monkeypatch


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    weights = random_q8_weights(MODELS[request.param], seed=7)
    cpu = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH, options=NUMPY)
    return weights, cpu, [run(cpu, prompt) for prompt in PROMPTS]


def block_experts(weights):
    """`weights` with every expert in llama.cpp's Q4_K_M formats: Q4_K gate and up, Q6_K down."""
    rng = np.random.default_rng(4)
    c = weights.config
    for lw in weights.layers:
        if lw.moe is not None:
            E, H, I = c.num_experts, c.hidden_size, c.moe_intermediate_size
            lw.moe.gate_up = BlockTensor("Q4_K", random_blocks(rng, "Q4_K", E * 2 * I, H, 1 / np.sqrt(H)), H)
            lw.moe.down = BlockTensor("Q6_K", random_blocks(rng, "Q6_K", E * H, I, 1 / np.sqrt(I)), I)
    return weights


def run(engine, prompt, decode_steps: int = DECODE_STEPS) -> np.ndarray:
    """A prefill's logits, then `decode_steps` greedy decode steps' (one row each)."""
    with engine.new_session() as s:
        steps = [s.prefill(prompt)]
        token = int(np.argmax(steps[0][-1]))
        for _ in range(decode_steps):
            steps.append(s.decode(token)[None])
            token = int(np.argmax(steps[-1][-1]))
    return np.concatenate(steps)


def gpu_engine(weights, budget=None, options=NUMPY) -> Engine:
    """gpu mode under `budget` (None: free VRAM); the pool's figures given, should it become offload."""
    executor = StepExecutor(weights, "gpu", POOL, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH, vram_budget=budget,
                            options=options)
    return with_executor(weights, executor)


def with_executor(weights, executor) -> Engine:
    engine = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH, options=NUMPY)
    engine.device, engine.mode, engine.executor = "cuda", executor.mode, executor
    return engine


def expert_budget(config, experts: int) -> int:
    """mode offload's budget for every non-expert weight, the routers and `experts` experts."""
    layout = expert_pool.pool_layout(config)
    return non_expert_budget(config) + expert_pool.router_bytes(config) + 2 * 256 + experts * layout.slot_bytes


def offload_engine(weights, experts: int, policy: str = "frequency") -> Engine:
    executor = StepExecutor(weights, "offload", POOL, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH,
                            vram_budget=expert_budget(weights.config, experts),
                            options=NUMPY.with_(resident_experts=policy))
    return with_executor(weights, executor)


# ---- checks shared with the GPU's tests (test_gpu_moe.py) ----------------------------------------------
def check_gpu_mode(weights, reference) -> None:
    engine = gpu_engine(weights)
    x = engine.executor
    assert x.mode == "gpu" and x.resident_experts.used_slots == expert_pool.all_experts(weights.config)
    plan = x.plan(1)
    assert {seg.side for seg in plan.segments} == {"gpu"} and len(plan.segments) == 1
    for prompt, expected in zip(PROMPTS, reference):
        assert_logits_match(run(engine, prompt), expected)
    c = weights.config
    routed = sum(c.moe_layer(i) for i in range(c.num_hidden_layers))
    tokens = sum(len(p) + DECODE_STEPS for p in PROMPTS)
    counts = x.routing_counts()
    assert counts.shape == (routed, c.num_experts) and (counts.sum(axis=1) == tokens * c.num_experts_per_tok).all()
    engine.close()


def check_gpu_mode_batches_and_chains(weights, cpu) -> None:
    engine = gpu_engine(weights)
    assert_batched_decode_matches(engine, cpu)
    with engine.new_session() as s:                        # greedy tokens chained on the device
        s.prefill(PROMPTS[1])
        chained = engine.generate_chained(s, 3, 6)
    with cpu.new_session() as s:
        s.prefill(PROMPTS[1])
        token, expected = 3, []
        for _ in range(6):
            token = int(np.argmax(s.decode(token)))
            expected.append(token)
    assert chained == expected
    engine.close()


def check_gpu_mode_on_the_grouped_gemm(weights, cpu, reference, monkeypatch) -> None:
    """Every step of two tokens or more (prompts, batches) on moe_mma.cu, one token on moe_token_*'s two launches
    (no grouped GEMV): the CPU engine's logits."""
    from kestrel_stream.run.device import moe_ops
    kernels, real, real_token = [], moe_ops.experts_launch, moe_ops.token_launches
    monkeypatch.setattr(moe_ops, "experts_launch", lambda *a, **kw: kernels.append(real(*a, **kw)) or kernels[-1])
    monkeypatch.setattr(moe_ops, "token_launches", lambda *a, **kw: kernels.extend(real_token(*a, **kw)) or kernels[-2:])
    engine = gpu_engine(weights, options=NUMPY.with_(moe_mma_min_tokens=2))
    for prompt, expected in zip(PROMPTS, reference):
        assert_logits_match(run(engine, prompt), expected)
    assert_batched_decode_matches(engine, cpu)
    names = {launch.name for launch in kernels}
    assert {"moe_mma_q8_0_16x64_silu", "moe_mma_q8_0_16x64", "moe_token_q8_0_silu", "moe_token_q8_0_combine"} <= names
    assert not any(name.startswith("moe_experts_") for name in names), names
    engine.close()


def check_offload_with_resident_experts(weights, reference, experts: int) -> None:
    engine = offload_engine(weights, experts)
    x, c = engine.executor, weights.config
    resident = x.resident_experts
    assert resident is not None and resident.used_slots >= experts
    plan = x.plan(1)
    sides = {op.name: seg.side for seg in plan.segments for op in seg.ops}
    for layer, ids in resident.experts.items():
        assert sides[f"L{layer}.router"] == "gpu"
        if 0 < len(ids) < c.num_experts:
            assert sides[f"L{layer}.experts[gpu]"] == "gpu" and sides[f"L{layer}.experts[cpu]"] == "cpu"
    for prompt, expected in zip(PROMPTS, reference):
        assert_logits_match(run(engine, prompt), expected)
    choice = x.place_experts("frequency")                 # by what the prompts chose
    assert choice.used_slots == resident.used_slots and x.plan(1) is not plan
    for prompt, expected in zip(PROMPTS, reference):
        assert_logits_match(run(engine, prompt), expected)
    engine.close()


def check_plan_is_what_runs(weights, batch: int) -> None:
    """A decode batch's kernels (graph buckets), syncs, bytes and weight reads are its plans', router and
    experts (three launches) included; so are a prompt's."""
    from test_plan_is_what_runs import assert_the_plans_ran, chunks, ran_one_step
    engine = gpu_engine(weights)
    sessions = [engine.new_session() for _ in range(batch)]
    first_tokens = iter((3, 7))

    def step():
        first = next(first_tokens)
        engine.decode_batch([(s, first + i) for i, s in enumerate(sessions)])
    ran = ran_one_step(engine, step)
    assert_the_plans_ran(engine, "gpu", ran, [engine.executor.plan(n) for n in chunks(engine, batch)], f"batch {batch}")
    prompt = PROMPTS[0][:4 + batch]
    ran = ran_one_step(engine, lambda: engine.new_session().prefill(prompt))
    assert_the_plans_ran(engine, "gpu", ran, [engine.executor.plan(len(prompt))], f"prompt {len(prompt)}")
    engine.close()


# ---- the emulated device -----------------------------------------------------------------------------------
def test_gpu_mode_runs_every_expert_on_the_device(model, emulated):
    weights, _, reference = model
    check_gpu_mode(weights, reference)


def test_gpu_mode_batches_sessions_and_chains_greedy_steps(model, emulated):
    weights, cpu, _ = model
    check_gpu_mode_batches_and_chains(weights, cpu)


def test_gpu_mode_runs_steps_of_many_tokens_on_the_grouped_gemm(model, emulated):
    weights, cpu, reference = model
    check_gpu_mode_on_the_grouped_gemm(weights, cpu, reference, emulated)


@pytest.mark.parametrize("mma_min_tokens", [None, 2])   # the GEMVs; steps of 2+ tokens on the GEMM
def test_gpu_mode_with_q4_k_m_experts(emulated, mma_min_tokens):
    cfg = dataclasses.replace(PRESETS["qwen3-moe-tiny"], hidden_size=256, moe_intermediate_size=256)
    weights = block_experts(random_q8_weights(cfg, seed=3))
    cpu = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH, options=NUMPY)
    engine = gpu_engine(weights, options=NUMPY.with_(moe_mma_min_tokens=mma_min_tokens))
    assert engine.executor.backend.experts.formats[0] == ("Q4_K", "Q6_K")
    assert_logits_match(run(engine, PROMPTS[0]), run(cpu, PROMPTS[0]))
    engine.close()


@pytest.mark.parametrize("experts", [3, 1000])
def test_offload_keeps_the_experts_its_room_holds(model, emulated, experts):
    """Some experts of each layer resident (the rest on the host), or every one (1000: more than there are)."""
    weights, _, reference = model
    check_offload_with_resident_experts(weights, reference, min(experts, expert_pool.all_experts(weights.config)))


def test_an_offload_decode_step_moves_and_waits_as_its_plan_says(model, emulated):
    """Per routed layer one sync: the host's experts wait for x, the route and the device experts' sum."""
    weights, _, _ = model
    engine = offload_engine(weights, 3)
    with engine.new_session() as s:
        s.prefill(PROMPTS[0])
        before = dict(engine.executor.stats)
        s.decode(3)
        after = engine.executor.stats
    plan = engine.executor.plan(1)
    for counter, planned in (("syncs", plan.syncs_per_step), ("h2d_bytes", plan.h2d_bytes_per_step),
                             ("d2h_bytes", plan.d2h_bytes_per_step)):
        assert after[counter] - before[counter] == planned, counter
    engine.close()


def test_gpu_mode_becomes_offload_where_the_experts_do_not_fit(model, emulated, capsys):
    weights, _, reference = model
    engine = gpu_engine(weights, budget=expert_budget(weights.config, 2))
    assert engine.executor.mode == "offload" and "experts do not fit" in capsys.readouterr().err
    assert_logits_match(run(engine, PROMPTS[1]), reference[1])
    engine.close()


@pytest.mark.parametrize("batch", [1, 3, 4])
def test_in_gpu_mode_the_plan_is_what_runs(model, emulated, batch):
    weights, _, _ = model
    check_plan_is_what_runs(weights, batch)
