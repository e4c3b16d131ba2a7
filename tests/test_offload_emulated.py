"""Mode offload on the numpy device emulation (fake_cuda) against the CPU engine: every kind of placement
the cost model can choose (host layers only, streamed layers only, both, lm_head on the host), with the
copy engine running as early as its waits allow (a missing `released` wait overwrites a slot still being
read) and as late as possible (a missing `loaded` wait reads a stale slot); a decode step with host layers
and a ring is one graph (the ring's copies in it) with one sync, the same numbers and bytes as segment by
segment; the placement of each step size is the one its plan runs; a budget that holds nothing is refused
before anything is allocated; greedy and sampled steps take their tokens where lm_head ran (the greedy one on
the GPU too)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fake_cuda
import scheduler
from hf_oracle import assert_logits_match
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.run.device.budget import (budget_for_weight_fraction, gpu_mode_needs, plan_offload_memory,
                                              weight_items)
from kestrel_stream.run.engine import Engine
from kestrel_stream.run.step_executor import StepExecutor
from bench.synthetic import random_q8_weights
from scheduler.window import WindowBudgetError
from test_rope_attention import device  # noqa: F401  (the fixture: the emulated device, and the GPU where there is one)

CONFIG = ModelConfig(arch="qwen3", hidden_size=256, intermediate_size=256, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                     max_position_embeddings=512)
PROMPTS = ([5, 3, 200, 17, 42, 8, 1, 99, 250, 7, 64, 31], [9, 8, 7, 6, 5])
MAX_SEQ_LEN, MAX_BATCH, DECODE_STEPS = 32, 4, 6
# the pool's figures with overheads scaled to these small layers, so the bytes decide
POOL = dataclasses.replace(scheduler.profile.H200_POOL, round_trip_us=0.05, gpu_launch_us=0.05, host_call_us=0.05)
PROFILES = {
    "mixed": POOL,
    "host": dataclasses.replace(POOL, h2d_GBps=0.05, h2d_joint_GBps=0.04),
    "ring": dataclasses.replace(POOL, host_weight_GBps=0.05, host_joint_GBps=0.04, host_gflops=1.0),
}


@pytest.fixture(scope="module")
def model():
    weights = random_q8_weights(CONFIG, seed=5)
    cpu = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    return weights, [run(cpu, prompt) for prompt in PROMPTS]


@pytest.fixture
def emulated(monkeypatch):
    fake_cuda.install(monkeypatch, mode="deferred")
    return monkeypatch


def run(engine, prompt, decode_steps: int = DECODE_STEPS) -> np.ndarray:
    """A prefill's logits, then `decode_steps` greedy decode steps' (one row each)."""
    s = engine.new_session()
    steps = [s.prefill(prompt)]
    token = int(np.argmax(steps[0][-1]))
    for _ in range(decode_steps):
        steps.append(s.decode(token)[None])
        token = int(np.argmax(steps[-1][-1]))
    s.close()
    return np.concatenate(steps)


def budget_for(fraction: float, profile) -> int:
    """A budget whose weight part is `fraction` of the weights."""
    needs = plan_offload_memory(CONFIG, budget_bytes=1 << 40, free_bytes=1 << 41, profile=profile, max_tokens=64,
                                max_sessions=256, max_seq_len=MAX_SEQ_LEN, attention_splits=16,
                                max_batch=MAX_BATCH).needs
    items = weight_items(CONFIG)
    return needs.total + 2 * 256 * (len(items) + 8) + int(fraction * sum(i.nbytes for i in items))


def offload_engine(weights, profile, fraction: float, mode: str = "offload"):
    executor = StepExecutor(weights, mode, profile, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH,
                            vram_budget=budget_for(fraction, profile))
    engine = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    engine.device, engine.mode, engine.executor = "cuda", executor.mode, executor
    return engine


@pytest.mark.parametrize("copies", ["eager", "lazy"])
@pytest.mark.parametrize("kind,fraction", [("mixed", 0.5), ("host", 0.5), ("ring", 0.5), ("mixed", 0.12),
                                           ("ring", 0.3)])
def test_every_placement_matches_the_cpu_engine(model, emulated, kind, fraction, copies):
    weights, reference = model
    emulated.setitem(fake_cuda.POLICY, "eager", fake_cuda.POLICY["eager"] if copies == "eager" else ())
    engine = offload_engine(weights, PROFILES[kind], fraction)
    placement = engine.executor.placement
    homes = set(placement.homes)
    if kind == "host":
        assert not placement.streamed_bytes and placement.host_bytes
    elif kind == "ring":
        assert not placement.host_bytes and placement.streamed_bytes
    else:
        assert placement.host_bytes and placement.streamed_bytes, placement.describe()
    for prompt, expected in zip(PROMPTS, reference):
        assert_logits_match(run(engine, prompt), expected)
    stats = engine.executor.stats
    streamed = engine.executor.plan(1).h2d_bytes_per_step
    assert (stats["streamed_bytes"] or 0) > 0 if placement.streamed_bytes else not stats["streamed_bytes"]
    assert streamed > 0
    engine.close()


def decode_steps(engine, prompt, steps: int = DECODE_STEPS) -> tuple[np.ndarray, list[dict]]:
    """A prefill, then greedy decode steps: their logits and the counters each step added."""
    x, rows, added = engine.executor, [], []
    with engine.new_session() as s:
        token = int(np.argmax(s.prefill(prompt)[-1]))
        for _ in range(steps):
            before = dict(x.stats)
            rows.append(s.decode(token))
            token = int(np.argmax(rows[-1]))
            added.append({k: v - (before.get(k) or 0) for k, v in x.stats.items() if isinstance(v, (int, float))})
    return np.stack(rows), added


@pytest.mark.parametrize("copies", ["eager", "lazy"])
def test_a_decode_with_host_layers_and_a_ring_is_one_graph(model, emulated, copies):
    """Host layers and streamed ones in one step: from the second decode step on, one graph whose copies
    into the ring are its own (one sync a step, where segment by segment syncs once a host segment), bit for
    bit the numbers of KESTREL_HOST_NODES=0 (or KESTREL_RING_GRAPHS=0) and the same bytes streamed, with copies
    as early or as late as their waits allow."""
    weights, _ = model
    emulated.setitem(fake_cuda.POLICY, "eager", fake_cuda.POLICY["eager"] if copies == "eager" else ())
    runs = {}
    for nodes, ring_graphs in (("0", "1"), ("1", "0"), ("1", "1")):
        emulated.setenv("KESTREL_HOST_NODES", nodes)
        emulated.setenv("KESTREL_RING_GRAPHS", ring_graphs)
        engine = offload_engine(weights, PROFILES["mixed"], 0.5)
        placement = engine.executor.placement
        assert placement.host_bytes and placement.streamed_bytes, placement.describe()
        runs[nodes + ring_graphs] = decode_steps(engine, PROMPTS[0])
        engine.close()
    (eager_rows, eager_steps), (rows, steps) = runs["01"], runs["11"]
    np.testing.assert_array_equal(rows, eager_rows)
    for run_rows, run_steps in (runs["01"], runs["10"]):       # segment by segment: no nodes, or no ring graphs
        np.testing.assert_array_equal(run_rows, eager_rows)
        assert all(step["syncs"] > 1 and not step.get("graph_replays") for step in run_steps)
    assert steps[1]["graphs_captured"] == 1
    assert all(step["syncs"] == 1 and step["graph_replays"] == 1 for step in steps[1:])
    for step, eager in zip(steps, eager_steps):
        for name in ("streamed_bytes", "h2d_bytes", "d2h_bytes", "gpu_weight_read_bytes", "cpu_weight_read_bytes",
                     "launches"):
            assert step[name] == eager[name] > 0, name


def test_lm_head_on_the_host(model, emulated):
    """A budget with room for a ring but not for lm_head's table keeps lm_head on the host."""
    weights, reference = model
    engine = offload_engine(weights, PROFILES["mixed"], 0.12)
    assert engine.executor.placement.head == "host"
    assert_logits_match(run(engine, PROMPTS[0]), reference[0])
    engine.close()


