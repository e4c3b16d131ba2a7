"""Mixture-of-experts models on the CPU engine: Qwen3-MoE and Mixtral against transformers, routing ties,
GGUF twins, the plan's audit of every expert, experts used by none, one or all tokens of a step, and the
refusal of the device modes that would put them on the GPU."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import scheduler
from bench.synthetic import random_blocks, random_q8_weights
from kestrel_stream.cli.plan import read_config
from kestrel_stream.loading.loader import load_weights
from kestrel_stream.loading.presets import PRESETS, make_model
from kestrel_stream.model.quant4 import BlockTensor
from kestrel_stream.model.weights import hf_tensor_shapes
from kestrel_stream.obs import trace
from kestrel_stream.options import Options
from kestrel_stream.run.host.arithmetic import rmsnorm, route, silu_mul
from kestrel_stream.run.host.backend import HostBackend
from kestrel_stream.run.engine import Engine
from kestrel_stream.run.host.program import HostProgram, HostState
from kestrel_stream.run.step_executor import StepExecutor
from scheduler.moe import expected_experts, expert_names

from gguf_export import export_gguf
from hf_oracle import assert_logits_match, hf_logits, hf_model_with_weights, relative_error
from test_cli import run_cli

PRESETS_MOE = ("qwen3-moe-tiny", "mixtral-tiny")
PROMPT = [3, 17, 42, 5, 99, 1, 250, 7, 64, 31]
NUMPY = Options.from_env().with_(host_kernels="numpy")     # the reference arithmetic the oracle holds


@pytest.fixture(scope="module", params=PRESETS_MOE)
def moe_model(request, tmp_path_factory):
    return make_model(tmp_path_factory.mktemp(request.param), request.param, seed=5, dtype="f32")


def numpy_engine(path) -> Engine:
    """The CPU engine on the numpy reference arithmetic (what the oracle holds to 2e-3)."""
    return Engine(load_weights(path), device="cpu", options=NUMPY)


def prefill_and_decode(engine, prompt, steps: int):
    session = engine.new_session()
    out, tokens = [session.prefill(prompt)], list(prompt)
    for _ in range(steps):
        tokens.append(int(np.argmax(out[-1][-1])))
        out.append(session.decode(tokens[-1])[None])
    return np.concatenate(out), tokens


@pytest.mark.parametrize("normalize", [True, False])
def test_moe_models_match_transformers(moe_model, tmp_path, normalize):
    model_dir = moe_model
    if not normalize:                       # Qwen3-MoE without renormalized top-k weights (HF's default)
        cfg = json.loads((moe_model / "config.json").read_text())
        if cfg["model_type"] != "qwen3_moe":
            pytest.skip("Mixtral always renormalizes")
        model_dir = tmp_path / "unnormalized"
        model_dir.mkdir()
        for f in moe_model.glob("*.safetensors"):
            (model_dir / f.name).symlink_to(f)
        (model_dir / "config.json").write_text(json.dumps(dict(cfg, norm_topk_prob=False)))
    engine = numpy_engine(model_dir)
    assert engine.config.norm_topk_prob == normalize
    ours, tokens = prefill_and_decode(engine, PROMPT, 6)
    reference = hf_logits(hf_model_with_weights(model_dir, engine.weights), tokens)
    assert_logits_match(ours, reference)
    if not normalize:                       # the flag is live: renormalizing moves the logits far past 2e-3
        normalized = numpy_engine(moe_model).new_session().prefill(PROMPT)
        assert relative_error(normalized, ours[:len(PROMPT)]) > 1e-2


def test_a_batch_of_sessions_equals_each_alone(moe_model):
    """Tokens of several sessions share one step's experts; each session's logits are its own."""
    engine = numpy_engine(moe_model)
    alone = [engine.new_session().prefill(p) for p in (PROMPT, PROMPT[3:], [9])]
    kvs = [engine.executor.alloc_kv(64) for _ in range(3)]
    together = engine.executor.forward([(kv, np.array(p), 0) for kv, p in zip(kvs, (PROMPT, PROMPT[3:], [9]))])
    for a, b in zip(alone, together):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(a).max())


def test_the_host_runs_a_moe_plans_ops_in_its_order(moe_model, tmp_path):
    """router and experts are entries of the host backend's table: a step runs the plan's ops, no others."""
    engine = numpy_engine(moe_model)
    session = engine.new_session()
    session.prefill([3, 1, 4])
    path = tmp_path / "step.json"
    trace.start(path)
    try:
        session.prefill([5, 6, 7, 8, 9])
    finally:
        trace.stop()
    ran = [(e["name"], e["args"]["layer"]) for e in json.loads(path.read_text())["traceEvents"]
           if e.get("ph") == "X" and e.get("cat") == "host" and "op" in e.get("args", {})]
    plans = [[(op.group or op.kind, -1 if op.layer is None else op.layer) for op in engine.executor.plan(t).ops_on("cpu")
              if scheduler.runs_alone(op)] for t in (1, 5, 64)]
    assert ran == plans[0] == plans[1] == plans[2]
    routed = [i for i in range(engine.config.num_hidden_layers) if engine.config.moe_layer(i)]
    assert [layer for kind, layer in ran if kind == "router"] == [layer for kind, layer in ran if kind == "experts"] == routed


def test_random_q8_weights_of_a_moe_preset_run():
    weights = random_q8_weights("qwen3-moe-tiny", seed=1)
    logits = Engine(weights, device="cpu", options=NUMPY).new_session().prefill(PROMPT)
    assert np.isfinite(logits).all() and logits.std() > 0


def test_routing_ties_go_to_the_lowest_expert():
    logits = np.array([[1.0, 3.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 5.0, 0.0, 5.0]], np.float32)
    for softmax_first in (True, False):
        ids, weights = route(logits, 2, softmax_first, True)
        np.testing.assert_array_equal(ids, [[1, 2], [0, 1], [2, 4]])
        np.testing.assert_allclose(weights, 0.5, rtol=1e-6)
    ids, weights = route(logits, 3, True, False)       # softmax over all five, not renormalized
    np.testing.assert_array_equal(ids, [[1, 2, 3], [0, 1, 2], [2, 4, 0]])
    np.testing.assert_allclose(weights[1], 0.2, rtol=1e-6)


def test_a_silent_router_sends_every_token_to_the_first_experts(moe_model):
    """A router of zeros ties every expert: each token uses experts 0..k-1, weighted equally."""
    weights = load_weights(moe_model)
    layer = next(i for i, lw in enumerate(weights.layers) if lw.moe is not None)
    weights.layers[layer].moe.router = np.zeros_like(weights.layers[layer].moe.router)
    backend = HostBackend(weights, options=NUMPY)
    router = next(op for op in backend.plan(4).segments[0].ops if op.name == f"L{layer}.router")
    state = HostState(np.arange(4), [], None, None)
    state.write("x", np.random.default_rng(0).standard_normal((4, weights.config.hidden_size)).astype(np.float32))
    HostProgram(backend, [router]).run(state)
    k = weights.config.num_experts_per_tok
    np.testing.assert_array_equal(state.read("route")[:, :k], np.tile(np.arange(k), (4, 1)))
    np.testing.assert_allclose(state.read("route")[:, k:], 1.0 / k, rtol=1e-6)


def reference_experts(weights, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x plus, token by token, the chosen experts' MLPs on the dequantized weights, weighted."""
    c, lw = weights.config, weights.layers[layer]
    gate_up, down, inter = lw.moe.gate_up.dequantize(), lw.moe.down.dequantize(), c.moe_intermediate_size
    xn = rmsnorm(x, np.asarray(lw.mlp_norm, np.float32), c.rms_norm_eps)
    out = x.copy()
    for t in range(len(x)):
        for e, weight in zip(ids[t], w[t]):
            h = gate_up[e * 2 * inter:(e + 1) * 2 * inter] @ xn[t]
            out[t] += weight * (down[e * c.hidden_size:(e + 1) * c.hidden_size] @ silu_mul(h[:inter], h[inter:]))
    return out


