"""Text generation through a real daemon: streamed token by token, sampled, stopped, batched across clients,
and the same tokens and text as the in-process Engine.generate with the same parameters."""
from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest
from daemon_helpers import raw_connect, read_frame

import kestrel_stream as ks
from kestrel_stream.wire import protocol as wire

SAMPLED = dict(temperature=0.9, top_k=30, top_p=0.9, min_p=0.02, seed=1234)
PENALIZED = dict(temperature=0.7, repeat_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1, seed=99)


def test_each_token_is_its_own_frame_sent_before_the_next_step(daemon, daemon_engine):
    prompt = daemon_engine.tokenizer.encode("Once upon a time")
    count = 12
    sock = raw_connect(daemon.address)
    try:
        sock.sendall(wire.encode_frame({"op": "open", "id": 1}))
        session = read_frame(sock).header["session"]
        sock.sendall(wire.encode_frame({"op": "generate", "id": 2, "session": session, "n": count, "stream": True},
                                       {"ids": np.asarray(prompt, np.int64)}))
        frames = [read_frame(sock)]
        while not frames[-1].header.get("done"):
            frames.append(read_frame(sock))
    finally:
        sock.close()
    pieces, final = frames[:-1], frames[-1]
    assert all(f.header["id"] == 2 and f.header["ok"] for f in frames)
    assert len(pieces) == count == len(final.arrays["tokens"])
    # The first frame left when the session held the prompt alone: before any of the other steps ran.
    assert [f.header["position"] for f in pieces] == [len(prompt) + i for i in range(count)]
    assert final.header["position"] == len(prompt) + count - 1
    assert [f.header["token"] for f in pieces] == final.arrays["tokens"].tolist()
    assert "".join(f.header["text"] for f in pieces) == final.header["text"]
    assert final.header["stop_reason"] == "length"


def test_first_piece_arrives_while_the_generation_goes_on(daemon, daemon_engine):
    with ks.Client(daemon.address) as client:
        stream = client.generate("The", 40, stream=True)
        first = next(stream)
        assert stream.result is None                    # the answer with the whole text has not come yet
        rest = list(stream)
    assert [first.token] + [p.token for p in rest] == stream.result.tokens
    assert len(rest) == 39


@pytest.mark.parametrize("params", [{}, SAMPLED, PENALIZED], ids=["greedy", "sampled", "penalized"])
def test_stream_joined_equals_answer_equals_in_process(daemon, daemon_engine, params):
    expected = daemon_engine.generate("Hello world", 24, **params)
    with ks.Client(daemon.address) as client:
        stream = client.generate("Hello world", 24, stream=True, **params)
        pieces = list(stream)
        answer = client.generate("Hello world", 24, **params)
    assert "".join(p.text for p in pieces) == stream.result.text == answer.text == expected.text
    assert [p.token for p in pieces] == stream.result.tokens == answer.tokens == expected.tokens
    assert answer.stop_reason == stream.result.stop_reason == expected.stop_reason == "length"


def test_same_seed_same_tokens_other_seed_other_tokens(daemon, daemon_engine):
    with ks.Client(daemon.address) as client:
        a = client.generate([5, 6, 7], 32, **SAMPLED)
        b = client.generate([5, 6, 7], 32, **SAMPLED)
        c = client.generate([5, 6, 7], 32, **{**SAMPLED, "seed": 4321})
    assert a == b == daemon_engine.generate([5, 6, 7], 32, **SAMPLED).tokens
    assert c != a


