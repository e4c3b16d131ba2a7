"""The socket clients take chat messages as Engine.generate does: rendered with the daemon's chat template, the
same tokens and text as in process; bad messages are refused naming the field, and the connection goes on."""
from __future__ import annotations

import anyio
import pytest
from http_helpers import HttpDaemon, chat_model

import kestrel_stream as ks

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("client-chat") / "model")


@pytest.fixture(scope="module")
def daemon(model, tmp_path_factory):
    d = HttpDaemon(model, tmp_path_factory.mktemp("d"))
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def engine(model):
    eng = ks.load(str(model), device="cpu")
    yield eng
    eng.close()


def test_chat_messages_give_engine_generates_tokens_and_text(daemon, engine):
    expected = engine.generate(MESSAGES, max_new_tokens=12, temperature=0.8, seed=5)
    with ks.Client(daemon.address) as client:
        answer = client.generate(MESSAGES, 12, temperature=0.8, seed=5)
        pieces = list(client.generate(MESSAGES, 12, stream=True, temperature=0.8, seed=5))
    assert answer.tokens == expected.tokens and answer.text == expected.text
    assert [p.token for p in pieces] == expected.tokens and "".join(p.text for p in pieces) == expected.text


def test_the_async_client_takes_them_too(daemon, engine):
    expected = engine.generate(MESSAGES, max_new_tokens=6, temperature=0.0)

    async def main():
        async with ks.AsyncClient(daemon.address) as client:
            return await client.generate(MESSAGES, 6)
    assert anyio.run(main).tokens == expected.tokens


@pytest.mark.parametrize("messages, where", [([{"role": "user"}], "messages[0]"),
                                             ([{"role": "user", "content": 3}], "messages[0]"),
                                             ([{"role": "user", "content": "x", "extra": 1}], "messages[0]")])
def test_bad_messages_are_refused_naming_the_field(daemon, messages, where):
    with ks.Client(daemon.address) as client:
        with pytest.raises(ks.KestrelError, match=r"generate: " + where.replace("[", r"\[").replace("]", r"\]")):
            client.generate(messages, 4)
        assert client.generate("still here", 2, temperature=0.0).stop_reason == "length"
