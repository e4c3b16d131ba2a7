"""Clients of the daemon with the in-process session API: ``ks.Client`` (blocking), ``ks.AsyncClient`` (anyio).

    with ks.connect() as client, client.new_session() as s:
        logits = s.prefill([1, 2, 3])                 # float32 [3, vocab], as Session.prefill
        token = s.decode(42, want="token")            # the greedy next token only: 4 bytes on the wire

One connection runs one request at a time (requests of a connection are
answered in order); open one client per concurrent stream and the daemon
batches their decode steps.  A daemon error is raised as the exception class
of its code (kestrel_stream.errors / protocol), with the daemon's message.

One concern, the blocking client: its session object mirrors run/session.py's Session call for call, and
each call is a frame written and an answer read here.
"""
from __future__ import annotations

import itertools
import socket
import struct
from typing import NamedTuple

import numpy as np

from kestrel_stream.errors import InvalidTokenError
from kestrel_stream.options import Environment
from kestrel_stream.wire.protocol import (MAX_RESPONSE_BYTES, PREFIX_BYTES, VERSION, Frame, ShuttingDownError, default_socket_path,
                       default_token_path, encode_frame, error_from_code, parse_body, parse_prefix)

DEFAULT_TIMEOUT_S = 60.0
RECEIVE_BYTES = 65536


class TopK(NamedTuple):
    ids: np.ndarray          # int32 [k], best first
    logits: np.ndarray       # float32 [k]


def parse_address(address, environment: Environment | None = None) -> tuple[str, object]:
    """("unix", path) or ("tcp", (host, port)) from a path, "unix:PATH" or "tcp://HOST:PORT"; without an
    address, $KESTREL_SOCKET, else the default socket (`environment`: read here when None)."""
    if address is None:
        environment = Environment.from_env() if environment is None else environment
        address = environment.socket or default_socket_path(environment.runtime_dir)
    text = str(address)
    if text.startswith("tcp://") or text.startswith("tcp:"):
        host, _, port = text.split(":", 1)[1].lstrip("/").rpartition(":")
        if not port.isdigit():
            raise ValueError(f"daemon address {text!r}: expected tcp://HOST:PORT")
        return "tcp", (host.strip("[]") or "127.0.0.1", int(port))
    return "unix", text.removeprefix("unix:")


def resolve_token(kind: str, token: str | None, environment: Environment) -> str | None:
    """A TCP connection's token: `token`, else $KESTREL_TOKEN, else the default token file's."""
    if kind != "tcp" or token:
        return token
    if environment.token:
        return environment.token
    path = default_token_path(environment.runtime_dir)
    return path.read_text().strip() if path.exists() else None


def check_response(frame: Frame, request_id: int):
    """The response's (header, arrays), or the daemon's error raised as its typed exception."""
    header = frame.header
    if header.get("op") == "shutdown":
        raise ShuttingDownError(header.get("message", "daemon shutting down"))
    if header.get("id") not in (request_id, None):
        raise ConnectionError(f"daemon answered request {header.get('id')!r}, expected {request_id}")
    if not header.get("ok"):
        raise error_from_code(str(header.get("code")), str(header.get("message")))
    return header, frame.arrays


def want_fields(want: str, k: int) -> dict:
    if want not in ("logits", "last", "token", "topk"):
        raise ValueError(f"want must be 'logits', 'last', 'token' or 'topk', got {want!r}")
    return {"want": want, "k": int(k)} if want == "topk" else {"want": want}


def shaped(want: str, header: dict, arrays: dict):
    if want == "token":
        return header["token"]
    if want == "topk":
        return TopK(arrays["topk_ids"], arrays["topk_logits"])
    return arrays["logits"]


def ids_array(ids, op: str) -> np.ndarray:
    """Token ids as int64 for the wire; non-integers are refused here, as Session.prefill refuses them."""
    arr = np.asarray(ids)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidTokenError(f"{op}: token ids must be integers, got {arr.dtype}")
    return (arr.reshape(1) if arr.ndim == 0 else arr).astype(np.int64, copy=False)


