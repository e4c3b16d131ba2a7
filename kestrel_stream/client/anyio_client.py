"""``ks.AsyncClient``: the blocking client's API for anyio code (asyncio or trio).

    async with await ks.AsyncClient.connect() as client:
        async with await client.new_session() as s:
            token = await s.decode(42, want="token")
"""
from __future__ import annotations

import itertools
from contextlib import aclosing
import socket

import anyio
from anyio.streams.buffered import BufferedByteReceiveStream

from kestrel_stream.options import Environment
from kestrel_stream.client.endpoint import DEFAULT_TIMEOUT_S, parse_address, resolve_token
from kestrel_stream.client.requests import Generated, Piece, Requests, check_response, generate_options, open_fields, shaped
from kestrel_stream.wire.protocol import (MAX_RESPONSE_BYTES, PREFIX_BYTES, VERSION, Frame, ShuttingDownError, encode_frame, parse_body,
                       parse_prefix)


# the connection broke or timed out (TimeoutError is an OSError): the stream is out of step, the client closed
LOST = (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError)


class AsyncRemoteSession:
    def __init__(self, client: "AsyncClient", session_id: int, max_seq_len: int):
        self.client, self.id, self.max_seq_len, self.position, self.closed = client, session_id, max_seq_len, 0, False

    async def _send(self, op, fields, arrays):
        header, out = await self.client.call(op, fields, arrays)
        self.position = header.get("position", self.position)
        return header, out

    async def prefill(self, ids, want: str = "logits", k: int = 5):
        return shaped(want, *await self._send(*Requests.prefill(self.id, ids, want, k)))

    async def decode(self, token: int, want: str = "logits", k: int = 5):
        return shaped(want, *await self._send(*Requests.decode(self.id, token, want, k)))

    def generate(self, prompt, max_new_tokens: int = 16, *, stream: bool = False, **options) -> "AsyncGeneration":
        """RemoteSession.generate: ``await`` it for the Generated tokens, or ``async for`` over its Pieces."""
        request = Requests.generate(self.id, prompt, max_new_tokens, generate_options(**options), stream)
        return AsyncGeneration(lambda: self._frames(*request), stream)

    async def _frames(self, op, fields, arrays):
        async with aclosing(self.client.call_stream(op, fields, arrays)) as frames:
            async for header, out in frames:
                self.position = header.get("position", self.position)
                yield header, out

    async def reset(self) -> None:
        await self._send("reset", {"session": self.id}, {})

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self.client.call("close", {"session": self.id}, {})

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        if not self.client.closed:
            await self.close()


class AsyncGeneration:
    """A generate request, sent when used: awaited, the Generated tokens; iterated (``async for``, with
    stream=True), each Piece as its frame arrives, then ``result``.  To leave the loop early, iterate inside
    ``contextlib.aclosing(generation.__aiter__())``: closing it closes the connection (the rest of the stream
    would be in its way); an iteration left without closing holds the connection until it is collected."""

    def __init__(self, frames, stream: bool):
        self._frames, self.stream, self.result = frames, stream, None

    def __await__(self):
        return self._run().__await__()

    async def _run(self) -> Generated:
        async for _ in self:
            pass
        return self.result

    async def __aiter__(self):
        async with aclosing(self._frames()) as frames:      # closed with this one, in this task
            async for header, arrays in frames:
                if header.get("done") or not self.stream:      # the last frame: the frames' generators end here
                    self.result = Generated(header, arrays)
                else:
                    yield Piece(header["token"], header["text"])


