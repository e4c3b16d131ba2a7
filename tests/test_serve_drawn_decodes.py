"""Sampled generations in the daemon drawn on the device: a step of decode tokens and prompt chunks, sampled and
greedy, draws every token there (sample.cu; a greedy row's state takes its argmax) and brings 4 bytes a session
back; the tokens are the engine's own for the same seeds, and a step the device cannot draw (the CPU engine)
gives each handler its logits row to draw from, as before.  Marked `gpu`, the kernels' part runs on a real GPU
too: greedy rows among sampled ones take the first largest logit, on both sampler paths."""
from __future__ import annotations

import json
import threading
import urllib.request

import numpy as np
import pytest
from inprocess_daemon import MODEL_NAME, InProcessDaemon

import fake_cuda
import kestrel_stream as ks
from kestrel_stream.cuda import driver

PROMPTS = ([5, 3, 200, 17], [9, 9, 1, 40, 77, 2], [100, 20, 3], [250, 1, 2, 3, 4])
SAMPLED = dict(temperature=1.3, top_k=50, top_p=0.95, min_p=0.01)
NEW = 12


def generations(model, **load) -> tuple[list, list]:
    """An engine's own tokens, one generation at a time: each prompt sampled with seed i, and greedy."""
    engine = ks.load(model, max_seq_len=128, **load)
    try:
        sampled = [engine.generate(p, NEW, seed=i, **SAMPLED).tokens for i, p in enumerate(PROMPTS)]
        greedy = [engine.generate(p, NEW, temperature=0.0).tokens for p in PROMPTS]
    finally:
        engine.close()
    assert len(set(sampled[0])) > 2 and sampled[0] != greedy[0]         # they do sample
    return sampled, greedy


def socket_generations(daemon, at_once: bool) -> dict:
    """Every prompt sampled (seed i) and greedy through the socket: one generation at a time, or all at once (steps
    then hold both kinds of rows)."""
    errors, got = [], {}

    def run(key, prompt, options):
        try:
            with ks.Client(str(daemon.socket_path)) as client:
                got[key] = client.generate(prompt, NEW, **options).tokens
        except Exception as e:          # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(("sampled", i), p, dict(seed=i, **SAMPLED)))
               for i, p in enumerate(PROMPTS)]
    threads += [threading.Thread(target=run, args=(("greedy", i), p, dict(temperature=0.0)))
                for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
        if not at_once:
            t.join(120)
    for t in threads:
        t.join(120)
    assert not errors, errors
    return got


def http_text(daemon, prompt: list[int], seed: int) -> str:
    """A sampled /v1/completions of token ids: its text."""
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": NEW, "seed": seed, "ignore_eos": True,
                       **SAMPLED}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{daemon.http_port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())["choices"][0]["text"]


def served(model, tmp_path, **load) -> None:
    """One generation at a time, the daemon gives the engine's own tokens (and text over HTTP); all at once, each
    sampled generation runs to its length, in steps of several sessions."""
    sampled, greedy = generations(model, **load)
    engine = ks.load(model, max_seq_len=128, **load)
    texts = [engine.generate(p, NEW, seed=i, ignore_eos=True, **SAMPLED).text for i, p in enumerate(PROMPTS)]
    engine.close()
    d = InProcessDaemon(model, tmp_path, max_sessions=8, load={"max_seq_len": 128, **load})
    try:
        before, steps = dict(d.engine.executor.stats), d.service.replicas.all[0].counters["decode_steps"]
        one_by_one = socket_generations(d, at_once=False)
        if load["device"] != "cpu":     # 4 bytes a prompt and a decode (of a padded bucket), no logits row
            ran = d.service.replicas.all[0].counters["decode_steps"] - steps
            assert d.engine.executor.stats["d2h_bytes"] - before["d2h_bytes"] <= (2 * len(PROMPTS) + ran) * 8 * 4
            assert any(key[1] == "sample" for key in d.engine.executor.steps._graphs)
        assert [one_by_one[("sampled", i)] for i in range(len(PROMPTS))] == sampled
        assert [one_by_one[("greedy", i)] for i in range(len(PROMPTS))] == greedy
        assert [http_text(d, p, i) for i, p in enumerate(PROMPTS)] == texts
        steps = d.service.replicas.all[0].counters["decode_steps"]
        together = socket_generations(d, at_once=True)
        assert all(len(tokens) == NEW for tokens in together.values())
        assert d.service.replicas.all[0].counters["decode_steps"] - steps < 2 * len(PROMPTS) * (NEW - 1)
        assert d.settled_sessions() == 0
    finally:
        d.stop()