class _Requests:
    """What every session operation sends: (op, header fields, arrays)."""

    @staticmethod
    def prefill(sid, ids, want, k):
        return "prefill", {"session": sid, **want_fields(want, k)}, {"ids": ids_array(ids, "prefill")}

    @staticmethod
    def decode(sid, token, want, k):
        token = int(token) if isinstance(token, (int, np.integer)) else token
        return "decode", {"session": sid, "token": token, **want_fields(want, k)}, {}

    @staticmethod
    def generate(sid, prompt, n, options: dict | None = None, stream: bool = False):
        """prompt: text (the daemon's tokenizer encodes it), chat messages ([{"role", "content"}, ...], rendered
        with the daemon's chat template) or token ids; options: sampling and stop fields."""
        fields = {"session": sid, "n": int(n), **{k: v for k, v in (options or {}).items() if v is not None}}
        if stream:
            fields["stream"] = True
        if isinstance(prompt, str):
            return "generate", {**fields, "prompt": prompt}, {}
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            return "generate", {**fields, "messages": [dict(m) for m in prompt]}, {}
        return "generate", fields, {"ids": ids_array(prompt, "generate")}


def open_fields(max_seq_len: int | None, wait: bool) -> dict:
    return {"max_seq_len": max_seq_len, **({"wait": True} if wait else {})}


def generate_options(temperature=None, top_k=None, top_p=None, min_p=None, repeat_penalty=None,
                     presence_penalty=None, frequency_penalty=None, seed=None, stop=None, ignore_eos=None,
                     speculative=None) -> dict:
    """The generate request's optional fields; None: the daemon's default (Engine.generate's; speculative:
    where the daemon has a draft; False opts out, {"draft_max": N} caps the chains)."""
    if isinstance(stop, str):
        stop = [stop]
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
            "repeat_penalty": repeat_penalty, "presence_penalty": presence_penalty,
            "frequency_penalty": frequency_penalty, "seed": seed, "stop": stop, "ignore_eos": ignore_eos,
            "speculative": speculative}


class Piece(NamedTuple):
    """One streamed token and the text it released ("" while text is held back), as Engine.generate's."""
    token: int
    text: str


class Generated(list):
    """A generation's tokens (a list, as the greedy generate always returned) with .tokens, .text
    (None when the daemon's model has no tokenizer), .stop_reason ("eos", "stop" or "length"), .speculation
    (the generation's acceptance, tokens per pass and draft length; None where it did not speculate)."""

    def __init__(self, header: dict, arrays: dict):
        super().__init__(arrays["tokens"].tolist())
        self.text, self.stop_reason = header.get("text"), header.get("stop_reason")
        self.position = header.get("position")
        self.speculation = header.get("speculation")

    @property
    def tokens(self) -> list[int]:
        return list(self)


class RemoteStream:
    """What generate(stream=True) returns: Pieces as their frames arrive; ``result`` (Generated) at the end."""

    def __init__(self, frames):
        self._frames, self.result = frames, None

    def __iter__(self):
        return self

    def __next__(self) -> Piece:
        if self.result is not None:
            raise StopIteration
        header, arrays = next(self._frames)
        if header.get("done"):
            self.result = Generated(header, arrays)
            self._frames.close()
            raise StopIteration
        return Piece(header["token"], header["text"])

    def close(self) -> None:
        self._frames.close()


