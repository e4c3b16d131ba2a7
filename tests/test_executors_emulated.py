"""The GPU executors, run on the numpy device emulation (fake_cuda), against the CPU engine.

No GPU needed: every driver call and every kernel of kernels_ptx runs as its
numpy twin, under the "deferred" stream policy (device work runs only when the
host synchronizes or a stream waits on it), so a missing sync or a host write
racing a queued upload shows up as wrong logits.  Per executor configuration:
a 12-token prefill (q8_matmul) and a 5-token one (q8_gemv_m5), 8 decode steps
each; logits within 2e-3 relative with identical argmax; `gpu` mode costs one
host sync per decode step, the split modes one per GPU segment of plan(1).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fake_cuda
import scheduler
from kestrel_stream.obs import prof
from hf_oracle import assert_logits_match, relative_error
from kestrel_stream.run.device.budget import budget_for_weight_fraction, gpu_mode_needs
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.run.compat import DEFAULT_MAX_SESSIONS, GpuExecutor
from kestrel_stream.run.compat import HybridExecutor
from kestrel_stream.run.engine import Engine
from bench.synthetic import random_q8_weights

CONFIGS = {
    "qwen3": ModelConfig(arch="qwen3", hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                         max_position_embeddings=512),
    "llama": ModelConfig(arch="llama", hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=64, vocab_size=384,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                         max_position_embeddings=512),
}
PROMPTS = ([5, 3, 200, 17, 42, 8, 1, 99, 250, 7, 64, 31], [9, 8, 7, 6, 5])
DECODE_STEPS = 8
MAX_SEQ_LEN, MAX_BATCH = 32, 4
# a link so fast that the cost model offloads the bigger groups of these small models
FAST_LINK = dataclasses.replace(scheduler.H200_MEASURED, round_trip_us=1.0, host_weight_GBps=0.5,
                                host_gflops=5.0, gpu_launch_us=0.5)


def run(engine, prompt):
    """(logits of prefill + every decode step, host syncs per decode step)."""
    s = engine.new_session()
    steps = [s.prefill(prompt)]
    token = int(np.argmax(steps[0][-1]))
    before = engine.executor.stats["syncs"]
    for _ in range(DECODE_STEPS):
        steps.append(s.decode(token)[None])
        token = int(np.argmax(steps[-1][-1]))
    syncs = engine.executor.stats["syncs"] - before
    s.close()
    return np.concatenate(steps), syncs / DECODE_STEPS


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    weights = random_q8_weights(CONFIGS[request.param], seed=3)
    cpu = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    return weights, [run(cpu, prompt)[0] for prompt in PROMPTS]


@pytest.fixture
def emulated(monkeypatch):
    fake_cuda.install(monkeypatch, mode="deferred")
    return monkeypatch


def gpu_needs(c, max_batch: int = MAX_BATCH):
    """What gpu mode's arena and least KV pool take besides the weights (the library GEMM's scratch
    too, where cuBLAS loads: on the real GPU)."""
    return gpu_mode_needs(c, max_batch, MAX_SEQ_LEN, max_sessions=DEFAULT_MAX_SESSIONS)


def gpu_engine(weights, fraction=None, **kw):
    budget = None
    if fraction is not None:
        c = weights.config
        budget = budget_for_weight_fraction(c, gpu_needs(c), fraction)
    engine = Engine(weights, device="cuda", mode="gpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH,
                    vram_budget=budget)
    for key, value in kw.items():
        setattr(engine.executor, key, value)
    return engine


def hybrid_engine(weights, mode, profile=scheduler.H200_MEASURED, prefill_chunk=64):
    engine = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    engine.device, engine.mode = "cuda", mode
    engine.executor = HybridExecutor(weights, mode, profile, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH,
                                     prefill_chunk=prefill_chunk)
    return engine


def check_against_cpu(engine, reference):
    syncs = []
    for prompt, expected in zip(PROMPTS, reference):
        ours, syncs_per_step = run(engine, prompt)
        assert_logits_match(ours, expected)
        syncs.append(syncs_per_step)
    return syncs


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("policy", ["deferred", "immediate"])
def test_gpu_mode(model, emulated, graphs, policy):
    weights, reference = model
    fake_cuda.POLICY["mode"] = policy
    engine = gpu_engine(weights, use_graphs=graphs)
    assert check_against_cpu(engine, reference) == [1, 1]
    stats = engine.executor.stats
    # the decode bucket's graph and the prompts' (12 tokens padded to 16, 5: run/device/step_graphs.py)
    assert stats["graphs_captured"] == (3 if graphs else 0)
    assert stats["graph_replays"] == (2 * DECODE_STEPS + 2 if graphs else 0)
    engine.close()


@pytest.mark.parametrize("fraction", [0.25, 0.5])
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("copies", ["eager", "lazy"])
def test_gpu_mode_streaming_weights(model, emulated, fraction, graphs, copies):
    """Eager copies run as soon as their waits allow (a missing `released` wait overwrites a slot still
    read); lazy ones only when compute waits for them (a missing `loaded` wait reads a stale slot)."""
    weights, reference = model
    emulated.setitem(fake_cuda.POLICY, "eager", fake_cuda.POLICY["eager"] if copies == "eager" else ())
    engine = gpu_engine(weights, fraction, use_graphs=graphs)
    window = engine.executor.backend.window
    assert window.streamed and window.resident, "the budget should split the weights"
    assert check_against_cpu(engine, reference) == [1, 1]
    assert engine.executor.stats["window_misses"] > 0
    engine.close()


SPLIT_MODES = {
    "gated": ("gated", scheduler.H200_MEASURED, None),
    "gated-fast-link": ("gated", FAST_LINK, None),
    "gated-minflop": ("gated", scheduler.H200_MEASURED, "1e7"),
    "gated-split-qkv": ("gated", scheduler.H200_MEASURED, "split"),
    "layers=1": ("layers=1", None, None),
    "layers=all": ("layers=all", None, None),
    "layers=1+head": ("layers=1+head", None, None),     # llama.cpp's -ngl 2: a second segment, the output
}


def make_split_engine(weights, name, monkeypatch, prefill_chunk=64):
    mode, profile, minflop = SPLIT_MODES[name]
    c = weights.config
    if minflop == "split":     # between the q and the k projection's decode FLOPs: q on the GPU, k and v not
        q_flops, k_flops = 2 * c.q_size * c.hidden_size, 2 * c.kv_size * c.hidden_size
        minflop = str((q_flops + k_flops) / 2)
    if minflop:
        monkeypatch.setenv("KESTREL_MINFLOP", minflop)
    if mode == "layers=all":
        mode = f"layers={c.num_hidden_layers}"
    return hybrid_engine(weights, mode, profile, prefill_chunk)


@pytest.mark.parametrize("name", sorted(SPLIT_MODES))
def test_split_modes(model, emulated, name):
    weights, reference = model
    engine = make_split_engine(weights, name, emulated)
    plan = engine.executor.plan(1)
    if name == "gated-split-qkv":
        sides = {name.rsplit(".", 2)[-2]: p.side for name, p in plan.placements.items() if ".layers.0." in name}
        assert (sides["q_proj"], sides["k_proj"], sides["v_proj"]) == ("gpu", "cpu", "cpu"), sides
    if name in ("gated-fast-link", "gated-split-qkv") or name.startswith("layers"):
        assert plan.syncs_per_step > 0, "this configuration should run some ops on the GPU"
    if name == "layers=1+head":
        sides = [segment.side for segment in plan.segments]
        assert sides == ["cpu", "gpu", "cpu", "gpu"], sides       # embed, layer 0, layers 1.., the output
        assert {p.side for p in plan.placements.values() if p.op in ("final_norm", "lm_head")} == {"gpu"}
    assert check_against_cpu(engine, reference) == [plan.syncs_per_step] * 2
    engine.close()


@pytest.mark.parametrize("name", ["gpu", "gated-fast-link", "gated-split-qkv", "layers=1"])
def test_decode_batch_equals_solo(model, emulated, name):
    weights, _ = model
    emulated.setenv("KESTREL_HOST_KERNELS", "numpy")   # host layers: a row's numbers whatever the step's size
    engine = gpu_engine(weights) if name == "gpu" else make_split_engine(weights, name, emulated)
    prompts = [[1, 2, 3], [7], [9, 8, 7, 6, 5]]
    solo = []
    for prompt in prompts:
        with engine.new_session() as s:
            s.prefill(prompt)
            solo.append(s.decode(11))
    sessions = [engine.new_session() for _ in prompts]
    for s, prompt in zip(sessions, prompts):
        s.prefill(prompt)
    batched = engine.decode_batch([(s, 11) for s in sessions])
    for row, alone in zip(batched, solo):
        assert relative_error(row, alone) < 1e-4
    engine.close()


@pytest.mark.parametrize("fraction", [None, 0.25])
def test_greedy_steps_take_the_argmax_on_the_device(model, emulated, fraction):
    """forward_greedy: the same tokens as argmax of the logits, for a batch of 3 (bucket 4) and alone,
    with one sync and 4 bytes back per token; generate() and the greedy decode_batch go through it."""
    weights, reference = model
    engine = gpu_engine(weights, fraction)
    gpu = engine.executor
    prompts = [[1, 2, 3], [7], [9, 8, 7, 6, 5]]
    sessions = [engine.new_session() for _ in prompts]
    expected = []
    for s, prompt in zip(sessions, prompts):
        expected.append(int(np.argmax(s.prefill(prompt)[-1])))
    for _ in range(3):
        before = dict(gpu.stats)
        tokens = engine.decode_batch(list(zip(sessions, expected)), greedy=True)
        assert gpu.stats["syncs"] - before["syncs"] == 1
        assert gpu.stats["d2h_bytes"] - before["d2h_bytes"] == 4 * 4      # bucket 4, one int32 each
        check = [engine.new_session() for _ in prompts]
        for c, s in zip(check, sessions):            # the same history through the logits path
            c.prefill(s.tokens[:-1])
        logits = engine.decode_batch([(c, s.tokens[-1]) for c, s in zip(check, sessions)])
        np.testing.assert_array_equal(tokens, logits.argmax(axis=1))
        for c in check:
            c.close()
        expected = [int(t) for t in tokens]
    assert (4, True) in gpu.steps._graphs, sorted(gpu.steps._graphs)   # a greedy graph beside the logits ones
    engine.chain_greedy = False                               # one step per sync (chained: next test)
    result = engine.generate(PROMPTS[0], DECODE_STEPS + 1)
    np.testing.assert_array_equal(result.tokens, reference[0][len(PROMPTS[0]) - 1:].argmax(axis=1))
    assert result.stats["syncs_per_token"] == 1
    engine.close()


@pytest.mark.parametrize("greedy", [False, True])
def test_decode_batches_beyond_eight_run_the_tensor_core_graphs(model, emulated, greedy):
    """11 sessions in one decode step (max_batch 16): the bucket-16 graph (the fp16 tensor-core GEMV of
    q8_gemv_hmma.cu), one sync; the same logits (to the GEMM's tolerance) / tokens as each session alone
    on the fp32 GEMV path."""
    weights, _ = model
    engine = Engine(weights, device="cuda", mode="gpu", max_seq_len=MAX_SEQ_LEN, max_batch=16)
    gpu = engine.executor
    assert gpu.steps.buckets == [1, 2, 4, 8, 16]
    prompts = [[1 + i, 2, 3 + i] for i in range(11)]
    sessions = [engine.new_session() for _ in prompts]
    solo = []
    for s, prompt in zip(sessions, prompts):
        s.prefill(prompt)
        with engine.new_session() as alone:
            alone.prefill(prompt)
            solo.append(alone.decode(11))
    before = gpu.stats["syncs"]
    out = engine.decode_batch([(s, 11) for s in sessions], greedy=greedy)
    assert gpu.stats["syncs"] - before == 1
    names = {launch.name for launch in gpu.steps.step_launches(16)}
    assert any(n.startswith("q8_hmma_t16_") and n.endswith("_silu") for n in names), names
    assert not any(n.startswith(("q8_gemv", "q8_matmul", "q8_mma")) for n in names), names
    if greedy:
        np.testing.assert_array_equal(out, [int(np.argmax(row)) for row in solo])
    else:
        for row, alone in zip(out, solo):         # fp32 activations alone, hi + lo fp16 parts in the batch
            assert relative_error(row, alone) < 1e-4
    engine.close()
    c = weights.config                                # streamed weights: one 16-session step, one stream
    needs = gpu_needs(c, 16)
    streamed = Engine(weights, device="cuda", mode="gpu", max_seq_len=MAX_SEQ_LEN, max_batch=16,
                      vram_budget=budget_for_weight_fraction(c, needs, 0.25))
    assert streamed.executor.backend.window.streamed and streamed.executor.steps.buckets[-1] == 16
    streamed.close()


def test_programmatic_launch_for_decode_steps_only(model, emulated):
    """sm_90: every kernel of a decode step after the first may start early; prefill chunks (the tiled
    matmul), the first kernel, and steps with streamed weights never do."""
    weights, _ = model
    engine = gpu_engine(weights)
    run(engine, PROMPTS[0])
    launches = engine.executor.steps._launches
    assert not launches[1][0].programmatic and all(launch.programmatic for launch in launches[1][1:])
    assert not any(launch.programmatic for launch in engine.executor.steps.step_launches(len(PROMPTS[0])))
    engine.close()
    streamed = gpu_engine(weights, 0.25)
    run(streamed, PROMPTS[1])
    assert not any(launch.programmatic for launch in streamed.executor.steps._launches[1])
    streamed.close()


@pytest.mark.parametrize("fraction", [None, 0.25])
def test_generate_chains_greedy_steps_on_the_device(model, emulated, fraction):
    """generate(): the same tokens as stepping, in runs of steps_per_sync tokens per host sync; a batch
    of 3 sessions (bucket 4, one padded row) chained 10 steps matches 10 greedy decode_batch steps."""
    weights, reference = model
    engine = gpu_engine(weights, fraction)
    gpu = engine.executor
    gpu.steps.chain.steps_per_sync = 4
    steps = DECODE_STEPS + 3                          # 11 chained steps: runs of 4, 4, 3
    result = engine.generate(PROMPTS[0], steps + 1)
    engine.chain_greedy = False
    stepped = engine.generate(PROMPTS[0], steps + 1)
    assert result.tokens == stepped.tokens
    np.testing.assert_array_equal(result.tokens[:DECODE_STEPS + 1],
                                  reference[0][len(PROMPTS[0]) - 1:].argmax(axis=1))
    assert result.stats["syncs"] == 3 and stepped.stats["syncs"] == steps
    assert result.stats["d2h_bytes"] == 4 * steps    # bucket 1: one int32 per step

    prompts = [[1, 2, 3], [7], [9, 8, 7, 6, 5]]
    firsts, chained_sessions, stepped_sessions = [], [], []
    for prompt in prompts:
        a, b = engine.new_session(), engine.new_session()
        firsts.append(int(np.argmax(a.prefill(prompt)[-1])))
        b.prefill(prompt)
        chained_sessions.append(a)
        stepped_sessions.append(b)
    chained = gpu.generate_greedy([(s.kv, np.array([f]), s.position) for s, f in zip(chained_sessions, firsts)], 10)
    tokens = firsts
    for step in range(10):
        tokens = [int(t) for t in engine.decode_batch(list(zip(stepped_sessions, tokens)), greedy=True)]
        np.testing.assert_array_equal(chained[step], tokens)
    with pytest.raises(ValueError, match="KV cache holds 32 positions"):
        gpu.generate_greedy([(chained_sessions[0].kv, np.array([1]), 25)], 10)
    engine.close()


@pytest.mark.parametrize("name", ["gpu-streaming", "gated-split-qkv"])
def test_profiled_paths(model, emulated, name):
    """KESTREL_PROF=1: streamed steps run eagerly with timing events; split steps sync per GPU segment."""
    weights, reference = model
    emulated.setattr(prof, "enabled", True)
    engine = gpu_engine(weights, 0.25) if name == "gpu-streaming" else make_split_engine(weights, name, emulated)
    try:
        check_against_cpu(engine, reference)
        if name == "gpu-streaming":
            assert "copy_busy_ms" in engine.executor.stats and engine.executor.stats["graph_replays"] == 0
        else:
            assert prof.snapshot()["calls"] > 0
    finally:
        prof.reset()
        engine.close()


@pytest.mark.parametrize("name", ["gpu", "gated-split-qkv", "layers=1", "layers=1+head"])
def test_prefill_in_chunks(model, emulated, name):
    """Steps of 8 tokens at most: the 12-token prompt runs as chunks of 8 and 4 over one KV cache."""
    weights, reference = model
    if name == "gpu":
        engine = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
        engine.executor = GpuExecutor(weights, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH, prefill_chunk=8)
    else:
        engine = make_split_engine(weights, name, emulated, prefill_chunk=8)
    assert engine.executor.steps.max_tokens == 8
    check_against_cpu(engine, reference)
    engine.close()


@pytest.mark.parametrize("name", ["gpu", "gpu-streaming", "gated-split-qkv", "layers=1", "layers=1+head"])
def test_mixed_step(model, emulated, name):
    """One step of decodes and a prefill together (gpu mode runs it eagerly), then a decode of all three."""
    weights, _ = model

    def steps(engine):
        a, b, c = (engine.new_session() for _ in range(3))
        a.prefill([1, 2, 3, 4])
        b.prefill([5, 6])
        first = engine.step([(a, np.array([7])), (c, np.arange(9, 19)), (b, np.array([8]))])
        return np.concatenate(first + engine.step([(s, np.array([t])) for s, t in ((a, 3), (b, 4), (c, 5))]))

    reference = steps(Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH))
    if name.startswith("gpu"):
        engine = gpu_engine(weights, 0.25 if name == "gpu-streaming" else None)
    else:
        engine = make_split_engine(weights, name, emulated)
    ours = steps(engine)
    for row, expected in zip(ours, reference):
        assert relative_error(row, expected) < 2e-3
    np.testing.assert_array_equal(ours.argmax(axis=1), reference.argmax(axis=1))
    engine.close()


@pytest.mark.parametrize("mode", ["gpu", "layers=1"], ids=["gpu-mode", "layers=1"])   # an id "gpu" is the gpu mark
def test_head_dim_128(emulated, mode):
    config = dataclasses.replace(CONFIGS["qwen3"], head_dim=128, num_hidden_layers=2)
    weights = random_q8_weights(config, seed=4)
    cpu = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    reference = [run(cpu, prompt)[0] for prompt in PROMPTS]
    engine = gpu_engine(weights) if mode == "gpu" else hybrid_engine(weights, mode)
    check_against_cpu(engine, reference)
    engine.close()