class AsyncClient:
    """Create with ``await AsyncClient.connect(address, token=..., timeout=...)`` or ``async with AsyncClient(...)``."""

    def __init__(self, address=None, token: str | None = None, timeout: float | None = DEFAULT_TIMEOUT_S):
        self.address, self.token, self.timeout = address, token, timeout
        self.stream = None
        self.closed = False
        self._ids = itertools.count(1)
        self._lock = anyio.Lock(fast_acquire=True)     # one request at a time: responses come back in order

    @classmethod
    async def connect(cls, address=None, token: str | None = None,
                      timeout: float | None = DEFAULT_TIMEOUT_S) -> "AsyncClient":
        client = cls(address, token, timeout)
        await client.open()
        return client

    async def open(self) -> None:
        environment = Environment.from_env()          # $KESTREL_SOCKET, $KESTREL_TOKEN: read once, here
        kind, where = parse_address(self.address, environment)
        try:
            with anyio.fail_after(self.timeout):
                if kind == "unix":
                    self.stream = await anyio.connect_unix(where)
                else:
                    self.stream = await anyio.connect_tcp(*where)
                    self.stream.extra(anyio.abc.SocketAttribute.raw_socket).setsockopt(
                        socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            raise ConnectionError(f"cannot reach the daemon at {kind}:{where} ({e}); "
                                  f"is `kestrel-stream serve` running?") from None
        self.reader = BufferedByteReceiveStream(self.stream)
        # On a Unix socket, frames go straight through the non-blocking socket (as the daemon does): anyio's
        # stream adds a scheduling checkpoint and a reader registration to every call.
        self.sock = self.stream.extra(anyio.abc.SocketAttribute.raw_socket) if kind == "unix" else None
        self.buffer = bytearray()
        self.info, _ = await self.call("hello", {"v": VERSION, "token": resolve_token(kind, self.token, environment)}, {})

    async def _receive_exactly(self, count: int) -> bytes:
        if self.sock is None:
            return await self.reader.receive_exactly(count)
        while len(self.buffer) < count:
            try:
                chunk = self.sock.recv(max(65536, count - len(self.buffer)))
            except BlockingIOError:
                await anyio.wait_readable(self.sock)
                continue
            if not chunk:
                raise anyio.EndOfStream
            self.buffer += chunk
        data = bytes(self.buffer[:count])
        del self.buffer[:count]
        return data

    async def _send(self, data: bytes) -> None:
        if self.sock is None:
            await self.stream.send(data)
            return
        view = memoryview(data)
        while view:
            try:
                view = view[self.sock.send(view):]
            except BlockingIOError:
                await anyio.wait_writable(self.sock)

    async def call(self, op: str, fields: dict, arrays: dict):
        if self.closed or self.stream is None:
            raise ConnectionError("this client is closed")
        async with self._lock:
            request_id = next(self._ids)
            notice = None
            try:
                with anyio.fail_after(self.timeout):
                    try:
                        await self._send(encode_frame({"op": op, "id": request_id, **fields}, arrays))
                    except (anyio.BrokenResourceError, OSError):
                        notice = await self._parting_notice(request_id)     # why the daemon closed, if it said
                        if notice is None:
                            raise
                    else:
                        frame = await self._read_frame()
            except LOST as e:
                await self.aclose()
                raise self._lost(op, e) from None
        if notice is not None:
            await self.aclose()
            raise notice
        try:
            return check_response(frame, request_id)
        except ShuttingDownError:
            await self.aclose()
            raise

    async def call_stream(self, op: str, fields: dict, arrays: dict):
        """The frames of a request answered in several (generate with stream), up to the last; the client
        is closed if the caller leaves before it."""
        if self.closed or self.stream is None:
            raise ConnectionError("this client is closed")
        async with self._lock:
            request_id = next(self._ids)
            over = False
            try:
                with anyio.fail_after(self.timeout):
                    await self._send(encode_frame({"op": op, "id": request_id, **fields}, arrays))
                while not over:
                    with anyio.fail_after(self.timeout):
                        frame = await self._read_frame()
                    over = True
                    header, out = check_response(frame, request_id)
                    over = bool(header.get("done")) or not fields.get("stream")
                    yield header, out
            except LOST as e:
                raise self._lost(op, e) from None
            finally:
                if not over:
                    await self.aclose()

    def _lost(self, op: str, e: BaseException) -> Exception:
        """What a request whose connection broke (or timed out) raises; the connection is closed."""
        if isinstance(e, TimeoutError):
            return TimeoutError(f"{op}: no answer from the daemon within {self.timeout} s; connection closed")
        return ConnectionError(f"{op}: the daemon closed the connection ({type(e).__name__})")

    async def _read_frame(self) -> Frame:
        header_bytes, payload_bytes = parse_prefix(await self._receive_exactly(PREFIX_BYTES), MAX_RESPONSE_BYTES)
        head = await self._receive_exactly(header_bytes)
        payload = await self._receive_exactly(payload_bytes) if payload_bytes else b""
        return parse_body(head, payload)

    async def _parting_notice(self, request_id: int) -> Exception | None:
        """The error a daemon sent before it closed this connection (shutdown, a limit), as its typed exception."""
        with anyio.move_on_after(0.5):
            try:
                frame = await self._read_frame()
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError, ValueError):
                return None
            try:
                check_response(frame, request_id)
            except Exception as e:          # the daemon's error, typed by its code
                return e
        return None

    async def new_session(self, max_seq_len: int | None = None, wait: bool = False) -> AsyncRemoteSession:
        """wait: Client.new_session's."""
        header, _ = await self.call("open", open_fields(max_seq_len, wait), {})
        return AsyncRemoteSession(self, header["session"], header["max_seq_len"])

    def generate(self, prompt, max_new_tokens: int = 16, *, stream: bool = False, **options) -> AsyncGeneration:
        """AsyncRemoteSession.generate in a fresh session, closed at the end."""
        async def frames():
            async with await self.new_session(wait=True) as s:
                request = Requests.generate(s.id, prompt, max_new_tokens, generate_options(**options), stream)
                async with aclosing(s._frames(*request)) as session_frames:
                    async for frame in session_frames:
                        yield frame
        return AsyncGeneration(frames, stream)

    async def stats(self) -> dict:
        return (await self.call("stats", {}, {}))[0]["stats"]

    async def trace_start(self, path) -> None:
        await self.call("trace_start", {"path": str(path)}, {})

    async def trace_stop(self) -> str | None:
        return (await self.call("trace_stop", {}, {}))[0].get("path")

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            if self.stream is not None:
                with anyio.CancelScope(shield=True):
                    await self.stream.aclose()

    async def __aenter__(self):
        if self.stream is None:
            await self.open()
        return self

    async def __aexit__(self, *exc):
        await self.aclose()
