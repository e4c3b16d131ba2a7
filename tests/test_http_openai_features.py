"""OpenAI features through the real openai client: n choices (sampled as separate seeded requests would be, also
streamed and in chat), logit_bias, response_format (json_object, json_schema: constrained decoding), and
llama-server's /tokenize and /detokenize."""
from __future__ import annotations

import json

import pytest
from http_helpers import HttpDaemon, chat_model

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

MODEL = "m"
SAMPLED = dict(temperature=0.9, top_p=0.95, seed=7, max_tokens=8)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    where = tmp_path_factory.mktemp("features")
    d = HttpDaemon(chat_model(where / "model"), where, "--served-model-name", MODEL)
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base_url, api_key="none", max_retries=0, timeout=60)


def test_n_choices_are_the_separate_requests_of_seeds_seed_plus_index(client):
    many = client.completions.create(model=MODEL, prompt="Once upon", n=3, **SAMPLED)
    assert [c.index for c in many.choices] == [0, 1, 2]
    for choice in many.choices:
        one = client.completions.create(model=MODEL, prompt="Once upon", **{**SAMPLED, "seed": 7 + choice.index})
        assert choice.text == one.choices[0].text and choice.finish_reason == one.choices[0].finish_reason
    assert len({c.text for c in many.choices}) > 1
    assert many.usage.completion_tokens == 3 * 8


def test_n_choices_stream_by_index_as_the_whole_answer(client):
    whole = client.completions.create(model=MODEL, prompt="Stream", n=2, **SAMPLED)
    texts, reasons = {0: "", 1: ""}, {}
    for chunk in client.completions.create(model=MODEL, prompt="Stream", n=2, stream=True, **SAMPLED):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert [texts[0], texts[1]] == [c.text for c in whole.choices] and reasons == {0: "length", 1: "length"}


def test_n_chat_choices_streamed_and_whole(client):
    messages = [{"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, n=2, **SAMPLED)
    assert [c.index for c in whole.choices] == [0, 1]
    texts, roles = {0: "", 1: ""}, set()
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, n=2, stream=True, **SAMPLED):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.add(c.index)
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices] and roles == {0, 1}


def test_logit_bias_pushes_a_token_in_or_out(client):
    forced = client.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=0,
                                       logit_bias={"65": 100})          # the byte-level token of "A"
    assert forced.choices[0].text == "AAAAAA"
    only_b = client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0.9, seed=1,
                                       logit_bias={str(t): -100 for t in range(256) if t != 66})
    assert only_b.choices[0].text == "BBBB"


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(5))
def test_json_schema_answers_are_documents_of_the_schema(client, seed):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "json"}], max_tokens=40, temperature=0.7, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "flag", "schema": SCHEMA, "strict": True}})
    choice = answer.choices[0]
    document = json.loads(choice.message.content)
    assert choice.finish_reason == "stop" and set(document) == {"ok", "n"}
    assert isinstance(document["ok"], bool) and document["n"] in (1, 2, 3)


def test_json_object_answers_are_json_objects_or_their_prefix_at_the_limit(client):
    for seed in range(3):
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json"}],
                                                max_tokens=60, temperature=0.7, seed=seed,
                                                response_format={"type": "json_object"})
        text, reason = answer.choices[0].message.content, answer.choices[0].finish_reason
        assert text.startswith("{")
        if reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_a_schema_the_compiler_refuses_is_400_naming_it(daemon):
    bad = {"model": MODEL, "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "no-such-type"}}}}
    answer = httpx.post(daemon.base_url + "/completions", json=bad, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "response_format.json_schema.schema"


def test_tokenize_and_detokenize_as_llama_server(daemon):
    base = daemon.base_url.removesuffix("/v1")
    with httpx.Client(timeout=30) as http:
        tokens = http.post(base + "/tokenize", json={"content": "héllo"}).json()["tokens"]
        assert tokens == list("héllo".encode())             # one byte a token
        pieces = http.post(base + "/tokenize", json={"content": "hé", "with_pieces": True}).json()["tokens"]
        assert pieces == [{"id": 104, "piece": "h"}, {"id": 0xC3, "piece": [0xC3]}, {"id": 0xA9, "piece": [0xA9]}]
        assert http.post(base + "/detokenize", json={"tokens": tokens}).json() == {"content": "héllo"}
        # bodies of a megabyte and more: parsed walking their lists off the event loop, answered the same way
        assert http.post(base + "/detokenize", json={"tokens": [104] * 300_000}).json() == {"content": "h" * 300_000}
        for path, body, param in (("/tokenize", {"content": 3}, "content"),
                                  ("/tokenize", {"content": "x" * 100_000}, "content"),     # more than a prompt
                                  ("/tokenize", {"content": "x" * 1_000_000}, "content"),
                                  ("/tokenize", {"content": "x", "add_special": "no"}, "add_special"),
                                  ("/detokenize", {"tokens": [1, 999]}, "tokens"),
                                  ("/detokenize", {"tokens": "1"}, "tokens")):
            answer = http.post(base + path, json=body)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
        assert http.post(base + "/tokenize", content=b"{", headers={"Content-Type": "application/json"}).json()[
            "error"]["code"] == "invalid_json"


def test_each_of_n_choices_keeps_its_own_grammar_state(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "json"}], n=3, max_tokens=40, temperature=0.9, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "flag", "schema": SCHEMA}})
    for choice in answer.choices:
        document = json.loads(choice.message.content)
        assert choice.finish_reason == "stop" and set(document) == {"ok", "n"}
