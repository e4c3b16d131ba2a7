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
