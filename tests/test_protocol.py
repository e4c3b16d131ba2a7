"""Wire frames: round trips, every limit, the dtype allow-list, and errors that say where."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import kestrel_stream as ks
from kestrel_stream.wire import protocol as wire
from daemon_helpers import decode_frame


def raw_frame(header, payload=b"", magic=b"KS", version=wire.VERSION, flags=0, header_len=None, payload_len=None):
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (wire.PREFIX.pack(magic, version, flags, len(head) if header_len is None else header_len,
                             len(payload) if payload_len is None else payload_len) + head + payload)


def test_round_trip_keeps_header_dtypes_and_shapes():
    arrays = {"ids": np.array([1, 2, 3], np.int64), "logits": np.arange(12, dtype=np.float32).reshape(3, 4),
              "half": np.ones((2, 0), np.float16), "small": np.array([7], np.int32)}
    frame = decode_frame(wire.encode_frame({"op": "prefill", "id": 9, "session": 4}, arrays))
    assert frame.header == {"op": "prefill", "id": 9, "session": 4}
    for name, array in arrays.items():
        assert frame.arrays[name].dtype == array.dtype and frame.arrays[name].shape == array.shape
        np.testing.assert_array_equal(frame.arrays[name], array)


def test_big_endian_input_goes_out_little_endian():
    data = wire.encode_frame({"op": "x"}, {"v": np.array([1.5, -2.0], dtype=">f4")})
    frame = decode_frame(data)
    assert frame.arrays["v"].dtype.str == "<f4" and frame.arrays["v"].tolist() == [1.5, -2.0]
    assert data.endswith(np.array([1.5, -2.0], "<f4").tobytes())


@pytest.mark.parametrize("dtype", [np.float64, np.uint8, np.int16, np.bool_, object])
def test_encode_refuses_dtypes_off_the_allow_list(dtype):
    with pytest.raises(wire.ProtocolError, match="not one of"):
        wire.encode_frame({"op": "x"}, {"a": np.zeros(2, dtype)})


@pytest.mark.parametrize("frame, match", [
    (raw_frame({"op": "x"}, magic=b"HT"), "bad magic"),
    (raw_frame({"op": "x"}, version=2), "version 2"),
    (raw_frame({"op": "x"}, flags=1), "flags"),
    (raw_frame({"op": "x"}, header_len=0), "header length 0"),
    (raw_frame({"op": "x"}, header_len=wire.MAX_HEADER_BYTES + 1), "header length"),
    (raw_frame({"op": "x"}, payload_len=2**32 - 1), "exceeds"),
])
def test_framing_errors_are_fatal(frame, match):
    with pytest.raises(wire.ProtocolError, match=match) as info:
        decode_frame(frame)
    assert info.value.fatal


def test_frame_limit_is_configurable():
    data = wire.encode_frame({"op": "x"}, {"a": np.zeros(1000, np.float32)})
    decode_frame(data, max_frame_bytes=len(data))
    with pytest.raises(wire.ProtocolError, match="exceeds"):
        decode_frame(data, max_frame_bytes=len(data) - 1)
    with pytest.raises(ks.CapacityError, match="frame limit"):
        wire.encode_frame({"op": "x"}, {"a": np.zeros(1000, np.float32)}, max_frame_bytes=100)


@pytest.mark.parametrize("header, payload, match", [
    (b"{not json", b"", "not UTF-8 JSON"),
    (b"\xff\xfe", b"", "not UTF-8 JSON"),
    (b"[1, 2]", b"", "expected a JSON object"),
    ({"arrays": {"a": 1}}, b"", "'arrays' must be a list"),
    ({"arrays": [1]}, b"", r"arrays\[0\]: expected an object"),
    ({"arrays": [{"name": "a", "dtype": "<f8", "shape": [1]}]}, b"\0" * 8, r"arrays\[0\] \('a'\): dtype '<f8'"),
    ({"arrays": [{"name": "a", "dtype": "|O", "shape": [1]}]}, b"\0" * 8, "dtype"),
    ({"arrays": [{"name": "a", "dtype": "<i4", "shape": [-1]}]}, b"", "non-negative"),
    ({"arrays": [{"name": "a", "dtype": "<i4", "shape": [1, 1, 1, 1, 1]}]}, b"\0" * 4, "at most 4"),
    ({"arrays": [{"name": "a", "dtype": "<i4", "shape": [True]}]}, b"\0" * 4, "non-negative"),
    ({"arrays": [{"name": "", "dtype": "<i4", "shape": [1]}]}, b"\0" * 4, "'name'"),
    ({"arrays": [{"name": "a", "dtype": "<i4", "shape": [3]}]}, b"\0" * 8, r"needs 12 bytes at offset 0.*has 8"),
    ({"arrays": [{"name": "a", "dtype": "<i4", "shape": [1]}]}, b"\0" * 8, "payload has 8 bytes but the arrays describe 4"),
    ({"arrays": [{"name": "a", "dtype": "<i4", "shape": [1]}] * 2}, b"\0" * 8, "duplicate name"),
    ({"arrays": [{"name": "a", "dtype": "<i4", "shape": [2**40]}]}, b"", "non-negative"),
])
def test_header_errors_name_the_field_and_are_not_fatal(header, payload, match):
    with pytest.raises(wire.ProtocolError, match=match) as info:
        decode_frame(raw_frame(header, payload))
    assert not info.value.fatal


def test_truncated_frame_is_fatal():
    data = wire.encode_frame({"op": "x"}, {"a": np.zeros(4, np.int32)})
    with pytest.raises(wire.ProtocolError, match="announces") as info:
        decode_frame(data[:-3])
    assert info.value.fatal
    with pytest.raises(wire.ProtocolError, match="prefix: got 5"):
        decode_frame(data[:5])


def test_parsed_arrays_are_read_only_views():
    frame = decode_frame(wire.encode_frame({"op": "x"}, {"a": np.arange(3, dtype=np.int32)}))
    with pytest.raises(ValueError):
        frame.arrays["a"][0] = 5


@pytest.mark.parametrize("code, cls", [("invalid_token", ks.InvalidTokenError), ("capacity", ks.CapacityError),
                                       ("session_closed", ks.SessionClosedError), ("device", ks.DeviceError),
                                       ("unknown_session", wire.UnknownSessionError), ("auth", wire.AuthError),
                                       ("protocol", wire.ProtocolError), ("unavailable", wire.UnavailableError)])
def test_error_codes_map_to_the_engine_exception_classes(code, cls):
    err = wire.error_from_code(code, "session 3 prefill: bad")
    assert type(err) is cls and str(err) == "session 3 prefill: bad" and err.code == code


def test_unknown_error_code_keeps_code_and_message():
    err = wire.error_from_code("brand_new", "something")
    assert isinstance(err, wire.DaemonError) and err.code == "brand_new" and str(err) == "something"
    header = wire.error_header(5, ks.CapacityError("full"))
    assert header == {"id": 5, "ok": False, "code": "capacity", "message": "full"}


def test_prefix_layout_is_twelve_little_endian_bytes():
    data = wire.encode_frame({"op": "x"})
    magic, version, flags, header_bytes, payload_bytes = struct.unpack("<2sBBII", data[:12])
    assert (magic, version, flags, payload_bytes) == (b"KS", 1, 0, 0)
    assert json.loads(data[12:12 + header_bytes]) == {"op": "x", "arrays": []}
