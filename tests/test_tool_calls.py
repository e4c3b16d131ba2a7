"""Tool calls read out of a model's text as it streams (hermes ``<tool_call>`` blocks, Llama 3's bare object), and
the grammar of a forced call: whatever the logits, the text is a call whose arguments are a document of the
function's parameters schema."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from http_helpers import chat_model

from kestrel_stream.text.grammar import Grammars
from kestrel_stream.text.tokenizer import load_tokenizer
from kestrel_stream.text.tool_calls import (HERMES, LLAMA3, Tool, ToolCallParser, call_format, forced_grammar)

from tool_templates import LLAMA31_STYLE, QWEN25, SMOLLM2

WEATHER = Tool("get_weather", "Weather in a city", {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False})
ADD = Tool("add", None, {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                         "required": ["a", "b"], "additionalProperties": False})


def streamed(parser: ToolCallParser, text: str, piece: int = 1) -> tuple[str, list]:
    """The content and calls of ``text`` fed ``piece`` characters at a time."""
    content, calls = "", []
    for i in range(0, len(text), piece):
        more, done = parser.push(text[i:i + piece])
        content, calls = content + more, calls + done
    more, done = parser.finish()
    return content + more, calls + done


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_hermes_calls_and_the_text_around_them(piece):
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n')
    content, calls = streamed(ToolCallParser(HERMES, frozenset({"get_weather", "add"})), text, piece)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "c"}),
                                                                 ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_text_that_is_no_call_stays_text():
    names = frozenset({"add"})
    for text in ("a < b and <tool_ is not a tag", "x <tool_call>{not json}</tool_call> y",
                 'x <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'):
        assert streamed(ToolCallParser(HERMES, names), text) == (text, [])
    # the closing tag never came (an end of generation): a whole call is still a call, a cut one is text
    assert streamed(ToolCallParser(HERMES, names), '<tool_call>\n{"name": "add", "arguments": {"a": 1}}')[1]
    assert streamed(ToolCallParser(HERMES, names), '<tool_call>\n{"name": "ad') == ('<tool_call>\n{"name": "ad', [])


def test_one_call_unless_parallel_and_string_arguments():
    block = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    _, calls = streamed(ToolCallParser(HERMES, frozenset({"add"}), max_calls=1), block * 3)
    assert len(calls) == 1 and json.loads(calls[0].arguments) == {"a": 1, "b": 2}
    assert len(streamed(ToolCallParser(HERMES, frozenset({"add"})), block * 3)[1]) == 3


def test_llama3_answer_is_a_call_or_text():
    names = frozenset({"add"})
    content, calls = streamed(ToolCallParser(LLAMA3, names), ' {"name": "add", "parameters": {"a": 4, "b": 5}}')
    assert content == "" and calls[0].name == "add" and json.loads(calls[0].arguments) == {"a": 4, "b": 5}
    assert streamed(ToolCallParser(LLAMA3, names), "It is 9.") == ("It is 9.", [])
    assert streamed(ToolCallParser(LLAMA3, names), "{oops") == ("{oops", [])


def test_the_format_follows_the_template():
    assert call_format(QWEN25) == HERMES and call_format(LLAMA31_STYLE) == LLAMA3
    assert call_format(SMOLLM2) == HERMES and call_format(None) == HERMES     # the fallback prompt's format


@pytest.fixture(scope="module")
def grammars(tmp_path_factory):
    return Grammars(load_tokenizer(chat_model(tmp_path_factory.mktemp("model"))))


def walk(grammars, grammar: str, seed: int, limit: int = 400) -> str:
    """The text a grammar lets through when each token is the best of random logits under its mask."""
    tokenizer = grammars.tokenizer
    constraint = grammars.lark(grammar, tokenizer.vocab_size)
    rng, ids = np.random.default_rng(seed), []
    while not constraint.complete and len(ids) < limit:
        token = int(np.argmax(constraint.mask(rng.normal(size=tokenizer.vocab_size).astype(np.float32))))
        if token in tokenizer.eos_ids:
            break
        ids.append(token)
        constraint.accept(token)
    assert constraint.error is None
    return tokenizer.decode(ids)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3])
def test_a_forced_call_is_a_call_of_the_schema_whatever_the_logits(grammars, fmt):
    for seed in range(6):
        text = walk(grammars, forced_grammar(fmt, [WEATHER, ADD], parallel=False), seed)
        content, calls = streamed(ToolCallParser(fmt, frozenset({"get_weather", "add"})), text)
        assert content == "" and len(calls) == 1, text
        tool = WEATHER if calls[0].name == "get_weather" else ADD
        jsonschema.validate(json.loads(calls[0].arguments), tool.parameters)


def test_parallel_calls_and_call_or_document(grammars):
    texts = [walk(grammars, forced_grammar(HERMES, [ADD], parallel=True), seed) for seed in range(4)]
    counts = [len(streamed(ToolCallParser(HERMES, frozenset({"add"})), t)[1]) for t in texts]
    assert min(counts) >= 1
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    kinds = set()
    for seed in range(8):
        text = walk(grammars, forced_grammar(HERMES, [ADD], False, schema, optional=True), seed)
        content, calls = streamed(ToolCallParser(HERMES, frozenset({"add"})), text)
        if calls:
            kinds.add("call")
        else:
            jsonschema.validate(json.loads(content), schema)
            kinds.add("document")
    assert kinds <= {"call", "document"} and kinds