def run_experts(weights, layer: int, x, ids, w, options):
    backend = HostBackend(weights, options=options)
    op = next(op for op in backend.plan(len(x)).segments[0].ops if op.name == f"L{layer}.experts")
    state = HostState(np.arange(len(x)), [], None, None)
    state.write("x", x)
    state.write("route", np.concatenate([ids.astype(np.float32), w], axis=1))
    HostProgram(backend, [op]).run(state)
    return state.read("x"), backend.counters.cpu_weight_read_bytes


@pytest.mark.parametrize("kernels", ["numpy", "native"])
def test_experts_used_by_no_token_one_token_and_every_token(moe_model, kernels):
    weights = load_weights(moe_model)
    c = weights.config
    layer = next(i for i, lw in enumerate(weights.layers) if lw.moe is not None)
    T = 6
    x = np.random.default_rng(1).standard_normal((T, c.hidden_size)).astype(np.float32)
    last = c.num_experts - 1           # expert 0: every token; expert `last`: token 2 alone; the rest: none
    ids = np.array([[0, last if t == 2 else 1] for t in range(T)])
    w = np.random.default_rng(2).uniform(0.1, 1.0, ids.shape).astype(np.float32)
    options = NUMPY if kernels == "numpy" else Options.from_env().with_(host_kernels="native")
    got, read_bytes = run_experts(weights, layer, x, ids, w, options)
    expected = reference_experts(weights, layer, x, ids, w)
    tolerance = 1e-5 if kernels == "numpy" else 3e-2   # the native kernels quantize activations per block
    np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance * np.abs(expected).max())
    assert read_bytes == 3 * weights.layers[layer].moe.nbytes // c.num_experts       # experts 0, 1, last


