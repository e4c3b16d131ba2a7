"""The daemon's wire format: length-prefixed frames, a JSON header, raw arrays.

One frame:

    prefix  12 bytes  b"KS" | version u8 | flags u8 (0) | header_bytes u32 LE | payload_bytes u32 LE
    header  UTF-8 JSON object: {"op": str, "id": int, ..., "arrays": [{"name", "dtype", "shape"}, ...]}
    payload the arrays' raw little-endian bytes, concatenated in header order

Nothing here can execute code (no pickle); dtypes come from a short allow-list
and every shape is checked against the payload length, so a frame is parsed and
validated once, here, and the daemon trusts what comes out.  Framing errors
(bad magic, version, oversized lengths) leave the stream out of step and end
the connection; errors inside a well-framed header are answered and the
connection goes on.
"""
from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kestrel_stream.wire.json_limits import JSONLimitError, load_limited
from kestrel_stream.errors import CapacityError, DeviceError, InvalidTokenError, KestrelError, SessionClosedError

MAGIC = b"KS"
VERSION = 1
PREFIX = struct.Struct("<2sBBII")
PREFIX_BYTES = PREFIX.size
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024          # requests carry token ids only
MAX_RESPONSE_BYTES = 1 << 31                          # prefill logits can be large; u32 bounds a frame
MAX_ARRAYS = 8
MAX_NDIM = 4
# Little-endian only, so a frame means the same thing on every host.
DTYPES = {"<i4": np.dtype("<i4"), "<i8": np.dtype("<i8"), "<f4": np.dtype("<f4"), "<f2": np.dtype("<f2")}


class ProtocolError(KestrelError, ValueError):
    """A frame that does not follow this format; says which part and why."""
    code = "protocol"

    def __init__(self, message: str, fatal: bool = False):
        super().__init__(message)
        self.fatal = fatal          # True: the byte stream is out of step and the connection must end


class AuthError(KestrelError):
    code = "auth"


class UnknownSessionError(KestrelError, KeyError):
    """A session id this connection never opened (or already closed)."""
    code = "unknown_session"

    def __str__(self) -> str:          # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnavailableError(KestrelError):
    """An operation this daemon cannot do (e.g. tracing without the trace module)."""
    code = "unavailable"


class ShuttingDownError(KestrelError):
    code = "shutting_down"


class IdleTimeoutError(KestrelError, TimeoutError):
    """The daemon closed a connection that sent nothing for --idle-timeout-s."""
    code = "timeout"


class DaemonError(KestrelError):
    """Any other failure inside the daemon; the message is the daemon's."""
    code = "internal"


ERRORS_BY_CODE: dict[str, type[KestrelError]] = {cls.code: cls for cls in (
    InvalidTokenError, CapacityError, SessionClosedError, DeviceError, ProtocolError, AuthError,
    UnknownSessionError, UnavailableError, ShuttingDownError, IdleTimeoutError, DaemonError)}


def error_from_code(code: str, message: str) -> KestrelError:
    """The typed exception a client raises for a daemon's error response."""
    cls = ERRORS_BY_CODE.get(code, DaemonError)
    err = cls(message)
    if cls is DaemonError and code != DaemonError.code:
        err.code = code
    return err


NO_ARRAYS: list = []                # never modified


@dataclass
class Frame:
    header: dict
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


# JSON headers through the C encoder and scanner, built once.  json.dumps/json.loads wrap them in several
# Python-level calls per frame, which in a daemon that sleeps between requests run cold: about 20 us each
# against 8-10 us here.  No circular-reference check (headers are flat data); the same output as
# json.JSONEncoder(separators=(",", ":"), default=str).
_json_encoder = json.encoder.c_make_encoder and json.encoder.c_make_encoder(
    None, str, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True)


def field_int(header: dict, name: str, op: str, low: int, high: int, default=None) -> int:
    """A header's integer field `name` of request `op`, within low..high (ProtocolError naming both if not)."""
    value = header.get(name, default)
    if type(value) is not int or not low <= value <= high:
        raise ProtocolError(f"{op}: field {name!r} must be an integer in {low}..{high}, got {value!r}")
    return value


