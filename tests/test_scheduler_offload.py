"""The offload placement (scheduler/offload.py): pure arithmetic over the qwen3 presets' shapes and an H200
machine's pool figures: the budget is kept, the roofline is a floor, the split moves with the step size; a
mixture-of-experts model's routers and experts stay on the host, its attention resident where it fits."""
from __future__ import annotations

import dataclasses

import pytest

from kestrel_stream.loading.presets import PRESETS
from scheduler import audit_plan, build_plan, offload
from scheduler.profile import H200_POOL

LAYER_BYTES = {name: sum(offload._layer_items(PRESETS[name])[0][0].values()) for name in ("qwen3-1.7b", "qwen3-8b")}


def budget(name: str, fraction: float) -> int:
    """`fraction` of the layers' weight bytes (llama.cpp's -ngl at that fraction holds one layer fewer and the output
    layer: bench/offload.py's weight_budget_of)."""
    c = PRESETS[name]
    return int(c.num_hidden_layers * fraction) * LAYER_BYTES[name]


@pytest.mark.parametrize("name", ["qwen3-1.7b", "qwen3-8b"])
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_placement_keeps_the_budget_and_the_roofline_is_a_floor(name, fraction):
    c = PRESETS[name]
    p = offload.place(c, budget(name, fraction), H200_POOL)
    assert p.resident_bytes + p.ring_bytes <= p.budget_bytes
    assert len(p.homes) == c.num_hidden_layers and set(p.homes) <= set(offload.HOMES)
    assert p.layers("host") or p.layers("mlp"), "at batch 1 on this pool the host should compute some layers"
    assert p.layers("streamed"), "and the link stream others"
    assert p.roofline_us <= p.predicted.total_us
    assert p.predicted.total_us <= 1.25 * p.roofline_us, p.describe()
    # streaming alone (the window of before) is slower where there is a ring to compare with
    alone = offload.streaming_only(c, p.budget_bytes, H200_POOL)
    assert alone is None or alone.total_us > p.predicted.total_us


def test_more_vram_is_never_slower():
    c = PRESETS["qwen3-1.7b"]
    times = [offload.place(c, budget("qwen3-1.7b", f), H200_POOL).predicted.total_us for f in (0.25, 0.5, 0.75)]
    assert times[0] > times[1] > times[2]


def test_the_split_moves_to_the_ring_as_steps_grow():
    """Streamed bytes are shared by a step's tokens, host compute grows with them: larger steps stream more,
    the resident layers and lm_head stay where they are."""
    c = PRESETS["qwen3-8b"]
    one = offload.place(c, budget("qwen3-8b", 0.5), H200_POOL)
    hosts = []
    for tokens in (1, 16, 64, 256):
        p = offload.place_for_tokens(one, c, H200_POOL, tokens)
        assert p.layers("resident") == one.layers("resident") and p.head == one.head
        hosts.append(p.host_bytes)
    assert hosts == sorted(hosts, reverse=True) and hosts[0] > hosts[-1], hosts
    assert hosts[-1] == 0, "a 256-token step streams every non-resident layer"


def test_a_slow_link_puts_the_work_on_the_host_and_a_slow_host_on_the_link():
    c = PRESETS["qwen3-1.7b"]
    slow_link = dataclasses.replace(H200_POOL, h2d_GBps=0.5, h2d_joint_GBps=0.4)
    slow_host = dataclasses.replace(H200_POOL, host_weight_GBps=0.5, host_joint_GBps=0.4)
    p = offload.place(c, budget("qwen3-1.7b", 0.5), slow_link)
    assert not p.layers("streamed") and p.layers("host")
    q = offload.place(c, budget("qwen3-1.7b", 0.5), slow_host)
    assert not q.host_bytes and q.layers("streamed") and q.head == "resident"


def test_homes_are_spread_evenly():
    homes = offload.spread({"host": 3, "streamed": 6}, 9)
    assert homes.count("host") == 3 and all(homes[i:i + 3].count("host") == 1 for i in (0, 3, 6)), homes