# -- blocking ---------------------------------------------------------------------------
class RemoteSession:
    def __init__(self, client: "Client", session_id: int, max_seq_len: int):
        self.client, self.id, self.max_seq_len, self.position, self.closed = client, session_id, max_seq_len, 0, False

    def _send(self, op, fields, arrays):
        header, out = self.client.call(op, fields, arrays)
        self.position = header.get("position", self.position)
        return header, out

    def prefill(self, ids, want: str = "logits", k: int = 5):
        """Logits [n, vocab] (want="logits"), the last row [vocab] ("last"), its greedy token, or TopK."""
        return shaped(want, *self._send(*_Requests.prefill(self.id, ids, want, k)))

    def decode(self, token: int, want: str = "logits", k: int = 5):
        """Logits [vocab] (want="logits"), only the greedy token (int), or TopK(ids, logits) of k."""
        return shaped(want, *self._send(*_Requests.decode(self.id, token, want, k)))

    def generate(self, prompt, max_new_tokens: int = 16, *, stream: bool = False, **options):
        """Server-side generation from text, chat messages or token ids, each step batched with other clients' (greedy
        unless temperature > 0; options: generate_options' names).  The Generated tokens, or with
        stream=True a RemoteStream of Pieces."""
        request = _Requests.generate(self.id, prompt, max_new_tokens, generate_options(**options), stream)
        if stream:
            return RemoteStream(self._frames(*request))
        return Generated(*self._send(*request))

    def _frames(self, op, fields, arrays):
        for header, out in self.client.call_stream(op, fields, arrays):
            self.position = header.get("position", self.position)
            yield header, out

    def reset(self) -> None:
        self._send("reset", {"session": self.id}, {})

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.client.call("close", {"session": self.id}, {})

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self.client.closed:
            self.close()