def test_each_step_size_runs_its_own_placement(model, emulated):
    """Where the split differs between step sizes, each step streams what its plan says (the ring follows
    the plan's order), and the results still match."""
    weights, reference = model
    flip = dataclasses.replace(POOL, host_gflops=150.0)       # host compute-bound from a few tokens on
    engine = offload_engine(weights, flip, 0.5)
    one, twelve = engine.executor.placement_for(1), engine.executor.placement_for(12)
    assert one.host_bytes and not twelve.host_bytes, (one.homes, twelve.homes)
    for prompt, expected in zip(PROMPTS, reference):
        assert_logits_match(run(engine, prompt), expected)
    engine.close()


def test_gpu_mode_under_a_short_budget_becomes_offload(model, emulated):
    """gpu mode short of VRAM becomes offload where the cost model puts work on the host, and keeps the
    window alone with KESTREL_OFFLOAD=stream."""
    weights, _ = model
    emulated.setenv("KESTREL_OFFLOAD", "auto")
    executor = StepExecutor(weights, "gpu", POOL, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH,
                            vram_budget=budget_for(0.3, POOL))
    assert executor.mode == "offload" and executor.placement.host_bytes
    executor.close()
    emulated.setenv("KESTREL_OFFLOAD", "stream")
    budget = budget_for_weight_fraction(CONFIG, gpu_mode_needs(CONFIG, MAX_BATCH, MAX_SEQ_LEN), 0.5)
    executor = StepExecutor(weights, "gpu", POOL, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH, vram_budget=budget)
    assert executor.mode == "gpu" and executor.backend.window.streamed
    executor.close()


