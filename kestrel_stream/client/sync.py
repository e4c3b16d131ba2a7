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

from kestrel_stream.client.endpoint import DEFAULT_TIMEOUT_S, parse_address, resolve_token
from kestrel_stream.client.requests import (Generated, Piece, Requests, TopK, check_response, generate_options,
                                            open_fields, shaped)
from kestrel_stream.options import Environment
from kestrel_stream.wire.protocol import (MAX_RESPONSE_BYTES, PREFIX_BYTES, VERSION, Frame, ShuttingDownError, encode_frame,
                       parse_body, parse_prefix)

RECEIVE_BYTES = 65536


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
        return shaped(want, *self._send(*Requests.prefill(self.id, ids, want, k)))

    def decode(self, token: int, want: str = "logits", k: int = 5):
        """Logits [vocab] (want="logits"), only the greedy token (int), or TopK(ids, logits) of k."""
        return shaped(want, *self._send(*Requests.decode(self.id, token, want, k)))

    def generate(self, prompt, max_new_tokens: int = 16, *, stream: bool = False, **options):
        """Server-side generation from text, chat messages or token ids, each step batched with other clients' (greedy
        unless temperature > 0; options: generate_options' names).  The Generated tokens, or with
        stream=True a RemoteStream of Pieces."""
        request = Requests.generate(self.id, prompt, max_new_tokens, generate_options(**options), stream)
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
            yield from s._frames(*Requests.generate(s.id, prompt, max_new_tokens, generate_options(**options), True))

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