def test_plan_places_every_weight_once_where_the_placement_says():
    c = PRESETS["qwen3-1.7b"]
    p = offload.place(c, budget("qwen3-1.7b", 0.5), H200_POOL)
    plan = build_plan(c, 1, "offload", H200_POOL, offload=p)
    audit_plan(plan, c)
    for name, placement in plan.placements.items():
        if ".layers." in name and name.endswith("proj.weight"):
            layer = int(name.split(".")[2])
            group = next(g for g, part in (("qkv", "self_attn"), ("o", "o_proj"), ("gate_up", "gate_proj"),
                                           ("gate_up", "up_proj"), ("down", "down_proj")) if part in name)
            group = "o" if "o_proj" in name else group
            on_host = offload.group_home(p.homes[layer], group) == "host"
            assert placement.side == ("cpu" if on_host else "gpu"), (name, p.homes[layer])
        if "self_attn" in name and "norm" in name:
            assert placement.side == "gpu", name          # q/k norm: the rope op, on the GPU
    assert plan.placements["model.embed_tokens.weight"].side == ("gpu" if p.head == "resident" else "cpu")
    assert plan.h2d_bytes_per_step >= p.streamed_bytes
    assert "offload, M=1" in "\n".join(plan.notes)


def test_a_budget_of_nothing_is_refused():
    with pytest.raises(ValueError, match="holds nothing"):
        offload.place(PRESETS["qwen3-1.7b"], -1, H200_POOL)


def non_expert_bytes(c) -> int:
    """VRAM of every weight but the experts (and routers): each layer's projections and lm_head."""
    per_layer, _, head_bytes = offload._layer_items(c)
    return sum(sum(groups.values()) for groups in per_layer) + head_bytes


def test_a_moe_model_under_its_non_expert_weights_keeps_attention_resident_and_the_experts_on_the_host():
    """Qwen3-30B-A3B with VRAM for everything but the experts: llama.cpp's -ngl 99 --n-cpu-moe 48."""
    c = PRESETS["qwen3-30b-a3b"]
    p = offload.place(c, non_expert_bytes(c), H200_POOL)
    assert p.homes == ("attention",) * c.num_hidden_layers and p.head == "resident", p.describe()
    assert not p.ring_bytes and not p.streamed_bytes and not p.host_bytes
    assert p.resident_bytes <= p.budget_bytes
    plan = build_plan(c, 1, "offload", H200_POOL, offload=p)
    audit_plan(plan, c)
    groups = [q.group for q in plan.placements.values()]
    assert groups.count("experts") == 3 * c.num_experts * c.num_hidden_layers
    for name, q in plan.placements.items():
        if q.group in ("router", "experts"):
            assert q.side == "cpu", name
        elif q.group in ("qkv", "o", "lm_head") or ".self_attn." in name:
            assert q.side == "gpu", name
    expert_ops = [op for op in plan.ops_on("cpu") if op.kind in ("router", "experts")]
    assert p.routed_bytes == sum(op.weight_bytes for op in expert_ops)
    assert p.routed_read_bytes == sum(op.active_weight_bytes for op in expert_ops) < p.routed_bytes / 10
    # the floor is the experts a token reads out of host memory; the placement is priced above it
    assert offload.PoolRates.of(H200_POOL).best_us(p.routed_read_bytes) <= p.roofline_us <= p.predicted.total_us
    assert "experts on the host" in p.describe()