def dump_header(header: dict) -> str:
    if _json_encoder is None:           # a Python build without the _json accelerator
        return json.dumps(header, separators=(",", ":"), default=str)
    return "".join(_json_encoder(header, 0))


def load_header(text: str):
    """The JSON value of a header, within json_limits' depth, number-length and size limits."""
    return load_limited(text)


def encode_frame(header: dict, arrays: dict[str, np.ndarray] | None = None,
                 max_frame_bytes: int = MAX_RESPONSE_BYTES) -> bytes:
    """One frame as bytes; arrays are converted to their little-endian allow-listed dtype."""
    chunks, specs = [], NO_ARRAYS
    if arrays:
        specs = []
        for name, array in arrays.items():
            array = np.asarray(array)
            dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder not in "<|=" else array.dtype
            key = dtype.str
            if key not in DTYPES:
                raise ProtocolError(f"array {name!r}: dtype {array.dtype} is not one of {sorted(DTYPES)}")
            specs.append({"name": name, "dtype": key, "shape": list(array.shape)})
            chunks.append(np.ascontiguousarray(array, dtype=DTYPES[key]).tobytes())
    head = dump_header({**header, "arrays": specs}).encode()
    payload_bytes = sum(len(c) for c in chunks) if chunks else 0
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(f"frame header is {len(head)} bytes; the limit is {MAX_HEADER_BYTES}")
    if PREFIX_BYTES + len(head) + payload_bytes > max_frame_bytes:
        raise CapacityError(f"frame of {PREFIX_BYTES + len(head) + payload_bytes} bytes exceeds the "
                            f"{max_frame_bytes}-byte frame limit")
    prefix = PREFIX.pack(MAGIC, VERSION, 0, len(head), payload_bytes)
    return b"".join([prefix, head, *chunks]) if chunks else prefix + head


def parse_prefix(prefix: bytes, max_frame_bytes: int, max_header_bytes: int = MAX_HEADER_BYTES) -> tuple[int, int]:
    """(header_bytes, payload_bytes) from the 12-byte prefix; every error here is fatal.

    Before a connection is authenticated the daemon passes smaller limits (serve/limits.py)."""
    if len(prefix) != PREFIX_BYTES:
        raise ProtocolError(f"frame prefix: got {len(prefix)} of {PREFIX_BYTES} bytes", fatal=True)
    magic, version, flags, header_bytes, payload_bytes = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"frame prefix: bad magic {magic!r} (expected {MAGIC!r}); "
                            f"is this a kestrel-stream client?", fatal=True)
    if version != VERSION:
        raise ProtocolError(f"frame prefix: protocol version {version}, this side speaks {VERSION}", fatal=True)
    if flags != 0:
        raise ProtocolError(f"frame prefix: unknown flags {flags:#x}", fatal=True)
    if not 2 <= header_bytes <= max_header_bytes:
        raise ProtocolError(f"frame prefix: header length {header_bytes} outside 2..{max_header_bytes}",
                            fatal=True)
    if PREFIX_BYTES + header_bytes + payload_bytes > max_frame_bytes:
        raise ProtocolError(f"frame prefix: frame of {PREFIX_BYTES + header_bytes + payload_bytes} bytes "
                            f"exceeds the {max_frame_bytes}-byte limit", fatal=True)
    return header_bytes, payload_bytes