def test_experts_stay_in_their_gguf_blocks(tmp_path):
    """Q4_K gate/up and Q6_K down experts are read as the file's blocks, and run as the source weights do."""
    cfg = dataclasses.replace(PRESETS["qwen3-moe-tiny"], hidden_size=256, moe_intermediate_size=256,
                              num_hidden_layers=2, dense_layers=())
    source = load_weights(make_model(tmp_path / "hf", cfg, seed=3, dtype="f32"), cache=False)
    rng = np.random.default_rng(4)
    for lw in source.layers:
        E = lw.moe.experts
        lw.moe.gate_up = BlockTensor("Q4_K", random_blocks(rng, "Q4_K", E * 512, 256, 1 / 16), 256)
        lw.moe.down = BlockTensor("Q6_K", random_blocks(rng, "Q6_K", E * 256, 256, 1 / 64), 256)
    path = export_gguf(source, tmp_path / "blocks.gguf")
    loaded = load_weights(path, cache=False)
    for a, b in zip(source.layers, loaded.layers):
        assert isinstance(b.moe.gate_up, BlockTensor) and b.moe.gate_up.fmt == "Q4_K"
        assert isinstance(b.moe.down, BlockTensor) and b.moe.down.fmt == "Q6_K"
        np.testing.assert_array_equal(b.moe.gate_up.blocks, a.moe.gate_up.blocks)
        np.testing.assert_array_equal(b.moe.down.blocks, a.moe.down.blocks)
    assert read_config(str(path)).weight_formats == loaded.config.weight_formats     # what `plan` costs
    formats = dict(loaded.config.weight_formats)
    gate, up, down = expert_names(cfg, 1, 3)
    assert (formats[gate], formats[up], formats[down]) == ("Q4_K", "Q4_K", "Q6_K")
    engine = numpy_engine(path)
    reference = HostBackend(source, options=NUMPY)
    np.testing.assert_array_equal(engine.new_session().prefill(PROMPT),
                                  reference.forward([(reference.alloc_kv(32), np.array(PROMPT), 0)])[0])


def test_gguf_of_each_architecture_equals_its_hugging_face_twin(moe_model, tmp_path):
    hf = numpy_engine(moe_model)
    path = export_gguf(hf.weights, tmp_path / "twin.gguf")
    gguf = numpy_engine(path)
    assert gguf.config == hf.config
    np.testing.assert_array_equal(prefill_and_decode(gguf, PROMPT, 3)[0], prefill_and_decode(hf, PROMPT, 3)[0])


def test_the_quantized_cache_keeps_the_experts(moe_model):
    first = numpy_engine(moe_model)
    again = numpy_engine(moe_model)
    assert again.weights.extra["qcache"]["hit"]
    np.testing.assert_array_equal(again.new_session().prefill(PROMPT), first.new_session().prefill(PROMPT))