@pytest.mark.parametrize("fraction", [0.6, 0.25])
def test_a_moe_model_short_of_its_attention_weights_streams_or_hosts_qkv_and_o(fraction):
    c = PRESETS["qwen3-30b-a3b"]
    p = offload.place(c, int(fraction * non_expert_bytes(c)), H200_POOL)
    assert p.resident_bytes + p.ring_bytes <= p.budget_bytes
    assert set(p.homes) <= {"attention", "mlp", "host"}, p.homes      # a routed layer's MLP is on the host
    assert p.layers("attention") and (p.layers("mlp") or p.layers("host")), p.describe()
    for tokens in (16, 64):
        q = offload.place_for_tokens(p, c, H200_POOL, tokens)
        assert q.layers("attention") == p.layers("attention") and q.head == p.head
        assert set(q.homes) <= {"attention", "mlp", "host"}
        assert q.routed_read_bytes > p.routed_read_bytes
    audit_plan(build_plan(c, 7, "offload", H200_POOL, offload=offload.place_for_tokens(p, c, H200_POOL, 7)), c)


def test_the_dense_layers_of_a_moe_model_keep_every_home():
    """Dense layers (mlp_only_layers) between routed ones: their MLP takes VRAM where the routed layers' does
    not, and the budget is kept whichever layers the spread picks."""
    c = dataclasses.replace(PRESETS["qwen3-30b-a3b"], dense_layers=(0, 24))
    per_layer, _, head_bytes = offload._layer_items(c)
    assert sum(per_layer[0].values()) > 2 * sum(per_layer[1].values())
    routed_only = head_bytes + sum(sum(g.values()) for i, g in enumerate(per_layer) if c.moe_layer(i))
    p = offload.place(c, routed_only, H200_POOL)
    assert p.resident_bytes + p.ring_bytes <= p.budget_bytes
    assert all(h in ("attention", "mlp", "host") for i, h in enumerate(p.homes) if c.moe_layer(i)), p.homes
    assert p.layers("attention")
    audit_plan(build_plan(c, 1, "offload", H200_POOL, offload=p), c)
    whole = offload.place(c, non_expert_bytes(c), H200_POOL)
    assert whole.homes == tuple("resident" if i in (0, 24) else "attention" for i in range(c.num_hidden_layers))
    assert all(offload.group_home(whole.homes[0], g) == "resident" for g in ("qkv", "o", "gate_up", "down"))


def test_the_resident_layers_fit_whichever_the_spread_picks():
    for layer_bytes, room in (((3, 1, 1), 2), ((1, 3, 1), 2), ((1, 3, 1), 4), ((2, 2, 2), 5)):
        base = offload._resident_base(layer_bytes, room)
        assert sum(b for b, h in zip(layer_bytes, base) if h == "resident") <= room, (layer_bytes, room, base)
    assert offload._resident_base((1, 3, 1), 2) == ("resident", "other", "resident")


def test_homes_given_to_a_moe_model_name_what_its_routed_layers_do():
    """KESTREL_OFFLOAD_HOMES: A (qkv and o resident, the MLP on the host) for any layer; R and S of a routed
    layer are A and M, its experts being on the host whatever the letter."""
    c = PRESETS["qwen3-moe-tiny"]
    homes, head = offload.parse_homes("RAS:host", c.num_hidden_layers)
    assert homes == ("resident", "attention", "streamed") and head == "host"
    p = offload.place_given(c, non_expert_bytes(c), H200_POOL, homes, head)
    assert p.homes == ("attention", "attention", "mlp")
    assert offload.group_home("attention", "qkv") == offload.group_home("attention", "o") == "resident"
    assert offload.group_home("attention", "gate_up") == offload.group_home("resident", "experts") == "host"
    assert "A qkv and o resident" in offload.LETTERS_KEY


