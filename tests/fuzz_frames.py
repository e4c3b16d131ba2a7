"""Malformed daemon frames built by rule, for tests/test_daemon_fuzz.py.

``answered_frames``: well framed, wrong inside (every header field of every op
with wrong types, missing and extra fields, arrays whose dtype/shape/bytes
disagree, NaN/inf, out-of-range ids, unknown ops and sessions, deep nesting,
huge numbers, lone surrogates): an authenticated daemon answers each one and
reads on.  ``fatal_frames``: framing errors and truncated frames, after which
the stream is out of step: at most one answer, then the daemon hangs up.
"""
from __future__ import annotations

import itertools
import json
import struct

import numpy as np

from kestrel_stream.wire import protocol as wire

DEEP = "[" * 1000 + "]" * 1000
RAW = {                       # JSON text that json.dumps cannot write, or that breaks a limit
    "nan": "NaN", "inf": "Infinity", "-inf": "-Infinity", "surrogate": '"\\ud800"', "low": '"a\\udfffb"',
    "huge_int": "1" * 4400, "huge_neg": "-" + "9" * 600, "huge_float": "1e999", "long_fraction": "0." + "1" * 80,
    "deep_list": DEEP, "deep_object": '{"a":' * 600 + "1" + "}" * 600,
}
WRONG = [None, True, False, 0, -1, 2**31, 2**63, 10**25, 1.5, -0.0, "", "x", "1", "<i8", [], [1], [None],
         {}, {"a": 1}, *(f"@raw:{name}" for name in RAW)]


def header_text(header: dict) -> bytes:
    text = json.dumps(header)
    for name, raw in RAW.items():
        text = text.replace(json.dumps(f"@raw:{name}"), raw)
    return text.encode()


def frame(header, payload: bytes = b"", **prefix) -> bytes:
    head = header if isinstance(header, bytes) else header_text(header)
    fields = {"magic": wire.MAGIC, "version": wire.VERSION, "flags": 0, "header_len": len(head),
              "payload_len": len(payload), **prefix}
    return wire.PREFIX.pack(fields["magic"], fields["version"], fields["flags"], fields["header_len"],
                            fields["payload_len"]) + head + payload


def ids_spec(values, dtype="<i8", name="ids"):
    data = np.asarray(values, dtype)
    return {"name": name, "dtype": dtype, "shape": list(data.shape)}, data.tobytes()


def templates(session: int, vocab: int) -> dict[str, tuple[dict, bytes]]:
    """A valid request of each op (cheap to run); the rules below break them."""
    spec, payload = ids_spec([1, 2])
    return {
        "hello": ({"op": "hello", "id": 1, "v": wire.VERSION}, b""),
        "open": ({"op": "open", "id": 2, "max_seq_len": 8}, b""),
        "prefill": ({"op": "prefill", "id": 3, "session": session, "want": "token", "arrays": [spec]}, payload),
        "decode": ({"op": "decode", "id": 4, "session": session, "token": 1, "want": "topk", "k": 2}, b""),
        "generate": ({"op": "generate", "id": 5, "session": session, "n": 1, "arrays": [spec]}, payload),
        "reset": ({"op": "reset", "id": 6, "session": session}, b""),
        "stats": ({"op": "stats", "id": 7}, b""),
        "trace_start": ({"op": "trace_start", "id": 8, "path": "../escape.json"}, b""),
        "trace_stop": ({"op": "trace_stop", "id": 9}, b""),
    }


def wrong_fields(session: int, vocab: int):
    for op, (header, payload) in templates(session, vocab).items():
        for name in [*header, "arrays", "want", "k", "token", "session"]:
            for value in WRONG:
                yield frame({**header, name: value}, payload)
            if name in header:                          # missing
                yield frame({k: v for k, v in header.items() if k != name}, payload)
        for extra in ("extra", "", "@raw:surrogate", "arrays2", "op "):
            yield frame({**header, extra: [1, {"x": None}]}, payload)


