"""Session.truncate and Session.fork on every engine path: the CPU engine, gpu mode's paged pool (f16 and
float32 KV, on the emulated device) and a split mode (layers=1); bad calls raise and change nothing."""
from __future__ import annotations

import numpy as np
import pytest

import fake_cuda
from hf_oracle import relative_error
from kestrel_stream.errors import CapacityError, SessionClosedError
from kestrel_stream.loading.presets import PRESETS
from bench.synthetic import random_q8_weights
from kestrel_stream.run.engine import Engine

# 23 tokens: a block and a bit; truncated by 3 it is still more than 16, so the truncated session's prefill and
# a fresh one of its prefix run the same GEMM (up to 16 tokens a step takes another kernel, with other roundings)
PROMPT = [5, 3, 200, 17, 42, 8, 1, 99, 250, 7, 64, 31, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22]


@pytest.fixture(scope="module")
def weights():
    return random_q8_weights(PRESETS["tiny"], seed=5)


@pytest.fixture(params=["cpu", "gpu-f16", "gpu-f32", "layers=1"])
def engine(request, weights, monkeypatch):
    # the cache's contents are what is checked: numpy's arithmetic gives a row the same numbers in a step of
    # one token and of many (the native host kernels' two paths agree within 2e-3, not bit for bit)
    monkeypatch.setenv("KESTREL_HOST_KERNELS", "numpy")
    if request.param == "cpu":
        eng = Engine(weights, device="cpu", max_seq_len=64, max_batch=4)
    else:
        fake_cuda.install(monkeypatch, mode="deferred")
        mode, _, kv_dtype = request.param.partition("-")
        eng = Engine(weights, device="cuda", mode=mode, max_seq_len=64, max_batch=4,
                     **({"kv_dtype": kv_dtype} if kv_dtype else {}))
    yield eng
    eng.close()


def fresh(engine, tokens, then):
    """Logits of `then` decoded after prefilling `tokens` in a new session."""
    with engine.new_session() as s:
        s.prefill(tokens)
        return s.decode(then)


def close(a, b):
    return relative_error(a, b) < 1e-4 and int(np.argmax(a)) == int(np.argmax(b))


def test_truncate_rewinds_to_the_same_state_as_a_fresh_prefix(engine):
    s = engine.new_session()
    s.prefill(PROMPT)
    for token in (9, 8, 7, 6):
        s.decode(token)
    s.truncate(len(PROMPT) - 3)                       # into the middle of the second block
    assert s.position == len(PROMPT) - 3 and s.tokens == PROMPT[:-3]
    assert close(s.decode(77), fresh(engine, PROMPT[:-3], 77))
    s.truncate(0)
    s.prefill([1, 2, 3])
    assert close(s.decode(4), fresh(engine, [1, 2, 3], 4))


def test_fork_continues_both_branches_independently(engine):
    s = engine.new_session()
    s.prefill(PROMPT)
    child = s.fork()
    assert child.position == s.position and child.tokens == s.tokens and child.id != s.id
    branch = child.decode(111)                        # writes into a block both share: copied first
    assert close(branch, fresh(engine, PROMPT, 111))
    child.decode(112)
    assert close(s.decode(50), fresh(engine, PROMPT, 50))   # the parent never saw the child's tokens
    grandchild = child.fork()
    child.close()
    assert close(grandchild.decode(113), fresh(engine, PROMPT + [111, 112], 113))


def test_bad_truncates_and_closed_sessions_change_nothing(engine):
    s = engine.new_session()
    s.prefill([1, 2, 3, 4])
    for bad in (5, -1, "2", 2.0, True):
        with pytest.raises(CapacityError, match=r"truncate\(.*0\.\.4"):
            s.truncate(bad)
        assert s.position == 4 and s.tokens == [1, 2, 3, 4]
    s.truncate(np.int64(2))
    assert s.position == 2
    s.close()
    with pytest.raises(SessionClosedError):
        s.truncate(0)
    with pytest.raises(SessionClosedError):
        s.fork()


@pytest.mark.parametrize("mode, kv_dtype", [("gpu", "f16"), ("layers=1", "f32")],
                         ids=["gpu-mode", "layers=1"])       # an id "gpu" is the gpu mark
def test_device_forks_share_blocks_until_written(weights, monkeypatch, mode, kv_dtype):
    """gpu mode's pool, and layers=N's float32 pool of its GPU layers (the host layers' rows are copied)."""
    fake_cuda.install(monkeypatch, mode="deferred")
    engine = Engine(weights, device="cuda", mode=mode, max_seq_len=64, max_batch=4)
    kv_stats = engine.executor.kv_stats
    base = kv_stats()["kv_blocks_used"]               # gpu mode: the scratch session's block
    s = engine.new_session()
    s.prefill(PROMPT)                                 # 23 positions: 2 blocks of 16
    assert kv_stats()["kv_blocks_used"] == base + 2 and kv_stats()["kv_dtype"] == kv_dtype
    child = s.fork()
    assert kv_stats()["kv_blocks_used"] == base + 2   # shared
    child.decode(3)
    assert kv_stats()["kv_blocks_used"] == base + 3   # the partly filled block was copied
    s.truncate(10)                                    # s gives its own second block back
    assert kv_stats()["kv_blocks_used"] == base + 2
    s.truncate(0)
    child.close()
    s.close()
    assert kv_stats()["kv_blocks_used"] == base
    engine.close()
