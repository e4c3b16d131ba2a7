"""One client connection's bytes: frames in, answers out, in order.

TCP streams (``Peer``) are asyncio transports that own their socket, so they keep anyio's stream calls
and every answer goes out from the loop; a Unix socket is a SocketPeer (socket_peer.py), read by the
daemon's reader thread.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable

import anyio

from kestrel_stream.errors import KestrelError
from kestrel_stream.serve.limits import Limits
from kestrel_stream.wire.protocol import (MAX_HEADER_BYTES, PREFIX_BYTES, Frame, ProtocolError, encode_frame, error_header,
                                          parse_body, parse_prefix)

FRAME_TIMEOUT_S = 30.0          # a started frame must arrive whole this fast (no half-sent frames held open)
QUEUED_FRAMES = 4               # frames read ahead of the connection's coroutine before reading pauses
GONE = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError, ValueError)   # writes to a departed client


class WriteTimeoutError(anyio.BrokenResourceError):
    """The client did not read its answer within --write-timeout-s; its connection ends."""


def parsed_body(head: bytes, payload: bytes) -> Frame:
    """parse_body, where anything it raises is a ProtocolError answered to the client (never a reader crash)."""
    try:
        return parse_body(head, payload)
    except ProtocolError:
        raise
    except Exception as e:
        raise ProtocolError(f"frame: cannot be parsed ({type(e).__name__}: {e})") from None


def encode_answer(header: dict, arrays: dict | None) -> bytes:
    try:
        return encode_frame(header, arrays)
    except KestrelError as e:               # e.g. prefill logits too large for one frame
        return encode_frame(error_header(header.get("id"), e))


class Peer:
    """A TCP connection (anyio stream), and the write side every connection shares."""

    def __init__(self, stream, max_frame_bytes: int, spawn=None, limits: Limits | None = None):
        self.stream = stream
        # Without limits (a peer made on its own, in tests) the connection counts as authenticated.
        self.limits = limits or Limits(max_frame_bytes=max_frame_bytes)
        self.authenticated = limits is None
        self.max_frame_bytes = self.limits.frame_bytes(self.authenticated)
        self.max_header_bytes = self.limits.header_bytes(self.authenticated, MAX_HEADER_BYTES)
        self.last_active = time.monotonic()         # when bytes last arrived (the idle timeout counts from it)
        self.buffer = bytearray()
        # A threading lock, not an anyio one: the step thread writes decode answers itself (SocketPeer).
        self.write_lock = threading.Lock()
        self.loop = asyncio.get_running_loop()
        self.spawn = spawn      # the daemon's task group's start_soon; None: start_task (not a bound method
                                # kept here, which would be a reference cycle through the peer)
        self.tasks: set[asyncio.Task] = set()
        self.pending = None                 # the DecodeJob the step thread answers; the next request waits for it
        # Loop: called once the client has closed its socket (not merely shut its writing side; Unix sockets only):
        # the request in flight is cancelled, so its work (a long prompt's chunks) stops and its sessions are freed
        self.on_gone: Callable[[], None] | None = None

    # -- reading ---------------------------------------------------------------------
    def authenticate(self) -> None:
        """The hello was accepted: the larger limits of an authenticated connection apply from the next frame."""
        self.authenticated = True
        self.max_frame_bytes = self.limits.frame_bytes(True)
        self.max_header_bytes = self.limits.header_bytes(True, MAX_HEADER_BYTES)

    async def fill(self, count: int) -> None:
        while len(self.buffer) < count:
            self.buffer += await self.stream.receive()
            self.last_active = time.monotonic()

    async def read_frame(self) -> Frame:
        await self.fill(PREFIX_BYTES)           # the daemon times idle clients (hello and idle timeouts)
        header_bytes, payload_bytes = parse_prefix(bytes(self.buffer[:PREFIX_BYTES]), self.max_frame_bytes,
                                                   self.max_header_bytes)
        end = PREFIX_BYTES + header_bytes + payload_bytes
        if len(self.buffer) < end:
            with anyio.fail_after(FRAME_TIMEOUT_S):
                await self.fill(end)
        frame = bytes(self.buffer[:end])
        del self.buffer[:end]
        return parsed_body(frame[PREFIX_BYTES:PREFIX_BYTES + header_bytes], frame[PREFIX_BYTES + header_bytes:])

    async def settled(self) -> None:
        """Wait until the decode the step thread is answering has gone out whole (requests stay in order)."""
        if self.pending is not None:
            await self.pending.wait()
            self.pending = None

    def close(self) -> None:
        self.buffer = bytearray()

    def start_task(self, fn, *args) -> None:
        task = self.loop.create_task(fn(*args))
        self.tasks.add(task)                    # the loop keeps only a weak reference
        task.add_done_callback(self.tasks.discard)

    # -- writing ---------------------------------------------------------------------
    async def send(self, header: dict, arrays: dict | None = None) -> None:
        await self.send_bytes(encode_answer(header, arrays))

    async def send_bytes(self, data: bytes) -> None:
        while not self.write_lock.acquire(blocking=False):
            await anyio.sleep(0.001)            # rare: a shutdown notice meeting an answer in flight
        try:
            await self.write(memoryview(data))
        finally:
            self.write_lock.release()

    async def write(self, view: memoryview) -> None:
        try:
            with anyio.fail_after(self.limits.write_timeout_s):
                await self.stream.send(view)
        except TimeoutError:
            raise WriteTimeoutError(f"the client read none of a {len(view)}-byte answer within "
                                    f"{self.limits.write_timeout_s} s (--write-timeout-s)") from None