@pytest.mark.parametrize("preset", PRESETS_MOE + ("qwen3-30b-a3b",))
@pytest.mark.parametrize("mode", ["cpu", "gated", "layers=1"])
def test_every_expert_is_placed_exactly_once(preset, mode):
    cfg = PRESETS[preset]
    routed = [i for i in range(cfg.num_hidden_layers) if cfg.moe_layer(i)]
    for tokens in (1, 7):
        plan = scheduler.build_plan(cfg, tokens, mode, scheduler.H200_MEASURED, gpu_available=True)
        scheduler.audit_plan(plan, cfg)
        groups = [p.group for p in plan.placements.values()]
        assert groups.count("experts") == 3 * cfg.num_experts * len(routed)
        assert groups.count("router") == len(routed)
        assert (mode == "cpu") != any("mixture of experts" in note for note in plan.notes)
    assert expert_names(cfg, routed[-1], cfg.num_experts - 1)[2] in plan.describe()


def test_the_30b_preset_has_qwen3_30b_a3bs_shape():
    cfg = PRESETS["qwen3-30b-a3b"]
    shapes = hf_tensor_shapes(cfg)
    total = sum(int(np.prod(s)) for s in shapes.values())
    expert = sum(int(np.prod(s)) for name, s in shapes.items() if ".experts." in name) // cfg.num_experts
    active = total - expert * (cfg.num_experts - cfg.num_experts_per_tok)
    assert 30.4e9 < total < 30.6e9 and 3.2e9 < active < 3.4e9          # "30B-A3B"
    assert len([n for n in shapes if ".experts." in n]) == 48 * 128 * 3


@pytest.mark.parametrize("tokens", [1, 4, 64])
def test_the_experts_op_costs_the_experts_a_step_reads(tokens):
    cfg = PRESETS["qwen3-30b-a3b"]
    H, I, E, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    op = next(op for op in scheduler.step_ops(cfg, tokens) if op.name == "L0.experts")
    expert_bytes = 3 * I * H * 34 // 32
    active = expected_experts(E, k, tokens)
    assert op.read_weight_bytes(tokens) == pytest.approx(active * expert_bytes, rel=1e-6)
    assert op.weight_bytes == E * expert_bytes
    assert sum(w.flops for w in op.weights) == pytest.approx(2 * tokens * k * 3 * I * H)
    if tokens == 1:
        assert active == pytest.approx(k)


@pytest.mark.parametrize("tokens", [1, 4])
def test_the_host_experts_are_priced_at_their_formats_rate_and_bytes(tokens):
    """A routed layer's host time in the offload cost model: the expert bytes a step is expected to read at
    the measured rate of their format (calibrate's host_format_GBps), plus its pool jobs inside the segment's
    one native call; not one call per expert (host_moe.c runs every chosen expert of a decode step in one
    job), so a slow call from Python does not move it."""
    from scheduler.profile import H200_POOL
    from scheduler.step_sim import HOST_OP_US, PoolRates, op_costs, routed_jobs
    cfg = PRESETS["qwen3-30b-a3b"]
    op = next(op for op in scheduler.step_ops(cfg, tokens) if op.name == "L0.experts")
    moved, jobs_us = op.input_bytes + op.output_bytes, routed_jobs(cfg, "experts", tokens) * HOST_OP_US
    assert routed_jobs(cfg, "experts", tokens) == 1 and routed_jobs(cfg, "experts", 512) > 100

    def experts_us(q8_GBps: float, call_us: float) -> float:
        profile = dataclasses.replace(H200_POOL, host_weight_GBps=90.0, host_call_us=call_us,
                                      host_format_GBps={"Q8_0": q8_GBps})
        costs = op_costs(cfg, tokens, 0, profile, PoolRates.of(profile))
        return next(c.host_us for c in costs if c.layer == 0 and c.group == "experts")

    for rate in (40.0, 69.0):
        expect = (op.read_weight_bytes(tokens) + moved * rate / 90.0) / (rate * 1e3) + jobs_us
        assert experts_us(rate, 8.0) == pytest.approx(expect, rel=1e-6)
        assert experts_us(rate, 45.0) == pytest.approx(expect, rel=1e-6)
    per_mb = (experts_us(69.0, 8.0) - jobs_us) / (op.read_weight_bytes(tokens) / 1e6)
    assert per_mb == pytest.approx(1e6 / 69e3, rel=1e-3)       # µs a MB at 69 GB/s