def test_emulated_daemon_draws_sampled_decodes_on_the_device(tiny_model, tmp_path, monkeypatch):
    fake_cuda.install(monkeypatch, mode="deferred")
    served(tiny_model, tmp_path, device="cuda", mode="gpu")


def test_cpu_daemon_draws_sampled_decodes_on_the_host(tiny_model, tmp_path):
    """No device to draw on: each sampled decode's logits row goes to its handler, which draws the same token."""
    served(tiny_model, tmp_path, device="cpu")


def streamed_engine(tiny_model):
    """gpu mode with half the weights streamed through the window (eager steps then run a chunk a span)."""
    from kestrel_stream.run.compat import GpuExecutor
    from kestrel_stream.run.device.budget import budget_for_weight_fraction, gpu_mode_needs
    engine = ks.load(tiny_model, device="cpu", max_seq_len=128)
    c = engine.config
    budget = budget_for_weight_fraction(c, gpu_mode_needs(c, engine.max_batch, 128), 0.5)
    engine.executor.close()
    engine.device, engine.mode = "cuda", "gpu"
    engine.executor = GpuExecutor(engine.weights, max_seq_len=128, max_batch=engine.max_batch, vram_budget=budget,
                                  small_item_bytes=1024)
    assert engine.executor.backend.window.streamed
    return engine


@pytest.mark.parametrize("where", ["emulated", "window", "cpu"])
def test_a_step_of_drawn_and_greedy_decodes(tiny_model, monkeypatch, where):
    """Engine.step(sample=states) over sessions sampled and greedy gives the reference sampler's draws over the
    rows the same step's logits would be (greedy rows: their argmax), 4 bytes a session back on the device (with
    every weight resident, and with half of them streamed); the CPU engine gives those rows instead."""
    from kestrel_stream.run.device.sample_state import pack_state
    from kestrel_stream.text.sampling import SamplingParams, sample_logits
    if where != "cpu":
        fake_cuda.install(monkeypatch, mode="deferred")
    if where == "window":
        engine = streamed_engine(tiny_model)
    else:
        engine = ks.load(tiny_model, max_seq_len=128, **({"device": "cuda", "mode": "gpu"} if where == "emulated"
                                                           else {"device": "cpu"}))
    try:
        sessions = [engine.new_session() for _ in PROMPTS]
        nexts = [int(s.prefill(p, logits="last").argmax()) for s, p in zip(sessions, PROMPTS)]
        params = [SamplingParams(**SAMPLED) if i % 2 else SamplingParams(temperature=0.0) for i in range(len(PROMPTS))]
        for step in range(3):
            items = [(s, np.array([t], np.int64)) for s, t in zip(sessions, nexts)]
            rows = [r[-1] for r in engine.step(items, logits="last")]
            want = [sample_logits(r, p, 40 + i, step) for i, (r, p) in enumerate(zip(rows, params))]
            for s, (_, ids) in zip(sessions, items):
                s.truncate(s.position - 1)
            before = dict(engine.executor.stats)
            out = engine.step(items, sample=[pack_state(p, 40 + i, step) for i, p in enumerate(params)])
            if where == "cpu":
                assert [np.asarray(r)[-1].tolist() for r in out] == [r.tolist() for r in rows]
                got = [sample_logits(np.asarray(r)[-1], p, 40 + i, step) for i, (r, p) in enumerate(zip(out, params))]
            else:
                got = out.tolist()
                assert engine.executor.stats["d2h_bytes"] - before["d2h_bytes"] <= 4 * 8
            assert got == want
            nexts = got
        assert len({t for t in nexts}) > 1
        # a prompt's chunk between the decodes: each session's last row picked (the prompt's: greedy)
        prompt = engine.new_session()
        items = [(s, np.array([t], np.int64)) for s, t in zip(sessions, nexts)]
        items.insert(2, (prompt, np.array([7, 1, 44, 3, 90, 12], np.int64)))
        params.insert(2, SamplingParams(temperature=0.0))
        rows = [r[-1] for r in engine.step(items, logits="last")]
        want = [sample_logits(r, p, 40 + i, 3) for i, (r, p) in enumerate(zip(rows, params))]
        for s, (_, ids) in zip([s for s, _ in items], items):
            s.truncate(s.position - len(ids))
        before = dict(engine.executor.stats)
        out = engine.step(items, sample=[pack_state(p, 40 + i, 3) for i, p in enumerate(params)])
        if where == "cpu":
            got = [sample_logits(np.asarray(r)[-1], p, 40 + i, 3) for i, (r, p) in enumerate(zip(out, params))]
        else:
            got = out.tolist()
            assert engine.executor.stats["d2h_bytes"] - before["d2h_bytes"] <= 4 * 16
        assert got == want
        for s, (_, ids) in zip([s for s, _ in items], items):
            s.truncate(s.position - len(ids))
        before = dict(engine.executor.stats)
        greedy = engine.step(items, greedy=True)       # the same step greedy: every last row's argmax
        assert greedy.tolist() == [int(np.argmax(r)) for r in rows]
        if where != "cpu":
            assert engine.executor.stats["d2h_bytes"] - before["d2h_bytes"] <= 4 * 16
    finally:
        engine.close()