def test_a_stop_string_ends_it_with_reason_stop(daemon, daemon_engine):
    full = daemon_engine.generate("Hello", 40, **SAMPLED).text
    stop = full[len(full) // 2:][:2]
    expected = daemon_engine.generate("Hello", 40, stop=[stop], **SAMPLED)
    assert expected.stop_reason == "stop" and stop not in expected.text
    with ks.Client(daemon.address) as client:
        stream = client.generate("Hello", 40, stream=True, stop=[stop], **SAMPLED)
        joined = "".join(p.text for p in stream)
        answer = client.generate("Hello", 40, stop=stop, **SAMPLED)
    assert joined == answer.text == expected.text
    assert stream.result.stop_reason == answer.stop_reason == "stop"
    assert answer.tokens == expected.tokens


def test_async_client_iterates_the_stream(daemon, daemon_engine):
    expected = daemon_engine.generate("Hello world", 16, **SAMPLED)

    async def main():
        async with await ks.AsyncClient.connect(daemon.address) as client:
            generation = client.generate("Hello world", 16, stream=True, **SAMPLED)
            pieces = [piece async for piece in generation]
            answer = await client.generate("Hello world", 16, **SAMPLED)
            return pieces, generation.result, answer

    pieces, result, answer = anyio.run(main)
    assert "".join(p.text for p in pieces) == result.text == answer.text == expected.text
    assert [p.token for p in pieces] == result.tokens == answer.tokens == expected.tokens


def test_concurrent_streams_share_engine_steps(daemon, daemon_engine):
    prompts = ["a", "bb", "ccc", "dddd"]
    expected = {p: daemon_engine.generate(p, 30, **SAMPLED).tokens for p in prompts}
    got, errors, start = {}, [], threading.Barrier(len(prompts))

    def run(prompt):
        try:
            with ks.Client(daemon.address) as client:
                start.wait()
                got[prompt] = [piece.token for piece in client.generate(prompt, 30, stream=True, **SAMPLED)]
        except Exception as e:          # reported below, with the test's own assert
            errors.append(e)

    with ks.Client(daemon.address) as probe:
        before = probe.stats()
        threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        after = probe.stats()
    assert not errors and got == expected
    steps = after["batches"] - before["batches"]
    assert after["batched_requests"] - before["batched_requests"] > steps     # some steps held several sessions


BAD_FIELDS = [
    ({"temperature": -1}, "'temperature' must be a number >= 0"),
    ({"temperature": "hot"}, "'temperature'"),
    ({"top_k": 2.5}, "'top_k' must be an integer"),
    ({"top_k": True}, "'top_k'"),
    ({"top_p": 0}, "'top_p' must be a number in \\(0, 1\\]"),
    ({"min_p": 1.5}, "'min_p'"),
    ({"repeat_penalty": 0}, "'repeat_penalty'"),
    ({"presence_penalty": 1e9}, "'presence_penalty'"),
    ({"frequency_penalty": None, "repeat_last_n": -2}, "'repeat_last_n'"),
    ({"seed": -1}, "'seed' must be an integer in 0..2\\*\\*64-1"),
    ({"seed": 2**64}, "'seed'"),
    ({"seed": "7"}, "'seed'"),
    ({"stop": "x"}, "'stop' must be a list"),
    ({"stop": [""]}, "'stop'"),
    ({"stop": ["x"] * 17}, "'stop'"),
    ({"stream": 1}, "'stream' must be true or false"),
    ({"ignore_eos": "yes"}, "'ignore_eos'"),
    ({"n": -1}, "'n' must be an integer in 0..128"),
    ({"n": 10**6}, "'n'"),
    ({"prompt": 5}, "'prompt' must be a string"),
    ({"prompt": ""}, "'prompt'"),
    ({"prompt": "hi", "ids": True}, "not both"),
    ({"no_prompt": True}, "expected the field 'prompt'"),
]


@pytest.mark.parametrize("fields,match", BAD_FIELDS, ids=[",".join(f) for f, _ in BAD_FIELDS])
def test_bad_fields_are_refused_and_change_nothing(daemon, fields, match):
    fields = dict(fields)
    arrays = {} if "prompt" in fields or fields.pop("no_prompt", False) else {"ids": np.array([1, 2], np.int64)}
    if fields.pop("ids", False):
        arrays = {"ids": np.array([1, 2], np.int64)}
    with ks.Client(daemon.address) as client, client.new_session() as s:
        with pytest.raises(wire.ProtocolError, match=match):
            client.call("generate", {"session": s.id, "n": 4, **fields}, arrays)
        assert client.call("stats", {}, {})[0]["stats"]["sessions"] >= 1
        assert s.generate([1, 2], 3).position == 4        # the session was untouched: the prompt starts at 0


def test_leaving_a_stream_early_keeps_the_connection_usable(daemon, daemon_engine):
    with ks.Client(daemon.address) as client:
        stream = client.generate("Hello", 20, stream=True)
        next(stream)
        stream.close()                                  # the rest of its frames are read and dropped
        assert client.generate([1, 2], 3) == daemon_engine.generate([1, 2], 3).tokens
        assert client.stats()["sessions"] == 0


def test_async_stream_left_early_inside_aclosing_closes_its_connection(daemon, daemon_engine):
    from contextlib import aclosing

    async def main():
        async with await ks.AsyncClient.connect(daemon.address) as client:
            async with aclosing(client.generate("Hello", 30, stream=True).__aiter__()) as pieces:
                async for _ in pieces:
                    break
            left_closed = client.closed
        async with await ks.AsyncClient.connect(daemon.address) as other:
            return left_closed, await other.generate([1, 2], 3)

    left_closed, tokens = anyio.run(main)
    assert left_closed and tokens == daemon_engine.generate([1, 2], 3).tokens
