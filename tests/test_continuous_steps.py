"""The daemon's step glue without sockets: the batcher's steps (decode tokens + prompt chunks) run through
DecodeSteps on the CPU engine and on the emulated GPU (gpu mode: mixed steps run eagerly), against each
session run alone on the CPU engine."""
from __future__ import annotations

import numpy as np
import pytest

import fake_cuda
from hf_oracle import relative_error
from kestrel_stream.options import Options
from kestrel_stream.run.engine import Engine
from bench.synthetic import random_q8_weights
from kestrel_stream.serve.decode_steps import DecodeJob, DecodeSteps, PrefillJob
from scheduler.batcher import StepBatcher
from test_executors_emulated import CONFIGS

MAX_SEQ_LEN, MAX_BATCH, STEP_TOKENS = 64, 4, 8
# per session: (prompt, decodes, more prompt, decodes); the prompts run longer than a step's budget
SCRIPTS = [([5, 3, 200, 17, 42, 8, 1, 99, 250, 7, 64, 31, 2, 4, 6, 8, 10, 12, 14], 3, [1, 2, 3], 2),
           ([9], 6, [11, 22, 33, 44, 55, 66, 77, 88, 99, 111], 3),
           ([7, 7, 7, 7, 7], 4, [3], 4)]


def solo(engine, script):
    """(every token the session yields, the logits of its first prompt) alone."""
    prompt, first, more, second = script
    with engine.new_session() as s:
        logits = s.prefill(prompt)
        tokens = [int(np.argmax(logits[-1]))]
        for _ in range(first):
            tokens.append(int(np.argmax(s.decode(tokens[-1]))))
        tokens.append(int(np.argmax(s.prefill(more)[-1])))
        for _ in range(second):
            tokens.append(int(np.argmax(s.decode(tokens[-1]))))
    return tokens, logits


def served(engine):
    """Every script at once through the batcher and DecodeSteps, one step at a time as the step thread runs
    them; the first prompt asks for all its logits, the second for its top-3."""
    batcher = StepBatcher(max_batch=MAX_BATCH, step_tokens=STEP_TOKENS, window_s=0.0)
    steps = DecodeSteps(engine, {"decode_steps": 0, "decode_step_s": 0.0}, batcher)
    sessions = [engine.new_session() for _ in SCRIPTS]
    plans = []
    for prompt, first, more, second in SCRIPTS:
        plans.append([("prefill", prompt, "logits")] + [("decode",)] * first + [("prefill", more, "topk")]
                     + [("decode",)] * second)
    tokens, logits, running = [[] for _ in SCRIPTS], [None] * len(SCRIPTS), [None] * len(SCRIPTS)
    compositions = []
    while any(plans) or any(running):
        for i, session in enumerate(sessions):
            job = running[i]
            if job is not None and job.done:
                assert job.error is None, job.error
                fields, arrays = job.result
                if "logits" in arrays:
                    logits[i] = arrays["logits"]
                    tokens[i].append(int(np.argmax(arrays["logits"][-1])))
                else:
                    tokens[i].append(fields["token"])
                running[i] = job = None
            if job is None and plans[i]:
                step = plans[i].pop(0)
                if step[0] == "decode":
                    job = DecodeJob(session, tokens[i][-1], "token", 1)
                else:
                    job = PrefillJob(session, np.asarray(step[1], np.int64), step[2], 3)
                batcher.add(session.id, job, job.arrived_s, job.tokens)
                running[i] = job
        if batcher.depth:
            chunk_list = batcher.take()
            compositions.append(sum(c.count for c in chunk_list))
            steps.run(chunk_list)
    for session in sessions:
        session.close()
    return tokens, logits, compositions, batcher.stats()


# numpy's reference arithmetic gives a row the same numbers whatever else its step holds; the native host
# kernels run a step of 1-5 tokens and one of more on different paths (a dot product per row, or 16 tokens
# in the lanes of one instruction), which agree within the engine's 2e-3, as the GPU's GEMV and GEMM do
NUMPY = Options.from_env().with_(host_kernels="numpy")


@pytest.fixture(scope="module")
def weights_and_solo():
    weights = random_q8_weights(CONFIGS["qwen3"], seed=3)          # batching is the same for every arch
    cpu = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH, options=NUMPY)
    return weights, [solo(cpu, script) for script in SCRIPTS]


@pytest.mark.parametrize("kernels", ["numpy", "native"])
def test_cpu_engine_steps_give_every_session_its_solo_tokens(weights_and_solo, kernels):
    weights, expected = weights_and_solo
    options = NUMPY if kernels == "numpy" else NUMPY.with_(host_kernels="native")
    engine = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH, options=options)
    tokens, logits, compositions, stats = served(engine)
    assert tokens == [t for t, _ in expected]
    for got, (_, want) in zip(logits, expected):
        assert got.shape == want.shape
        if kernels == "numpy":
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert max(relative_error(g, w) for g, w in zip(got, want)) < 2e-3
    assert max(compositions) == STEP_TOKENS and stats["max_tokens_in_step"] == STEP_TOKENS
    assert stats["prompt_chunks"] > len(SCRIPTS) * 2            # the long prompts were cut
    assert stats["max_decode_wait_steps"] == 0


def test_emulated_gpu_steps_match_the_cpu_engine(weights_and_solo, monkeypatch):
    fake_cuda.install(monkeypatch, mode="deferred")
    weights, expected = weights_and_solo
    engine = Engine(weights, device="cuda", mode="gpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    tokens, logits, _, _ = served(engine)
    engine.close()
    assert tokens == [t for t, _ in expected]
    for got, (_, want) in zip(logits, expected):
        for row in range(len(want)):
            assert relative_error(got[row], want[row]) < 2e-3, f"row {row}"
        np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