class Client:
    """Blocking client; ``address`` is a socket path, "unix:PATH" or "tcp://HOST:PORT" (default socket if None)."""

    def __init__(self, address=None, token: str | None = None, timeout: float | None = DEFAULT_TIMEOUT_S):
        environment = Environment.from_env()          # $KESTREL_SOCKET, $KESTREL_TOKEN: read once, here
        kind, where = parse_address(address, environment)
        self.timeout, self.closed, self._ids = timeout, False, itertools.count(1)
        self.sock = socket.socket(socket.AF_UNIX if kind == "unix" else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(where)
        except OSError as e:
            self.sock.close()
            raise ConnectionError(f"cannot reach the daemon at {kind}:{where} ({e}); "
                                  f"is `kestrel-stream serve` running?") from None
        if kind == "tcp":
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A blocking socket with kernel send/receive timeouts: Python's own socket timeout polls before every
        # send and receive, two system calls where one does.  A timed-out call raises BlockingIOError.
        self.sock.settimeout(None)
        if timeout is not None:
            limit = struct.pack("ll", int(timeout), int(timeout % 1 * 1e6) or (0 if timeout >= 1 else 1))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
        self._buffer = bytearray(RECEIVE_BYTES)         # frames are received into this, then copied out once
        self._filled = 0
        self.info, _ = self.call("hello", {"v": VERSION, "token": resolve_token(kind, token, environment)}, {})

    def _fill(self, count: int) -> None:
        if count > len(self._buffer):
            self._buffer = self._buffer[:self._filled] + bytearray(count - self._filled)
        with memoryview(self._buffer) as view:
            while self._filled < count:
                received = self.sock.recv_into(view[self._filled:])
                if not received:
                    raise ConnectionError("the daemon closed the connection")
                self._filled += received

    def _read_frame(self) -> Frame:
        if self._filled < PREFIX_BYTES:
            self._fill(PREFIX_BYTES)
        buffer = self._buffer
        header_bytes, payload_bytes = parse_prefix(bytes(buffer[:PREFIX_BYTES]), MAX_RESPONSE_BYTES)
        end = PREFIX_BYTES + header_bytes + payload_bytes
        if self._filled < end:
            self._fill(end)
            buffer = self._buffer
        head = bytes(buffer[PREFIX_BYTES:PREFIX_BYTES + header_bytes])
        payload = bytes(buffer[PREFIX_BYTES + header_bytes:end]) if payload_bytes else b""   # arrays own it
        if self._filled == end and len(buffer) == RECEIVE_BYTES:      # the usual case: nothing read ahead
            self._filled = 0
        else:
            rest = buffer[end:self._filled]
            if len(buffer) > RECEIVE_BYTES:             # do not keep a large prefill's buffer around
                self._buffer = bytearray(max(RECEIVE_BYTES, len(rest)))
            self._buffer[:len(rest)] = rest
            self._filled = len(rest)
        return parse_body(head, payload)

    def call(self, op: str, fields: dict, arrays: dict):
        if self.closed:
            raise ConnectionError("this client is closed")
        request_id = next(self._ids)
        try:
            self.sock.sendall(encode_frame({"op": op, "id": request_id, **fields}, arrays))
            frame = self._read_frame()
        except (BrokenPipeError, ConnectionResetError):
            notice = self._parting_notice()      # the daemon said why it closed (shutdown, a limit) before it did
            self.close()
            if notice is None:
                raise
            check_response(notice, request_id)
            raise
        except (OSError, ValueError) as e:       # a timeout or half-read frame leaves the stream unusable
            self._lost(op, e)
        try:
            return check_response(frame, request_id)
        except ShuttingDownError:
            self.close()
            raise

    def call_stream(self, op: str, fields: dict, arrays: dict):
        """The frames of a request answered in several (generate with stream), up to the one with "done".
        Left early, the rest is read and dropped, so the connection stays in step."""
        if self.closed:
            raise ConnectionError("this client is closed")
        request_id = next(self._ids)
        over = False
        try:
            self.sock.sendall(encode_frame({"op": op, "id": request_id, **fields}, arrays))
            while not over:
                frame = self._receive(op)
                over = True                     # an error frame ends the request too
                header, out = check_response(frame, request_id)
                over = bool(header.get("done"))
                yield header, out
        except ShuttingDownError:
            self.close()
            raise
        finally:
            while not over and not self.closed:
                header = self._receive(op).header
                over = not header.get("ok") or bool(header.get("done"))

    def _receive(self, op: str) -> Frame:
        try:
            return self._read_frame()
        except (OSError, ValueError) as e:
            self._lost(op, e)

    def _lost(self, op: str, e: Exception):
        """Close (the stream is out of step) and raise: a timeout as TimeoutError naming `op`, else `e`."""
        self.close()
        if isinstance(e, (TimeoutError, BlockingIOError)):
            raise TimeoutError(f"{op}: no answer from the daemon within {self.timeout} s; "
                               f"connection closed") from None
        raise e

    def _parting_notice(self) -> Frame | None:
        """The frame a daemon sent before closing this connection, if one is still to be read."""
        try:
            self.sock.setblocking(False)
            return self._read_frame()
        except (OSError, ValueError):
            return None

    def new_session(self, max_seq_len: int | None = None, wait: bool = False) -> RemoteSession:
        """wait: when every session of the daemon is held, wait in its admission queue (--max-queue) for one
        instead of a CapacityError at once."""
        header, _ = self.call("open", open_fields(max_seq_len, wait), {})
        return RemoteSession(self, header["session"], header["max_seq_len"])

    def generate(self, prompt, max_new_tokens: int = 16, *, stream: bool = False, **options):
        """RemoteSession.generate in a fresh session, closed at the end (of the stream, with stream=True)."""
        if stream:
            return RemoteStream(self._stream_in_session(prompt, max_new_tokens, options))
        with self.new_session(wait=True) as s:
            return s.generate(prompt, max_new_tokens, **options)

    def _stream_in_session(self, prompt, max_new_tokens, options):
        with self.new_session(wait=True) as s:
            yield from s._frames(*_Requests.generate(s.id, prompt, max_new_tokens, generate_options(**options), True))

    def stats(self) -> dict:
        return self.call("stats", {}, {})[0]["stats"]

    def trace_start(self, path) -> None:
        self.call("trace_start", {"path": str(path)}, {})

    def trace_stop(self) -> str | None:
        return self.call("trace_stop", {}, {})[0].get("path")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def connect(address=None, token: str | None = None, timeout: float | None = DEFAULT_TIMEOUT_S) -> Client:
    """A blocking client of the daemon at ``address``, else $KESTREL_SOCKET, else the default socket."""
    return Client(address, token=token, timeout=timeout)


__all__ = ["Client", "Generated", "Piece", "RemoteSession", "RemoteStream", "TopK", "connect", "parse_address"]
