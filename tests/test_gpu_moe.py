"""Mixture-of-experts models with their experts on the device (skipped without a GPU): the checks of
test_moe_device_emulated.py on the NVRTC-built kernels -- gpu mode with every expert in VRAM for tiny random
Qwen3-MoE and Mixtral against the CPU engine on the numpy arithmetic (2e-3 relative, the same argmax),
Q4_K_M's expert formats, batches (also on the grouped tensor-core GEMM) and the device's greedy chain, mode offload with some or all experts
resident, gpu mode becoming offload where they do not fit, and the plan's counters equal to what ran.
Tiny models: a few seconds in all."""
from __future__ import annotations

import dataclasses

import pytest

from hf_oracle import assert_logits_match
from kestrel_stream.loading.presets import PRESETS
from kestrel_stream.run.device import expert_pool
from kestrel_stream.run.engine import Engine
from bench.synthetic import random_q8_weights
from test_moe_device_emulated import (MAX_BATCH, MAX_SEQ_LEN, NUMPY, PROMPTS, block_experts,  # noqa: F401
                                      check_gpu_mode, check_gpu_mode_batches_and_chains,
                                      check_gpu_mode_on_the_grouped_gemm,
                                      check_offload_with_resident_experts, check_plan_is_what_runs, expert_budget,
                                      gpu_engine, model, run)

pytestmark = pytest.mark.gpu


def test_gpu_mode_runs_every_expert_on_the_device(model):  # noqa: F811
    weights, _, reference = model
    check_gpu_mode(weights, reference)


def test_gpu_mode_batches_sessions_and_chains_greedy_steps(model):  # noqa: F811
    weights, cpu, _ = model
    check_gpu_mode_batches_and_chains(weights, cpu)


def test_gpu_mode_runs_steps_of_many_tokens_on_the_grouped_gemm(model, monkeypatch):  # noqa: F811
    weights, cpu, reference = model
    check_gpu_mode_on_the_grouped_gemm(weights, cpu, reference, monkeypatch)


@pytest.mark.parametrize("mma_min_tokens", [None, 2])   # the GEMVs; steps of 2+ tokens on the GEMM
def test_gpu_mode_with_q4_k_m_experts(mma_min_tokens):
    cfg = dataclasses.replace(PRESETS["qwen3-moe-tiny"], hidden_size=256, moe_intermediate_size=256)
    weights = block_experts(random_q8_weights(cfg, seed=3))
    cpu = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH, options=NUMPY)
    engine = gpu_engine(weights, options=NUMPY.with_(moe_mma_min_tokens=mma_min_tokens))
    assert_logits_match(run(engine, PROMPTS[0]), run(cpu, PROMPTS[0]))
    engine.close()


@pytest.mark.parametrize("experts", [3, 1000])
def test_offload_keeps_the_experts_its_room_holds(model, experts):  # noqa: F811
    weights, _, reference = model
    check_offload_with_resident_experts(weights, reference, min(experts, expert_pool.all_experts(weights.config)))


def test_gpu_mode_becomes_offload_where_the_experts_do_not_fit(model):  # noqa: F811
    weights, _, reference = model
    engine = gpu_engine(weights, budget=expert_budget(weights.config, 2))
    assert engine.executor.mode == "offload"
    assert_logits_match(run(engine, PROMPTS[1]), reference[1])
    engine.close()


@pytest.mark.parametrize("batch", [1, 3])
def test_in_gpu_mode_the_plan_is_what_runs(model, batch):  # noqa: F811
    weights, _, _ = model
    check_plan_is_what_runs(weights, batch)
