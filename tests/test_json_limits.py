"""Header JSON within explicit limits (kestrel_stream/wire/json_limits.py), and parse_body turning every failure
of a hostile header into a ProtocolError."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kestrel_stream.wire import protocol as wire
from daemon_helpers import decode_frame
from kestrel_stream.wire.json_limits import MAX_DEPTH, MAX_NUMBER_CHARS, JSONLimitError, load_limited


def test_ordinary_headers_parse_as_json_does():
    for text in ['{"op":"decode","id":3,"session":1,"token":5}', ' {"a": [1, 2.5, -3e2, true, null, "x"]} ',
                 '{"token":"' + "1" * 100 + '"}', json.dumps({"arrays": [{"shape": [1]}] * 8}), '"\\u00e9"']:
        assert load_limited(text) == json.loads(text)


@pytest.mark.parametrize("text, message", [
    ("1" * (MAX_NUMBER_CHARS + 1), "a number of"),
    ('{"id":' + "9" * 5000 + "}", "a number of"),
    ("0." + "1" * MAX_NUMBER_CHARS, "a number of"),
    ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "nesting"),
    ('{"a":' * 1000 + "1" + "}" * 1000, "nesting"),
    ('{"token":"\\ud800"}', "lone surrogate"),
    ('{"\\udfff":1}', "lone surrogate"),
    ('{"a":NaN}', "NaN"), ("-Infinity", "Infinity"),
    ('{"a":1} {}', "extra data"), ("", "not JSON"), ("{'a': 1}", "property name"),
])
def test_hostile_json_is_refused_with_what_broke(text, message):
    with pytest.raises(JSONLimitError, match=message):
        load_limited(text)


def test_strings_that_look_deep_or_numeric_are_not_refused():
    text = json.dumps({"path": "[" * 100 + "1" * 100})
    assert load_limited(text) == json.loads(text)


@pytest.mark.parametrize("head", [
    b'{"id":' + b"1" * 4400 + b"}", b"[" * 1000 + b"]" * 1000, b'{"token":"\\ud800"}', b"\xff\xfe",
    json.dumps({"op": "prefill", "arrays": [{"name": "ids", "dtype": ["<i8"], "shape": [1]}]}).encode(),
    json.dumps({"op": "prefill", "arrays": [{"name": "ids", "dtype": {"a": 1}, "shape": [1]}]}).encode(),
])
def test_parse_body_answers_every_hostile_header_with_a_protocol_error(head):
    with pytest.raises(wire.ProtocolError) as caught:
        wire.parse_body(head, b"\0" * 8)
    assert not caught.value.fatal


def test_parse_prefix_takes_the_smaller_limits_of_a_connection_before_hello():
    frame = wire.encode_frame({"op": "hello", "id": 1, "pad": "x" * 5000})
    assert decode_frame(frame).header["pad"] == "x" * 5000
    with pytest.raises(wire.ProtocolError, match="outside 2..4096") as caught:
        wire.parse_prefix(frame[:wire.PREFIX_BYTES], 4096, 4096)
    assert caught.value.fatal
    frame = wire.encode_frame({"op": "prefill"}, {"ids": np.zeros(4, np.int64)})
    assert wire.parse_prefix(frame[:wire.PREFIX_BYTES], 4096, 4096)[1] == 32


WALKED_SAME = ['{"a":[1,2,{"b":[3,{"c":"x"}]}],"d":"\\u00e9","e":{}}', "[]", ' {"a" : [ ] , "b":[ 1 , 2 ] } ', '"s"',
               '"a\\nb\\"c\\\\d\\/e\\u00e9\\ud83d\\ude00f"', "[null, false, true, -1.5e3, 0]",
               json.dumps({"messages": [{"role": "user", "content": "y" * 200_000 + "\n" + "z" * 70_000}]})]


@pytest.mark.parametrize("text", WALKED_SAME)
def test_walked_parse_equals_json(text):
    from kestrel_stream.wire.json_limits import load_walked
    assert load_walked(text, 1 << 20) == json.loads(text)


@pytest.mark.parametrize("text, message", [
    ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "nesting"), ('{"a":' + "1" * 50 + "}", "a number of"),
    ('{"\\ud800":1}', "lone surrogate"), ('"\\ud83dx"', "lone surrogate"), ('{"a":NaN}', "NaN"),
    ('{"a":1,}', "property name"), ("[1 2]", "expecting ','"), ('"ab', "unterminated"), ('"a\tb"', "control"),
    ('"\\x"', "invalid escape"), ("[1]  x", "extra data"), ("  ", "not JSON"),
])
def test_walked_parse_refuses_what_load_limited_refuses(text, message):
    from kestrel_stream.wire.json_limits import load_walked
    with pytest.raises(JSONLimitError, match=message):
        load_walked(text, 1 << 20)


def test_walked_parse_stops_at_the_first_item_past_the_limit_naming_the_key():
    from kestrel_stream.wire.json_limits import load_walked
    with pytest.raises(JSONLimitError) as caught:
        load_walked(json.dumps({"model": "m", "messages": [{"role": "user"}] * 100}), 1 << 20, max_items=10)
    assert caught.value.where == "messages" and "more than 10 items" in str(caught.value)
    assert load_walked('{"prompt": [1, 2, 3]}', 100, max_items=3) == {"prompt": [1, 2, 3]}
