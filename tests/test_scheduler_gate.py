"""The offload gate: the seed's FLOP threshold, the cost model over fused groups, profiles."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kestrel_stream.model.config import ModelConfig
from scheduler import (H200_MEASURED, SEED_LIKE, DeviceProfile, Gate, build_plan,
                       enumerate_group_plans, gate_vs_best, load_profile,
                       profile_cache_path, save_profile, step_ops)

QWEN3_1_7B = ModelConfig(arch="qwen3", hidden_size=2048, intermediate_size=6144,
                         num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=128, vocab_size=151936, tie_word_embeddings=True)
L0 = "model.layers.0."
SMALL = [L0 + "self_attn.q_proj.weight", L0 + "self_attn.k_proj.weight",
         L0 + "self_attn.v_proj.weight", L0 + "self_attn.o_proj.weight"]
LARGE = [L0 + "mlp.gate_proj.weight", L0 + "mlp.up_proj.weight", L0 + "mlp.down_proj.weight",
         "model.embed_tokens.weight"]  # tied: this tensor is lm_head's weight


def op_named(name, tokens=1):
    return next(op for op in step_ops(QWEN3_1_7B, tokens) if op.name == name)


def test_seed_threshold_keeps_small_projections_on_host_at_m1():
    plan = build_plan(QWEN3_1_7B, 1, "gated", minflop=1e7)
    place = plan.placements
    assert place[L0 + "self_attn.q_proj.weight"].flops == pytest.approx(8.4e6, rel=0.01)
    assert place[L0 + "self_attn.k_proj.weight"].flops == pytest.approx(4.2e6, rel=0.01)
    assert place[L0 + "self_attn.o_proj.weight"].flops == pytest.approx(8.4e6, rel=0.01)
    assert [place[w].side for w in SMALL] == ["cpu"] * 4
    assert [place[w].side for w in LARGE] == ["gpu"] * 4
    assert "< 1e+07" in place[SMALL[0]].reason
    for layer in range(QWEN3_1_7B.num_hidden_layers):  # same verdict in every layer
        assert place[f"model.layers.{layer}.self_attn.q_proj.weight"].side == "cpu"
        assert place[f"model.layers.{layer}.mlp.down_proj.weight"].side == "gpu"


def test_seed_threshold_offloads_everything_at_m32():
    plan = build_plan(QWEN3_1_7B, 32, "gated", minflop=1e7)
    projections = [p for p in plan.placements.values() if p.group in
                   ("qkv", "o", "gate_up", "down", "lm_head")]
    assert len(projections) == 28 * 7 + 1
    assert all(p.side == "gpu" for p in projections)


def test_minflop_from_environment_and_explicit_argument_wins():
    from kestrel_stream.options import Options
    minflop = Options.from_env({"KESTREL_MINFLOP": "1e7"}).minflop
    assert minflop == 1e7 and Options.from_env({}).minflop is None
    from_env = build_plan(QWEN3_1_7B, 1, "gated", H200_MEASURED, minflop=minflop)
    assert from_env.placements[SMALL[0]].side == "cpu"  # the threshold replaces the model
    explicit = build_plan(QWEN3_1_7B, 1, "gated", H200_MEASURED, minflop=1e6)
    assert explicit.placements[SMALL[0]].side == "gpu"
    with pytest.raises(ValueError, match="KESTREL_MINFLOP"):
        Options.from_env({"KESTREL_MINFLOP": "lots"})


def test_gated_without_profile_or_threshold_is_a_clear_error():
    with pytest.raises(ValueError, match="calibrate"):
        build_plan(QWEN3_1_7B, 1, "gated", None)


def test_cost_gate_judges_fused_groups_not_single_projections():
    qkv = op_named("L0.qkv")
    gate = Gate(SEED_LIKE)
    alone = {w.name: gate.decide(qkv.subset({w.name}, "alone"))[w.name] for w in qkv.weights}
    assert not any(d.on_gpu for d in alone.values()), [d.reason for d in alone.values()]
    together = gate.decide(qkv)
    assert all(d.on_gpu for d in together.values())  # one round trip shared by three
    decision = together[qkv.weights[0].name]
    assert decision.gpu_us < decision.host_us
    assert "fused qkv x3" in decision.reason and "round trip 100.0" in decision.reason
    # the H200's 20 us round trip: each member already wins alone
    h200 = Gate(H200_MEASURED)
    assert all(h200.decide(qkv.subset({w.name}, "alone"))[w.name].on_gpu for w in qkv.weights)


def test_plans_differ_between_seed_and_h200_round_trips():
    seed = build_plan(QWEN3_1_7B, 1, "gated", SEED_LIKE, segment_aware=False)
    h200 = build_plan(QWEN3_1_7B, 1, "gated", H200_MEASURED, segment_aware=False)
    o_proj = SMALL[3]
    assert seed.placements[o_proj].side == "cpu"   # o alone: 104 us on the GPU vs 93 on host
    assert h200.placements[o_proj].side == "gpu"
    assert seed.placements[SMALL[0]].side == h200.placements[SMALL[0]].side == "gpu"
    assert seed.groups_on_gpu() != h200.groups_on_gpu()


def test_segment_aware_pass_takes_a_group_that_joins_a_gpu_segment():
    plan = build_plan(QWEN3_1_7B, 1, "gated", SEED_LIKE)
    o_proj = plan.placements[SMALL[3]]
    assert o_proj.side == "gpu"
    assert "host wins" in o_proj.reason and "in place -> gpu" in o_proj.reason
    assert any(note.startswith("segment-aware: o -> gpu") for note in plan.notes)


@pytest.mark.parametrize("profile", [SEED_LIKE, H200_MEASURED], ids=["seed", "h200"])
@pytest.mark.parametrize("tokens", [1, 32])
def test_gate_decisions_and_best_plan(profile, tokens):
    plan = build_plan(QWEN3_1_7B, tokens, "gated", profile)
    assert all(plan.groups_on_gpu().values())  # 1.7B shapes: every group pays off
    comparison = gate_vs_best(QWEN3_1_7B, tokens, profile)
    assert comparison["gate_over_best"] <= 1.05


def test_weights_not_resident_pay_their_upload():
    qkv = op_named("L0.qkv")
    resident = Gate(SEED_LIKE).decide(qkv)[qkv.weights[0].name]
    streamed = Gate(SEED_LIKE, resident_weights=set()).decide(qkv)[qkv.weights[0].name]
    assert streamed.gpu_us - resident.gpu_us == pytest.approx(qkv.weight_bytes / 25e3)
    assert "upload" in streamed.reason and not streamed.on_gpu


def test_enumerate_group_plans_covers_every_combination():
    results = enumerate_group_plans(QWEN3_1_7B, 1, H200_MEASURED)
    assert len(results) == 32
    assert len({tuple(r.choice.values()) for r in results}) == 32
    times = [r.predicted_us for r in results]
    assert times == sorted(times)
    all_off = next(r for r in results if not any(r.choice.values()))
    assert all_off.syncs_per_step == 0 and all_off.launches_per_step == 0
    all_on = next(r for r in results if all(r.choice.values()))
    assert all_on.syncs_per_step == 28 + 1


def test_profile_round_trip_and_cache(tmp_path):
    assert DeviceProfile.from_dict(json.loads(json.dumps(H200_MEASURED.to_dict()))) == H200_MEASURED
    assert load_profile("NVIDIA H200", "13.0", tmp_path) is None
    measured = replace(H200_MEASURED, round_trip_us=18.0, host_weight_GBps=31.5)
    path = save_profile(measured, tmp_path)
    assert path == profile_cache_path("NVIDIA H200", "13.0", tmp_path)
    assert load_profile("NVIDIA H200", "13.0", tmp_path) == measured
    assert load_profile("NVIDIA H200", "13.1", tmp_path) is None  # a new driver re-measures


def test_profile_rejects_bad_numbers_and_missing_fields():
    with pytest.raises(ValueError, match="round_trip_us"):
        replace(H200_MEASURED, round_trip_us=0)
    data = H200_MEASURED.to_dict()
    del data["h2d_GBps"]
    with pytest.raises(ValueError, match="h2d_GBps"):
        DeviceProfile.from_dict(data)