def array_disagreements(session: int):
    base = {"op": "prefill", "id": 11, "session": session, "want": "token"}
    for dtype in ["<i2", ">i8", "|u1", "<f8", "int64", "", None, 5, [], ["<i8"], {"a": 1}, {}, "@raw:surrogate"]:
        yield frame({**base, "arrays": [{"name": "ids", "dtype": dtype, "shape": [2]}]}, b"\0" * 16)
    for shape in [[-1], [2**31], [2**31 - 1], [1.5], ["1"], [None], [1, 1, 1, 1, 1], 5, None, [[1]], [True],
                  {}, "@raw:huge_int", [2**30, 2**30, 2**30, 2**30]]:
        yield frame({**base, "arrays": [{"name": "ids", "dtype": "<i8", "shape": shape}]}, b"\0" * 16)
    for declared, sent in [(2, 0), (2, 8), (2, 15), (2, 17), (2, 24), (0, 8), (1, 4)]:
        yield frame({**base, "arrays": [{"name": "ids", "dtype": "<i8", "shape": [declared]}]}, b"\1" * sent)
    for name in [None, "", 5, ["ids"], "x" * 65, "@raw:surrogate"]:
        yield frame({**base, "arrays": [{"name": name, "dtype": "<i8", "shape": [1]}]}, b"\1" + b"\0" * 7)
    spec, payload = ids_spec([1])
    yield frame({**base, "arrays": [spec, spec]}, payload * 2)                      # duplicate name
    yield frame({**base, "arrays": [dict(spec, name=f"a{i}") for i in range(9)]}, payload * 9)
    for arrays in [{}, {"ids": spec}, "ids", 7, [None], [[spec]], [spec, 1]]:
        yield frame({**base, "arrays": arrays}, payload)
    for values, dtype in [([np.nan, 1.0], "<f4"), ([np.inf], "<f4"), ([-np.inf, np.nan], "<f2"), ([1.5], "<f4"),
                          ([-1], "<i8"), ([2**31 - 1], "<i4"), ([-2**63], "<i8"), ([2**62], "<i8"), ([], "<i8")]:
        spec, payload = ids_spec(values, dtype)
        for op in ("prefill", "generate"):
            yield frame({**base, "op": op, "n": 1, "arrays": [spec]}, payload)


def out_of_range(session: int, vocab: int):
    for token in [-1, vocab, vocab + 1, 2**31, 2**40, -2**63, 10**19]:
        yield frame({"op": "decode", "id": 12, "session": session, "token": token}, b"")
        spec, payload = ids_spec([token % 2**63 if token > 2**62 else token])
        yield frame({"op": "prefill", "id": 13, "session": session, "arrays": [spec]}, payload)
    for sid in [session + 1, session + 1000, -1, 0, 2**31, 2**63, 10**30]:
        for op in ("decode", "reset", "close", "prefill"):
            yield frame({"op": op, "id": 14, "session": sid, "token": 1}, b"")
    for k in [0, -1, vocab + 1, 2**40]:
        yield frame({"op": "decode", "id": 15, "session": session, "token": 1, "want": "topk", "k": k}, b"")
    for n in [-1, 10**6, 2**63]:
        spec, payload = ids_spec([1])
        yield frame({"op": "generate", "id": 16, "session": session, "n": n, "arrays": [spec]}, payload)
    for length in [0, -1, 10**6, 2**63]:
        yield frame({"op": "open", "id": 17, "max_seq_len": length}, b"")


def unknown_ops():
    for i in range(60):
        yield frame({"op": f"op_{i}" if i % 3 else ["__init__", "_check", "handle", "op_decode", "1x", " stats",
                                                     "STATS", "decode\0", "hello", "shutdown"][i % 10], "id": i}, b"")


def bad_documents():
    for text in [b"", b" ", b"{", b"}", b"[1]", b"33", b"null", b'"x"', b"\xff\xfe", b"{\"op\": \"stats\"} x",
                 b"{'op': 'stats'}", b'{"op":"stats","op":"decode"}', b"\xed\xa0\x80", b'{"op":"st\\u0000"}',
                 b'{"a":' * 40 + b"1" + b"}" * 40, b"[" * 17 + b"]" * 17, b"\x00" * 8, "{\"op\":\"é\"}".encode("latin-1")]:
        if len(text) >= 2:
            yield frame(text)
    for name, raw in RAW.items():
        yield frame(f'{{"op":"stats","id":{raw}}}'.encode())
        yield frame(f'{{"op":"stats","id":1,"x":{raw}}}'.encode())
        yield frame(f"{raw}".encode())


def answered_frames(session: int, vocab: int) -> list[bytes]:
    frames = [*wrong_fields(session, vocab), *array_disagreements(session), *out_of_range(session, vocab),
              *unknown_ops(), *bad_documents()]
    return [f for f in frames if len(f) - wire.PREFIX_BYTES <= wire.MAX_HEADER_BYTES]


def fatal_frames() -> list[bytes]:
    """Each ends its connection; the last ones are truncated (the client stops sending mid-frame)."""
    good = frame({"op": "stats", "id": 1})
    out = []
    for magic in [b"HT", b"ks", b"\0\0", b"SK"]:
        out.append(frame({"op": "stats"}, magic=magic))
    for version in [0, 2, 255]:
        out.append(frame({"op": "stats"}, version=version))
    for flags in [1, 128, 255]:
        out.append(frame({"op": "stats"}, flags=flags))
    for header_len in [0, 1, wire.MAX_HEADER_BYTES + 1, 2**31, 2**32 - 1]:
        out.append(frame({"op": "stats"}, header_len=header_len))
    for payload_len in [2**32 - 1, 2**31, 17 * 2**20, 16 * 2**20]:
        out.append(frame({"op": "stats"}, payload_len=payload_len))
    out.append(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    out.append(struct.pack("<2sBB", b"KS", 1, 0))                   # a prefix cut short
    for cut in itertools.chain(range(1, len(good)), [len(good) + 5]):
        out.append(frame({"op": "stats", "id": 1}, payload=b"\0" * 64, payload_len=1 << 20)[:cut + 12])
    return out