def test_a_budget_without_room_for_weights_is_refused(model, emulated):
    weights, _ = model
    with pytest.raises(WindowBudgetError, match="too small for mode offload.*raise --vram-budget"):
        StepExecutor(weights, "offload", POOL, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH, vram_budget=1 << 20)


@pytest.mark.parametrize("homes", ["MHSRMS", "MMMMMM:host", "HSHSHS:resident"])
def test_homes_given_run_as_given(model, emulated, homes):
    """KESTREL_OFFLOAD_HOMES: every home a layer can have (the MLP alone on the host too), as given."""
    weights, reference = model
    emulated.setenv("KESTREL_OFFLOAD_HOMES", homes)
    engine = offload_engine(weights, POOL, 0.5)
    placement = engine.executor.placement
    assert "".join(scheduler.offload.HOME_LETTERS[h] for h in placement.homes) == homes.split(":")[0]
    if ":" in homes:
        assert placement.head == homes.split(":")[1]
    for prompt, expected in zip(PROMPTS, reference):
        assert_logits_match(run(engine, prompt), expected)
    if homes[0] in "MH":            # layer 0's MLP on the host in steps of every size
        plan = engine.executor.plan(5)
        sides = [p.side for name, p in plan.placements.items() if name.startswith("model.layers.0.mlp.")]
        assert sides == ["cpu"] * 3, sides
    engine.close()


def test_homes_given_badly_are_refused_naming_the_setting(model, emulated):
    weights, _ = model
    emulated.setenv("KESTREL_OFFLOAD_HOMES", "RSX")
    with pytest.raises(ValueError, match="KESTREL_OFFLOAD_HOMES='RSX': expected 6 letters"):
        offload_engine(weights, POOL, 0.5)


def test_prefill_wanting_the_last_row_computes_and_returns_only_it(model, emulated):
    """logits="last": lm_head runs on the last row alone and one row comes back, the same numbers."""
    weights, reference = model
    engine = offload_engine(weights, POOL, 0.5)
    moved = []
    for logits in ("all", "last"):
        before = engine.executor.stats["d2h_bytes"]
        with engine.new_session() as s:
            out = s.prefill(PROMPTS[0], logits=logits)
        moved.append(engine.executor.stats["d2h_bytes"] - before)
        assert_logits_match(np.atleast_2d(out)[-1:], reference[0][len(PROMPTS[0]) - 1:len(PROMPTS[0])])
    assert moved[0] - moved[1] == (len(PROMPTS[0]) - 1) * CONFIG.vocab_size * 4, moved
    engine.close()


@pytest.mark.parametrize("fraction,head", [(0.5, "resident"), (0.12, "host")])
def test_greedy_steps_take_the_argmax_where_lm_head_ran(model, device, fraction, head):
    """decode_batch(greedy=True) and forward_argmax: the tokens of the logits path's argmax; with lm_head on
    the device each row's argmax is taken there and 4 bytes a row come back in place of the row (in the step
    graph too, captured beside the logits one), with lm_head on the host the host takes it (on the emulated
    device and on the GPU: the same logits either way)."""
    weights, _ = model
    engine = offload_engine(weights, PROFILES["mixed"], fraction)
    x = engine.executor
    assert x.placement.head == head, x.placement.describe()
    prompts = [[1, 2, 3], [7], [9, 8, 7, 6, 5]]
    sessions = [engine.new_session() for _ in prompts]
    tokens = [int(np.argmax(s.prefill(p)[-1])) for s, p in zip(sessions, prompts)]
    for _ in range(4):                             # segment by segment, captured, replayed, replayed
        check = [engine.new_session() for _ in prompts]
        for c, s in zip(check, sessions):          # the same history through the logits path
            c.prefill(s.tokens)
        before = x.stats["d2h_bytes"]
        logits = engine.decode_batch([(c, t) for c, t in zip(check, tokens)])
        logits_d2h = x.stats["d2h_bytes"] - before
        before = x.stats["d2h_bytes"]
        got = engine.decode_batch(list(zip(sessions, tokens)), greedy=True)
        greedy_d2h = x.stats["d2h_bytes"] - before
        np.testing.assert_array_equal(got, logits.argmax(axis=1))
        saved = (CONFIG.vocab_size * 4 - 4) * len(prompts) if head == "resident" else 0
        assert logits_d2h - greedy_d2h == saved, (logits_d2h, greedy_d2h)
        for c in check:
            c.close()
        tokens = [int(t) for t in got]
    graphs = x.steps.item_graphs._graphs
    assert {key[2] for key in graphs if key[0] == len(prompts)} == {None, "argmax"}, list(graphs)
    with engine.new_session() as s:                # every row's argmax of a prompt (a verify pass)
        rows = x.forward_argmax([(s.kv, np.array(PROMPTS[0]), 0)])
    with engine.new_session() as s:
        np.testing.assert_array_equal(rows[0], s.prefill(PROMPTS[0]).argmax(axis=1))
    for s in sessions:
        s.close()
    engine.close()