@pytest.fixture(params=["emulated", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not driver.gpu_available(), reason=f"{driver.detect()}")])])
def device(request, monkeypatch):
    if request.param == "emulated":
        fake_cuda.install(monkeypatch)
        return fake_cuda.FakeKernelSet()
    from kestrel_stream.cuda.kernels import KernelSet
    return KernelSet(driver.Device(0))


@pytest.mark.parametrize("two_launches", [False, True], ids=["sample_rows", "candidates_then_finish"])
def test_greedy_rows_take_the_first_largest_logit(device, two_launches):
    """Rows packed greedy (pack_state of temperature 0) between sampled rows: each takes its row's argmax, the
    first of tied largest logits; the sampled rows draw the reference sampler's tokens."""
    from kestrel_stream.run.device.sampler import SAMPLE_CAP, candidate_splits, pack_state
    from kestrel_stream.text.sampling import SamplingParams, sample_logits
    rng, V, T = np.random.default_rng(3), 4096, 12
    logits = (3 * rng.standard_normal((T, V))).astype(np.float32)
    logits[2, [700, 90, 3000]] = 50.0          # ties at the top: the first id wins
    logits[5, [4000, 4095]] = 40.0
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=40, top_p=0.9)
    params = [greedy if t % 3 != 1 else sampled for t in range(T)]
    state = np.stack([pack_state(p, 21, 500 + t) for t, p in enumerate(params)])
    kernels, arena, stream = device, driver.Arena(16 << 20), driver.Stream()
    data, state_ptr, out = arena.alloc(logits.nbytes), arena.alloc(state.nbytes), arena.alloc(T * 4)
    driver.h2d_sync(data, logits)
    driver.h2d_sync(state_ptr, state)
    if two_launches:
        S = candidate_splits(V)
        cand = arena.alloc(T * S * (2 * SAMPLE_CAP + 4) * 4)
        kernels.launch("sample_candidates", (S, T), (256,), "pipp", [data, V, state_ptr, cand]).enqueue(stream)
        kernels.launch("sample_finish", (T,), (1024,), "pippip", [data, V, state_ptr, cand, S, out]).enqueue(stream)
    else:
        kernels.launch("sample_rows", (T,), (1024,), "pipp", [data, V, state_ptr, out]).enqueue(stream)
    tokens = np.empty(T, np.int32)
    driver.d2h_async(tokens, out, tokens.nbytes, stream)
    stream.synchronize()
    assert tokens[2] == 90 and tokens[5] == 4000
    assert tokens.tolist() == [sample_logits(logits[t], params[t], 21, 500 + t) for t in range(T)]
