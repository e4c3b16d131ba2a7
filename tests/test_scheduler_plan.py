"""Placement plans: every mode, fusion groups, segments and syncs, the every-weight-once audit."""
from __future__ import annotations

import dataclasses
import json

import pytest

from kestrel_stream.model.config import ModelConfig
from scheduler import (H200_MEASURED, SEED_LIKE, PlanAuditError, audit_plan, build_plan,
                       model_weight_names, mode_name, parse_mode, step_ops)
from scheduler.ops import q8_bytes

QWEN3_1_7B = ModelConfig(arch="qwen3", hidden_size=2048, intermediate_size=6144,
                         num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=128, vocab_size=151936, tie_word_embeddings=True)
LLAMA_UNTIED = ModelConfig(arch="llama", hidden_size=256, intermediate_size=768,
                           num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                           head_dim=32, vocab_size=1000, tie_word_embeddings=False)
LAYERS = QWEN3_1_7B.num_hidden_layers
MODES = ["cpu", "gated", "gpu", "layers=0", "layers=10", "layers=28", "layers=99", "auto"]


def side_of(plan, op_name):
    return next(seg.side for seg in plan.segments for op in seg.ops if op.name == op_name)


@pytest.mark.parametrize("config", [QWEN3_1_7B, LLAMA_UNTIED], ids=["qwen3-tied", "llama-untied"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens", [1, 32])
def test_every_mode_places_every_weight_exactly_once(config, mode, tokens):
    plan = build_plan(config, tokens, mode, H200_MEASURED)
    audit_plan(plan, config)
    description = plan.describe()
    for name in model_weight_names(config):
        assert sum(line.split()[0] == name for line in description.splitlines()) == 1, name
    as_json = json.loads(json.dumps(plan.to_dict()))
    assert as_json["counters"]["syncs_per_step"] == plan.syncs_per_step
    assert len(as_json["weights"]) == len(model_weight_names(config))


def test_audit_names_match_the_checkpoint_layout():
    weights = pytest.importorskip("kestrel_stream.model.weights")
    from kestrel_stream.loading.presets import PRESETS
    for config in (QWEN3_1_7B, LLAMA_UNTIED, PRESETS["qwen2-tiny"], PRESETS["mistral-tiny"]):
        assert model_weight_names(config) == set(weights.hf_tensor_shapes(config))


def test_audit_catches_a_missing_or_doubled_weight():
    plan = build_plan(QWEN3_1_7B, 1, "gpu", H200_MEASURED)
    ops = plan.segments[0].ops
    lm_head = next(op for op in ops if op.name == "lm_head")
    missing = dataclasses.replace(plan, segments=[dataclasses.replace(
        plan.segments[0], ops=[op for op in ops if op is not lm_head])])
    with pytest.raises(PlanAuditError, match="model.embed_tokens.weight"):
        audit_plan(missing, QWEN3_1_7B)
    doubled = dataclasses.replace(plan, segments=[dataclasses.replace(
        plan.segments[0], ops=ops + [lm_head])])
    with pytest.raises(PlanAuditError, match="placed twice"):
        audit_plan(doubled, QWEN3_1_7B)


def test_op_costs_follow_the_shapes():
    ops = {op.name: op for op in step_ops(QWEN3_1_7B, 1)}
    q_proj = ops["L3.qkv"].weights[0]
    assert q_proj.name == "model.layers.3.self_attn.q_proj.weight"
    assert q_proj.nbytes == 2048 * 2048 * 34 // 32 == q8_bytes(2048, 2048)
    assert ops["L3.qkv"].flops == 2 * (2048 + 1024 + 1024) * 2048
    assert ops["lm_head"].weights[0].name == "model.embed_tokens.weight"  # tied
    assert ops["embed"].weights == () and ops["embed"].gathers_from == "model.embed_tokens.weight"
    assert [w.name for w in ops["L3.rope"].weights] == [
        "model.layers.3.self_attn.q_norm.weight", "model.layers.3.self_attn.k_norm.weight"]
    untied = {op.name: op for op in step_ops(LLAMA_UNTIED, 4)}
    assert untied["lm_head"].weights[0].name == "lm_head.weight"
    assert untied["embed"].weights[0].name == "model.embed_tokens.weight"
    assert untied["L0.rope"].weights == ()  # llama has no q/k norm


def test_cpu_mode_has_no_gpu_work():
    plan = build_plan(QWEN3_1_7B, 1, "cpu", H200_MEASURED)
    assert [s.side for s in plan.segments] == ["cpu"]
    assert (plan.syncs_per_step, plan.launches_per_step, plan.h2d_bytes_per_step) == (0, 0, 0)


def test_gpu_mode_is_one_segment_and_one_sync():
    plan = build_plan(QWEN3_1_7B, 1, "gpu", H200_MEASURED)
    assert [s.side for s in plan.segments] == ["gpu"]
    assert plan.syncs_per_step == 1
    # norms and SiLU·mul are fused into the projections: 6 launches per layer, embed and lm_head
    assert plan.launches_per_step == 28 * 6 + 2 == 170
    assert plan.launches_per_step == sum(op.launches for op in step_ops(QWEN3_1_7B, 1))
    assert plan.h2d_bytes_per_step == 16  # the step's params in: token id, position, KV table row
    assert plan.d2h_bytes_per_step == 151936 * 4  # the logits out


def test_layers_mode_follows_ngl():
    plan = build_plan(QWEN3_1_7B, 1, "layers=10", H200_MEASURED)
    assert plan.mode == "layers=10"
    assert [s.side for s in plan.segments] == ["cpu", "gpu", "cpu"]
    assert plan.syncs_per_step == 1
    assert side_of(plan, "L9.attention") == "gpu" and side_of(plan, "L10.attn_norm") == "cpu"
    assert side_of(plan, "embed") == side_of(plan, "lm_head") == "cpu"
    assert "offloaded 10/28 layers" in plan.notes
    full = build_plan(QWEN3_1_7B, 1, "layers=28", H200_MEASURED)
    assert [s.side for s in full.segments] == ["cpu", "gpu"]  # the output follows all layers
    assert side_of(full, "lm_head") == "gpu" and side_of(full, "embed") == "cpu"
    assert build_plan(QWEN3_1_7B, 1, "layers=99", H200_MEASURED).groups_on_gpu() == \
        full.groups_on_gpu()
    none = build_plan(QWEN3_1_7B, 1, "layers=0", H200_MEASURED)
    assert none.syncs_per_step == 0


def test_auto_mode_picks_by_gpu_presence():
    assert build_plan(QWEN3_1_7B, 1, "auto", None).mode == "cpu"
    assert build_plan(QWEN3_1_7B, 1, "auto", H200_MEASURED).mode == "gpu"
    assert build_plan(QWEN3_1_7B, 1, "auto", H200_MEASURED, gpu_available=False).mode == "cpu"


def test_mode_parsing_errors_name_the_input():
    assert parse_mode("layers=12") == ("layers", 12)
    assert parse_mode("Layers=12+head") == ("layers+head", 12)
    assert mode_name(*parse_mode("layers=12+head")) == "layers=12+head"
    for bad in ("layers=", "layers=-1", "turbo", "layers=+head", "layers=3+tail", "layers=head"):
        with pytest.raises(ValueError, match=r"expected cpu, gated, gpu, auto, offload, layers=N or layers=N\+head"):
            parse_mode(bad)


def test_layers_plus_head_puts_the_output_on_the_gpu_as_llama_cpp_counts_it():
    """llama.cpp's -ngl 14 on a 28-layer model holds 13 layers and the output layer: layers=13+head here,
    the same weights on the device as its layers; layers=14 keeps the output on the host."""
    c = QWEN3_1_7B
    for mode, gpu_layers, head in (("layers=14", 14, False), ("layers=13+head", 13, True),
                                   ("layers=0+head", 0, True), (f"layers={c.num_hidden_layers}+head", 28, True)):
        plan = build_plan(c, 1, mode)
        assert plan.mode == mode
        on_gpu = {p.op.split(".")[0] for p in plan.placements.values() if p.side == "gpu"}
        assert {f"L{i}" for i in range(gpu_layers)} <= on_gpu
        assert f"L{gpu_layers}" not in on_gpu
        assert ("lm_head" in on_gpu) == head and ("final_norm" in on_gpu) == head, mode


def test_fusion_groups_are_one_launch_per_layer_group():
    plan = build_plan(QWEN3_1_7B, 1, "gated", H200_MEASURED)
    place = plan.placements
    q, k, v = (place[f"model.layers.3.self_attn.{x}_proj.weight"] for x in "qkv")
    assert q.op == k.op == v.op == "L3.qkv" and q.group == "qkv"
    gate, up = (place[f"model.layers.3.mlp.{x}_proj.weight"] for x in ("gate", "up"))
    assert gate.op == up.op == "L3.gate_up"
    assert place["model.layers.3.mlp.down_proj.weight"].op == "L3.down"
    gpu_ops = plan.ops_on("gpu")
    assert sum(op.name == "L3.qkv" for op in gpu_ops) == 1  # three weights, one launch


def test_gated_syncs_count_segments_not_projections():
    plan = build_plan(QWEN3_1_7B, 1, "gated", H200_MEASURED)
    # per layer: [o, mlp_norm, gate_up, silu_mul, down, next attn_norm, next qkv] on the GPU,
    # rope + attention on the host (KV cache there); plus the first qkv segment
    assert plan.syncs_per_step == LAYERS + 1
    offloaded_groups = sum(op.is_projection for op in plan.ops_on("gpu"))
    assert offloaded_groups == 4 * LAYERS + 1 and plan.syncs_per_step < offloaded_groups
    assert side_of(plan, "L3.rope") == side_of(plan, "L3.attention") == "cpu"
    assert side_of(plan, "L3.mlp_norm") == side_of(plan, "L3.silu_mul") == "gpu"
    assert side_of(plan, "L4.attn_norm") == side_of(plan, "final_norm") == "gpu"
    assert side_of(plan, "L0.attn_norm") == side_of(plan, "embed") == "cpu"
    segment = next(s for s in plan.segments if any(op.name == "L3.o" for op in s.ops))
    assert [op.name for op in segment.ops] == ["L3.o", "L3.mlp_norm", "L3.gate_up",
                                               "L3.silu_mul", "L3.down", "L4.attn_norm",
                                               "L4.qkv"]
    assert segment.h2d_bytes == 4 * 2048  # the attention output (the residual stays on the device)
    assert segment.d2h_bytes == 4 * (2048 + 2 * 1024)  # q, k, v for the host's attention


def test_seed_threshold_plan_has_one_sync_per_layer():
    plan = build_plan(QWEN3_1_7B, 1, "gated", minflop=1e7)
    # gate_up, silu_mul, down per layer; the last layer's joins final_norm and lm_head
    assert plan.syncs_per_step == LAYERS
    last = plan.segments[-1]
    assert [op.name for op in last.ops][-3:] == ["L27.down", "final_norm", "lm_head"]
    assert side_of(plan, "L3.mlp_norm") == side_of(plan, "L4.attn_norm") == "cpu"


def test_threshold_splitting_a_group_keeps_each_weight_once():
    plan = build_plan(QWEN3_1_7B, 1, "gated", minflop=6e6)  # Q passes, K/V do not
    audit_plan(plan, QWEN3_1_7B)
    gpu_part = next(op for op in plan.ops_on("gpu") if op.name == "L0.qkv[gpu]")
    cpu_part = next(op for op in plan.ops_on("cpu") if op.name == "L0.qkv[cpu]")
    assert [w.name for w in gpu_part.weights] == ["model.layers.0.self_attn.q_proj.weight"]
    assert gpu_part.output_bytes == 4 * 2048 and cpu_part.output_bytes == 4 * 2048


def test_predicted_time_counts_one_round_trip_per_segment():
    seed = build_plan(QWEN3_1_7B, 1, "gated", SEED_LIKE)
    cpu = build_plan(QWEN3_1_7B, 1, "cpu", SEED_LIKE)
    gpu = build_plan(QWEN3_1_7B, 1, "gpu", SEED_LIKE)
    assert gpu.predicted_step_us(SEED_LIKE) < seed.predicted_step_us(SEED_LIKE) < \
        cpu.predicted_step_us(SEED_LIKE)
    streamed = gpu.predicted_step_us(SEED_LIKE, resident_weights=set())
    assert streamed - gpu.predicted_step_us(SEED_LIKE) == pytest.approx(
        gpu.weight_bytes_on("gpu") / (SEED_LIKE.h2d_GBps * 1e3))