def test_sampled_steps_draw_on_the_device_where_lm_head_ran(model, emulated):
    """Session.decode_sample in mode offload: with lm_head on the device each token is drawn there (the twin runs
    the reference sampler with the kernel's state words), 4 bytes back, in the step graph too: the CPU engine's
    tokens for the same seeds; with lm_head on the host forward_sample declines and the host draws the same."""
    weights, _ = model
    sampled = dict(temperature=1.5, top_k=50, top_p=0.9, min_p=0.01)
    cpu = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    want = [cpu.generate(PROMPTS[1], 8, seed=seed, **sampled).tokens for seed in (1, 2)]
    for fraction, head in ((0.5, "resident"), (0.12, "host")):
        engine = offload_engine(weights, PROFILES["mixed"], fraction)
        x = engine.executor
        assert x.placement.head == head
        for seed, expected in zip((1, 2), want):
            before = dict(x.stats)
            result = engine.generate(PROMPTS[1], 8, seed=seed, **sampled)
            assert result.tokens == expected
            back = x.stats["d2h_bytes"] - before["d2h_bytes"]
            with engine.new_session() as s:          # what the same steps bring back with every logits row
                start = dict(x.stats)
                s.prefill(PROMPTS[1], logits="last")
                for token in result.tokens[:-1]:
                    s.decode(token)
                rows_back = x.stats["d2h_bytes"] - start["d2h_bytes"]
            saved = (CONFIG.vocab_size * 4 - 4) * (len(result.tokens) - 1) if head == "resident" else 0
            assert rows_back - back == saved, (rows_back, back)
        graphs = x.steps.item_graphs._graphs
        assert any(key[2] == "sample" for key in graphs) == (head == "resident"), list(graphs)
        engine.close()


def test_a_step_of_prompt_chunks_and_decodes_draws_each_sessions_token(model, emulated):
    """Engine.step(sample=states) in mode offload over decodes (sampled and greedy) and a prompt's chunk between
    them: with lm_head on the device each session's last row is drawn there, the reference sampler's token over
    the rows the same step's logits would be (greedy rows: their argmax), a few bytes back; with lm_head on the
    host the step gives the rows themselves."""
    from kestrel_stream.run.device.sample_state import pack_state
    from kestrel_stream.text.sampling import SamplingParams, sample_logits
    weights, _ = model
    for fraction, head in ((0.5, "resident"), (0.12, "host")):
        engine = offload_engine(weights, PROFILES["mixed"], fraction)
        assert engine.executor.placement.head == head
        sessions = [engine.new_session() for _ in range(3)]
        nexts = [int(s.prefill(p, logits="last").argmax()) for s, p in zip(sessions, (PROMPTS[0], PROMPTS[1], [4, 4]))]
        items = [(s, np.array([t], np.int64)) for s, t in zip(sessions, nexts)]
        items.insert(1, (engine.new_session(), np.array([7, 1, 44, 3, 90, 12], np.int64)))
        params = [SamplingParams(temperature=1.2, top_k=50, top_p=0.9), SamplingParams(temperature=0.0),
                  SamplingParams(temperature=0.8), SamplingParams(temperature=0.0)]
        before = dict(engine.executor.stats)
        rows = [r[-1] for r in engine.step(items, logits="last")]
        logits_back = engine.executor.stats["d2h_bytes"] - before["d2h_bytes"]
        want = [sample_logits(r, p, 7 + i, 2) for i, (r, p) in enumerate(zip(rows, params))]
        for s, ids in items:
            s.truncate(s.position - len(ids))
        before = dict(engine.executor.stats)
        out = engine.step(items, sample=[pack_state(p, 7 + i, 2) for i, p in enumerate(params)])
        if head == "resident":
            assert out.tolist() == want
            drawn_back = engine.executor.stats["d2h_bytes"] - before["d2h_bytes"]     # activations to the host too
            assert logits_back - drawn_back >= len(items) * (CONFIG.vocab_size * 4 - 4)
        else:
            assert [np.asarray(r)[-1].tolist() for r in out] == [r.tolist() for r in rows]
        engine.close()
