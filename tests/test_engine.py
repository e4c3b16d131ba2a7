"""The session API: KV limits, bad input that changes nothing, batching equal to solo runs."""
from __future__ import annotations

import numpy as np
import pytest

import kestrel_stream as ks


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = ks.load(tiny_model, device="cpu", max_seq_len=64)
    yield eng
    eng.close()


def greedy(session, prompt, steps):
    out = [int(np.argmax(session.prefill(prompt)[-1]))]
    for _ in range(steps - 1):
        out.append(int(np.argmax(session.decode(out[-1]))))
    return out


def test_prefill_returns_one_row_per_token(engine):
    with engine.new_session() as s:
        logits = s.prefill([1, 2, 3])
        assert logits.shape == (3, engine.config.vocab_size) and logits.dtype == np.float32
        assert np.isfinite(logits).all()
        assert s.decode(4).shape == (engine.config.vocab_size,)
        assert s.position == 4 and s.tokens == [1, 2, 3, 4]


def test_chunked_prefill_equals_one_prefill(engine):
    with engine.new_session() as whole, engine.new_session() as parts:
        full = whole.prefill([5, 6, 7, 8, 9])
        parts.prefill([5, 6])
        tail = parts.prefill([7, 8, 9])
        np.testing.assert_allclose(tail, full[2:], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bad", [[-1], [256], [1, 2, 10**9], [], [[1, 2]], [1.5]])
def test_bad_token_ids_raise_and_change_nothing(engine, bad):
    with engine.new_session() as s, engine.new_session() as clean:
        s.prefill([1, 2])
        with pytest.raises(ks.InvalidTokenError):
            s.prefill(bad)
        assert s.position == 2
        np.testing.assert_allclose(s.decode(3), clean.prefill([1, 2, 3])[-1], rtol=1e-5, atol=1e-4)


def test_decode_rejects_out_of_range_token(engine):
    with engine.new_session() as s:
        s.prefill([1])
        with pytest.raises(ks.InvalidTokenError, match="outside the vocabulary"):
            s.decode(engine.config.vocab_size)
        assert s.position == 1


def test_kv_capacity_is_enforced_without_damage(engine):
    with engine.new_session(max_seq_len=8) as s:
        s.prefill(list(range(1, 7)))
        with pytest.raises(ks.CapacityError, match="max_seq_len=8"):
            s.prefill([1, 2, 3])
        assert s.position == 6
        s.decode(7)
        s.decode(8)
        with pytest.raises(ks.CapacityError):
            s.decode(9)
        assert s.position == 8
    with pytest.raises(ks.CapacityError):
        engine.new_session(max_seq_len=engine.max_seq_len + 1)


def test_closed_session_raises(engine):
    s = engine.new_session()
    s.prefill([1, 2])
    s.close()
    with pytest.raises(ks.SessionClosedError):
        s.decode(3)
    with pytest.raises(ks.SessionClosedError):
        engine.decode_batch([(s, 3)])


def test_reset_starts_over(engine):
    with engine.new_session() as s:
        first = greedy(s, [4, 5, 6], 5)
        s.reset()
        assert s.position == 0
        assert greedy(s, [4, 5, 6], 5) == first


def test_decode_batch_equals_solo_decodes(engine):
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
    assert batched.shape == (3, engine.config.vocab_size)
    np.testing.assert_allclose(batched, np.stack(solo), rtol=1e-5, atol=1e-4)
    with pytest.raises(ks.InvalidTokenError, match="twice"):
        engine.decode_batch([(sessions[0], 1), (sessions[0], 2)])
    with pytest.raises(ks.InvalidTokenError):
        engine.decode_batch([(sessions[0], 1), (sessions[1], -5)])
    assert [s.position for s in sessions] == [4, 2, 6]
    for s in sessions:
        s.close()


def test_unknown_device_and_mode_are_clear_errors(tiny_model):
    with pytest.raises(ks.DeviceError, match="unknown device"):
        ks.load(tiny_model, device="tpu")
    with pytest.raises(ks.DeviceError, match="unknown mode"):
        ks.load(tiny_model, mode="fast")
    with pytest.raises(ks.DeviceError, match="needs a GPU"):
        ks.load(tiny_model, device="cpu", mode="gpu")
