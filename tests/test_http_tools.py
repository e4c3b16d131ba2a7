"""Tool calling in /v1/chat/completions through the real openai client, on the tiny model (random weights, a
template that knows no tools: the fallback prompt): a forced call (tool_choice required or a named function) is
always a call of an offered function with arguments valid for its schema, whole or streamed; tool results go
back in; bad tool fields are 400s naming the field."""
from __future__ import annotations

import json

import jsonschema
import pytest
from http_helpers import HttpDaemon, chat_model

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

MODEL = "m"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
SAMPLED = dict(temperature=0.9, seed=5, max_tokens=160)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    where = tmp_path_factory.mktemp("tools")
    d = HttpDaemon(chat_model(where / "model"), where, "--served-model-name", MODEL, "--no-access-log")
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base_url, api_key="none", max_retries=0, timeout=120)


def valid_calls(choice, names=frozenset(SCHEMAS)) -> list:
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and calls and choice.message.content is None, choice
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


def test_a_named_function_is_always_called_with_valid_arguments(client):
    for seed in range(3):
        answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, **{**SAMPLED, "seed": seed},
                                                tool_choice={"type": "function", "function": {"name": "add"}})
        assert [c.function.name for c in valid_calls(answer.choices[0])] == ["add"]


def test_required_calls_one_offered_function_per_choice(client):
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", n=2,
                                            **SAMPLED)
    assert [len(valid_calls(c)) for c in answer.choices] == [1, 1]
    assert answer.usage.completion_tokens > 0


def test_streamed_calls_are_the_whole_answers(client):
    body = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=True, **SAMPLED)
    whole = valid_calls(client.chat.completions.create(**body).choices[0])
    streamed, reasons, content = {}, [], ""
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                streamed[delta.index] = (delta.id, delta.function.name, delta.function.arguments)
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert content == "" and reasons == ["tool_calls"]
    assert [(name, json.loads(args)) for _, name, args in streamed.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole]
    assert sorted(streamed) == list(range(len(whole))) and all(i.startswith("call_") for i, _, _ in streamed.values())


def test_a_tool_result_goes_back_and_the_answer_is_text(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, **SAMPLED,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = first.choices[0].message
    call = valid_calls(first.choices[0])[0]
    history = [*ASK, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 18})}]
    alone = {}                 # the prompt's tokens without the call and its result
    for choice in ("none", "auto"):
        alone[choice] = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                       max_tokens=1).usage.prompt_tokens
        answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice=choice,
                                                temperature=0, max_tokens=12)
        reply = answer.choices[0]
        if choice == "none":
            assert reply.message.tool_calls is None and reply.finish_reason in ("stop", "length")
            assert isinstance(reply.message.content, str)
        # the byte-level prompt grew by the call's and the result's text, at least
        assert answer.usage.prompt_tokens > alone[choice] + len(call.function.arguments) + len('{"celsius": 18}')
    assert alone["auto"] > alone["none"] + len(json.dumps(TOOLS))         # tools offered but under "none"


def test_auto_with_a_response_format_is_a_call_or_a_document(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    for seed in range(3):
        answer = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, **{**SAMPLED, "seed": seed},
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
        choice = answer.choices[0]
        if choice.message.tool_calls:
            valid_calls(choice)
        else:
            assert choice.finish_reason == "stop" and set(json.loads(choice.message.content)) == {"ok"}


BAD = [
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "send_email"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"function": {"name": "add"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"messages": [*ASK, {"role": "tool", "content": "18"}]}, "messages[1].tool_call_id"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "18"}]}, "messages[1].tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "add", "arguments": "{a: 1"}}]}]}, "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"type": "function"}]}]}, "messages[1].tool_calls[0]"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
]


@pytest.mark.parametrize("fields,param", BAD)
def test_bad_tool_fields_are_400_naming_the_field(daemon, fields, param):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **fields}
    answer = httpx.post(daemon.base_url + "/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.text


def test_tools_are_refused_on_completions_and_a_schema_the_compiler_refuses_is_named(daemon):
    answer = httpx.post(daemon.base_url + "/completions", json={"model": MODEL, "prompt": "x", "tools": TOOLS})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tools"
    bad = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}]
    answer = httpx.post(daemon.base_url + "/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "tools": bad, "tool_choice": "required"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tools[1].function.parameters", answer.text