def parse_body(head: bytes, payload: bytes) -> Frame:
    """Header and arrays of a well-framed frame; errors here are answered, not fatal."""
    try:
        header = load_header(head.decode("utf-8"))
    except (UnicodeDecodeError, JSONLimitError) as e:
        raise ProtocolError(f"frame header: not UTF-8 JSON within the limits ({e})") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"frame header: expected a JSON object, got {type(header).__name__}")
    specs = header.pop("arrays", NO_ARRAYS)
    if specs is NO_ARRAYS or specs == []:
        if payload:
            raise ProtocolError(f"frame: payload has {len(payload)} bytes but the arrays describe 0")
        return Frame(header, {})
    if not isinstance(specs, list) or len(specs) > MAX_ARRAYS:
        raise ProtocolError(f"frame header: 'arrays' must be a list of at most {MAX_ARRAYS} entries")
    arrays, offset = {}, 0
    for i, spec in enumerate(specs):
        name, dtype, shape = parse_array_spec(spec, f"frame header: arrays[{i}]")
        if name in arrays:
            raise ProtocolError(f"frame header: arrays[{i}]: duplicate name {name!r}")
        size_bytes = math.prod(shape) * dtype.itemsize
        if offset + size_bytes > len(payload):
            raise ProtocolError(f"frame header: arrays[{i}] ({name!r}, {dtype.str} {shape}) needs {size_bytes} "
                                f"bytes at offset {offset}, but the payload has {len(payload)}")
        arrays[name] = np.frombuffer(payload, dtype, math.prod(shape), offset).reshape(shape)
        offset += size_bytes
    if offset != len(payload):
        raise ProtocolError(f"frame: payload has {len(payload)} bytes but the arrays describe {offset}")
    return Frame(header, arrays)


def parse_array_spec(spec, where: str) -> tuple[str, np.dtype, tuple[int, ...]]:
    if not isinstance(spec, dict):
        raise ProtocolError(f"{where}: expected an object with name, dtype, shape")
    name, dtype, shape = spec.get("name"), spec.get("dtype"), spec.get("shape")
    if not isinstance(name, str) or not 0 < len(name) <= 64:
        raise ProtocolError(f"{where}: 'name' must be a string of 1..64 characters")
    if type(dtype) is not str or dtype not in DTYPES:
        raise ProtocolError(f"{where} ({name!r}): dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(type(d) is int and 0 <= d < 2**31 for d in shape)):
        raise ProtocolError(f"{where} ({name!r}): shape {shape!r} must be a list of at most {MAX_NDIM} "
                            f"non-negative integers")
    return name, DTYPES[dtype], tuple(shape)


def error_header(request_id, err: BaseException) -> dict:
    code = getattr(err, "code", DaemonError.code)
    return {"id": request_id, "ok": False, "code": code, "message": str(err) or type(err).__name__}


# -- where a daemon listens by default -----------------------------------------------------
SOCKET_NAME = "kestrel-stream.sock"
TOKEN_NAME = "kestrel-stream.token"


def fallback_runtime_dir(xdg_runtime_dir: Path | None) -> Path | None:
    """$TMPDIR/kestrel-<uid>/ (/tmp/kestrel-<uid>/ without $TMPDIR) when $XDG_RUNTIME_DIR (Environment.runtime_dir)
    is unset or not a directory, else None."""
    if xdg_runtime_dir and xdg_runtime_dir.is_dir():
        return None
    return Path(tempfile.gettempdir()) / f"kestrel-{os.getuid()}"


def make_runtime_dir(xdg_runtime_dir: Path | None) -> Path | None:
    """Make the fallback directory if it is the one in use and missing; return it when this call made it
    (the daemon then removes it at exit, once empty)."""
    path = fallback_runtime_dir(xdg_runtime_dir)
    if path is None or path.exists():
        return None
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:         # made by another process just now: theirs to remove
        return None
    return path


def runtime_dir(xdg_runtime_dir: Path | None) -> Path:
    """A directory only this user can enter: $XDG_RUNTIME_DIR, else $TMPDIR/kestrel-<uid>/ (made 0700)."""
    path = fallback_runtime_dir(xdg_runtime_dir)
    if path is None:
        return xdg_runtime_dir
    path.mkdir(mode=0o700, exist_ok=True)
    check_private(path, str(path), "0700")
    return path


def check_private(path: Path, what: str, mode: str) -> None:
    """`path` (`what` in the message) must be this user's, with no bits for group or others."""
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{what}: must be owned by uid {os.getuid()} with mode {mode} "
                              f"(it is uid {info.st_uid}, mode {info.st_mode & 0o777:o})")


def default_socket_path(xdg_runtime_dir: Path | None) -> Path:
    return runtime_dir(xdg_runtime_dir) / SOCKET_NAME


def default_token_path(xdg_runtime_dir: Path | None) -> Path:
    return runtime_dir(xdg_runtime_dir) / TOKEN_NAME