def test_a_format_slower_on_the_host_moves_its_bytes_to_the_link():
    """Q4_K's host mat-vec decodes more per byte than Q8_0's: at its measured rate the placement computes
    fewer Q4_K layers on the host, and the predicted step is no faster than at the pool's rate."""
    c = dataclasses.replace(PRESETS["qwen3-1.7b"], weight_formats=tuple(
        (f"model.layers.{i}.{name}.weight", "Q4_K") for i in range(28)
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")))
    fast = offload.place(c, budget("qwen3-1.7b", 0.5) // 2, H200_POOL)
    slow_profile = dataclasses.replace(H200_POOL, host_format_GBps={"Q4_K": H200_POOL.host_weight_GBps / 4})
    slow = offload.place(c, budget("qwen3-1.7b", 0.5) // 2, slow_profile)
    on_host = lambda p: sum(home in ("host", "mlp", "attention") for home in p.homes)   # noqa: E731
    assert on_host(fast) > 0
    assert on_host(slow) < on_host(fast), (fast.describe(), slow.describe())
    assert slow.predicted.total_us >= fast.predicted.total_us


# a host whose Q8_0 kernel reads memory at one token and turns compute-bound from two (the H200 host's Q4_K at 16
# threads ran 110 GB/s at one token and 5.3 GB/s at 64: about 0.08 ms a token per 28 MB layer)
COMPUTE_BOUND = [[1, 72.0], [2, 40.0], [4, 20.0], [8, 10.0], [16, 5.0], [32, 2.5]]


def test_the_kernels_measured_rate_by_tokens_prices_a_few_token_step():
    """With each format's measured kernel rate at M tokens (host_format_tokens_GBps), a host op of a step of
    several tokens costs what that rate says, not its FLOPs at host_gflops: the predicted step of 9 tokens
    grows, the placement moves bytes from the host to the link, and one token is priced as before."""
    c = PRESETS["qwen3-1.7b"]
    measured = dataclasses.replace(H200_POOL, host_format_tokens_GBps={"Q8_0": COMPUTE_BOUND})
    one = offload.place(c, budget("qwen3-1.7b", 0.5), H200_POOL)
    one_measured = offload.place(c, budget("qwen3-1.7b", 0.5), measured)
    assert one_measured.homes == one.homes
    assert one_measured.predicted.total_us == pytest.approx(one.predicted.total_us, rel=0.02)
    nine = offload.place_for_tokens(one, c, H200_POOL, 9)
    nine_measured = offload.place_for_tokens(one_measured, c, measured, 9)
    assert nine_measured.host_bytes < nine.host_bytes, (nine.describe(), nine_measured.describe())
    # the measured host is slower at 9 tokens: whatever the split, the step is predicted slower
    assert nine_measured.predicted.total_us > nine.predicted.total_us
    assert nine_measured.layers("resident") == one.layers("resident") and nine_measured.head == one.head


def test_a_kernel_rate_between_measured_sizes_is_interpolated_in_time():
    from scheduler.step_sim import kernel_GBps
    assert kernel_GBps(COMPUTE_BOUND, 1) == 72.0 and kernel_GBps(COMPUTE_BOUND, 8) == 10.0
    assert kernel_GBps(COMPUTE_BOUND, 6) == pytest.approx(1 / (0.5 / 20.0 + 0.5 / 10.0))
    assert kernel_GBps(COMPUTE_BOUND, 64) == pytest.approx(1.25)       # past 32 tokens: time grows with them
    flat = [[1, 50.0], [8, 10.0], [16, 10.0]]                           # 16 token lanes: 8 cost what 16 do
    assert kernel_GBps(flat, 12) == pytest.approx(10.0)


@pytest.mark.parametrize("curve", [[[2, 10.0]], [[1, 10.0], [1, 9.0]], [[1, 10.0], [4, -1.0]], [[1, 10.0], [2.5, 9.0]],
                                   [1, 10.0], []])
def test_a_malformed_kernel_curve_is_refused(curve):
    with pytest.raises(ValueError, match=r"host_format_tokens_GBps\['Q4_K'\]"):
        dataclasses.replace(H200_POOL, host_format_tokens_GBps={"Q4_K": curve})


def test_the_kernel_curves_survive_the_profile_cache(tmp_path):
    from scheduler.profile import load_profile, save_profile
    profile = dataclasses.replace(H200_POOL, host_format_tokens_GBps={"Q8_0": COMPUTE_BOUND})
    save_profile(profile, tmp_path)
    assert load_profile(profile.name, profile.driver, tmp_path) == profile