def test_resident_experts_take_their_share_off_the_host_prediction():
    """Mode offload's resident experts (chosen after the layers are placed) take their share of the choices
    off the host: the predicted host time drops by that share of the expert bytes at the format's rate."""
    from scheduler import offload
    from scheduler.profile import H200_POOL
    cfg = PRESETS["qwen3-30b-a3b"]
    profile = dataclasses.replace(H200_POOL, host_call_us=22.0, host_format_GBps={"Q8_0": 69.0})
    placement = offload.place_given(cfg, 5 * 10**9, profile, ("attention",) * cfg.num_hidden_layers, "resident")
    shared = offload.with_resident_experts(placement, cfg, profile, 0.1)
    experts = sum(op.active_weight_bytes for op in scheduler.step_ops(cfg, 1) if op.kind == "experts")
    assert placement.routed_read_bytes - shared.routed_read_bytes == pytest.approx(0.1 * experts, rel=1e-6)
    saved_us = placement.predicted.host_busy_us - shared.predicted.host_busy_us
    assert saved_us == pytest.approx(0.1 * experts / 69e3, rel=0.02)
    assert shared.homes == placement.homes and shared.slot_count == placement.slot_count


def test_plan_lists_every_expert_of_a_checkpoint(moe_model):
    from safetensors import safe_open
    plan = json.loads(run_cli("plan", "--model", str(moe_model), "--mode", "cpu", "--json").stdout)
    with safe_open(str(moe_model / "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
    assert sorted(row["weight"] for row in plan["weights"]) == sorted(names)


@pytest.mark.parametrize("mode", ["gated", "layers=1"])
def test_gated_and_layers_modes_refuse_a_moe_model(moe_model, mode):
    """Their plans would place router and experts by a gate or a layer count; mode offload (which gpu mode
    becomes for these models where the experts do not fit: test_moe_offload_emulated.py) and gpu mode place
    them."""
    weights = load_weights(moe_model)
    with pytest.raises(ValueError, match=rf"\({weights.config.arch}\).*do not place: run it in mode offload"):
        StepExecutor(weights, mode)


@pytest.mark.parametrize("preset", PRESETS_MOE)
def test_the_bench_gguf_writer_writes_moe_presets_as_llama_cpp_does(preset, tmp_path):
    """bench/make_gguf.py: the router, the 3-D expert tensors and the expert keys; the file loads as its
    preset and runs."""
    from bench.make_gguf import write as write_gguf
    from gguf import GGUFReader
    path = tmp_path / f"{preset}.gguf"
    types = write_gguf(preset, None, str(path), seed=1)
    cfg, loaded = PRESETS[preset], load_weights(path, cache=False).config
    for field in ("arch", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "dense_layers",
                  "hidden_size", "num_hidden_layers"):
        assert getattr(loaded, field) == getattr(cfg, field), field
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    routed = [i for i in range(cfg.num_hidden_layers) if cfg.moe_layer(i)]
    assert [int(n.split(".")[1]) for n in tensors if n.endswith("ffn_gate_exps.weight")] == routed
    assert tuple(int(d) for d in tensors[f"blk.{routed[0]}.ffn_down_exps.weight"].shape) == \
        (cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts)        # GGUF lists dims innermost first
    assert types[f"blk.{routed[0]}.ffn_up_exps.weight"] == "Q8_0"
    logits = Engine(load_weights(path, cache=False), device="cpu", options=NUMPY).new_session().prefill(PROMPT)
    assert np.isfinite(logits).all() and logits.std() > 0


def test_the_bench_gguf_writer_keeps_llama_cpps_q4_k_m_rule_for_the_experts():
    from bench.make_gguf import tensor_type
    assert tensor_type("q4_k_m", "blk.2.ffn_down_exps.weight", 48, False) == "Q6_K"
    assert tensor_type("q4_k_m", "blk.7.ffn_down_exps.weight", 48, False) == "Q4_K"
    assert tensor_type("q4_k_m", "blk.2.ffn_gate_exps.weight", 48, False) == "Q4_K"
