"""A Unix-socket client connection (``SocketPeer``): read by the daemon's reader thread, which splits the bytes
into frames and either queues them for the connection's coroutine or, for a decode request arriving at an
idle connection, hands the frame to ``take_at_once`` right there, so the request reaches the step thread
without the event loop; the step thread writes decode answers to the socket itself.
"""
from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from collections import deque
from typing import Callable

import anyio

from kestrel_stream.serve.limits import Limits
from kestrel_stream.serve.peer import (FRAME_TIMEOUT_S, GONE, QUEUED_FRAMES, Peer, WriteTimeoutError, encode_answer,
                                      parsed_body)
from kestrel_stream.serve.socket_reader import SocketReader
from kestrel_stream.wire.protocol import PREFIX_BYTES, Frame, ProtocolError, parse_prefix

class SocketPeer(Peer):
    """A Unix-socket connection, read by the daemon's reader thread and written on its raw non-blocking socket.

    The reader thread (socket_reader.py) splits the bytes into frames.  A
    decode request arriving while the connection's coroutine waits, with
    nothing queued and no decode of this connection unanswered, goes straight
    to ``take_at_once`` (which queues it for the step thread, and the step
    thread answers it): the event loop never sees it.  Any other frame is
    queued for the coroutine, which is woken on the loop.  ``lock`` guards
    what both threads touch: the queued frames, the end, ``waiting``, ``pending``."""

    def __init__(self, stream, max_frame_bytes: int, spawn=None, reader: SocketReader | None = None,
                 limits: Limits | None = None):
        super().__init__(stream, max_frame_bytes, spawn, limits)
        self.sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)    # non-blocking
        self.fd = self.sock.fileno()
        self.lock = threading.Lock()
        self.frames: deque = deque()        # Frames and ProtocolErrors the coroutine has not taken yet
        self.queued_bytes = 0               # payload bytes of those frames (with the buffer: --max-buffered-mb)
        self.ended: BaseException | None = None     # raised to the coroutine once the frames are taken
        self.partial_since: float | None = None     # when the frame now arriving began (monotonic s)
        self.waiter: asyncio.Future | None = None   # the coroutine's, while it waits for a frame (loop only)
        self.waiting = False                # the coroutine waits for a frame with none queued
        self.reading = False
        # Reader thread, for a frame that arrives while the coroutine waits with nothing queued or pending:
        # True if it took the frame.
        self.take_at_once: Callable[[Frame], bool] | None = None
        self.own_reader = reader is None    # a peer made on its own (tests) reads with a thread of its own
        self.reader = reader or SocketReader()
        self.resume_reading()

    def resume_reading(self) -> None:
        with self.lock:
            if not self.reading and self.ended is None:
                self.reader.watch(self.fd, self)
                self.reading = True

    def pause_reading(self) -> None:
        """Holding lock."""
        if self.reading:
            self.reader.unwatch(self.fd)
            self.reading = False

    def authenticate(self) -> None:
        """Loop: from now on the reader splits frames ahead (before hello it stopped after the first) with the
        larger limits, beginning with bytes that arrived behind the hello."""
        with self.lock:
            super().authenticate()
            if self.buffer and self.ended is None and self.split_frames():
                self.wake_soon()
        self.resume_reading()

    def close(self) -> None:
        """Loop: stop reading; once this returns the reader thread touches this socket no more.

        What the connection held is let go here: a half-read frame of up to
        --max-frame-mb must not wait for a garbage collection, and the peer
        and its callbacks (take_at_once, the Connection's send_from_step)
        refer to each other."""
        with self.lock:
            self.pause_reading()
            self.ended = self.ended or anyio.ClosedResourceError()
            self.frames.clear()
            self.queued_bytes = 0
            self.buffer = bytearray()
            self.take_at_once = None
        if self.own_reader:
            self.reader.stop()

    def hang_up(self) -> None:
        """Any thread: end a client that does not read (its reader sees the end and the connection closes)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- the reader thread -------------------------------------------------------------
    def on_readable(self) -> None:
        with self.lock:
            if self.ended is not None:
                return
            try:
                scratch = self.reader.scratch
                received = self.sock.recv_into(scratch)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.end(anyio.BrokenResourceError(str(e)), gone=True)
                return
            if not received:
                self.end(anyio.EndOfStream(), gone=self.hung_up())
                return
            self.buffer += scratch[:received]
            self.last_active = time.monotonic()
            if self.split_frames():
                self.wake_soon()

    def split_frames(self) -> bool:
        """Holding lock: take or queue every whole frame in the buffer; True if the coroutine must wake."""
        buffer, wake = self.buffer, False
        while len(buffer) >= PREFIX_BYTES:
            if not self.authenticated and self.frames:
                break                       # before hello one frame at a time, under the hello's limits
            try:
                header_bytes, payload_bytes = parse_prefix(bytes(buffer[:PREFIX_BYTES]), self.max_frame_bytes,
                                                           self.max_header_bytes)
            except ProtocolError as e:      # the stream is out of step: nothing after this can be read
                self.frames.append(e)
                self.end(anyio.EndOfStream())
                return False                # end() wakes it
            end = PREFIX_BYTES + header_bytes + payload_bytes
            if len(buffer) < end:
                if self.partial_since is None:
                    self.partial_since = time.monotonic()
                    wake = True             # so that the coroutine times the rest of this frame
                break
            self.partial_since = None
            head = bytes(buffer[PREFIX_BYTES:PREFIX_BYTES + header_bytes])
            payload = bytes(buffer[PREFIX_BYTES + header_bytes:end]) if payload_bytes else b""   # arrays own it
            if end == len(buffer):
                buffer.clear()
            else:
                del buffer[:end]
            try:
                frame = parsed_body(head, payload)
            except ProtocolError as e:      # well framed: answered, and the connection goes on
                self.frames.append(e)
                continue
            if (self.waiting and not self.frames and self.take_at_once is not None
                    and (self.pending is None or self.pending.done) and self.took_at_once(frame)):
                continue
            self.frames.append(frame)
            self.queued_bytes += len(payload)
        if self.frames and (len(self.frames) >= (QUEUED_FRAMES if self.authenticated else 1)
                            or self.queued_bytes + len(buffer) >= self.limits.max_buffered_bytes):
            self.pause_reading()            # the coroutine reads on when it has taken them
        return wake or bool(self.frames)

    def took_at_once(self, frame: Frame) -> bool:
        try:
            return self.take_at_once(frame)
        except Exception:                   # a bug there: the coroutine handles the frame and reports it
            return False

    def fail(self, error: Exception) -> None:
        """Reader thread, after on_readable raised: end the connection (its coroutine sees it broken)."""
        with self.lock:
            self.end(anyio.BrokenResourceError(f"reading the connection failed: {type(error).__name__}: {error}"))

    def hung_up(self) -> bool:
        """Reader thread, at the end of the bytes: whether the client closed its socket (POLLHUP), rather than
        shut down only its writing side to wait for its answers."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        return any(events & select.POLLHUP for _, events in poller.poll(0))

    def end(self, why: BaseException, gone: bool = False) -> None:
        """Holding lock."""
        self.ended = why
        self.pause_reading()
        self.wake_soon()
        if gone:
            try:
                self.loop.call_soon_threadsafe(self.client_gone)
            except RuntimeError:            # the loop is closed: the daemon has stopped
                pass

    def client_gone(self) -> None:
        if self.on_gone is not None:
            self.on_gone()

    def wake_soon(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.wake)
        except RuntimeError:                # the loop is closed: the daemon has stopped
            pass

    # -- the connection's coroutine (loop) ------------------------------------------------
    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def read_frame(self) -> Frame:
        while True:
            with self.lock:
                if self.frames:
                    item = self.frames.popleft()
                    if isinstance(item, Frame):
                        self.queued_bytes -= sum(a.nbytes for a in item.arrays.values())
                    self.waiting = False
                    break
                if self.ended is not None:
                    self.waiting = False
                    raise self.ended
                partial_since = self.partial_since
                self.waiter = self.loop.create_future()
                self.waiting = True
            self.resume_reading()
            try:
                if partial_since is None:      # idle clients may wait here forever
                    await self.waiter
                else:
                    with anyio.fail_after(max(partial_since + FRAME_TIMEOUT_S - time.monotonic(), 0.0)):
                        await self.waiter
            finally:
                self.waiter = None
        if self.authenticated:              # before hello, authenticate() resumes reading
            self.resume_reading()
        if isinstance(item, ProtocolError):
            raise item
        return item

    async def write(self, view: memoryview) -> None:
        deadline, size = time.monotonic() + self.limits.write_timeout_s, len(view)
        while view:
            try:
                view = view[self.sock.send(view):]
                deadline = time.monotonic() + self.limits.write_timeout_s      # it reads: the clock starts again
            except BlockingIOError:
                with anyio.move_on_after(max(deadline - time.monotonic(), 0.0)):
                    await anyio.wait_writable(self.sock)
                if time.monotonic() >= deadline:
                    self.hang_up()
                    raise WriteTimeoutError(f"the client read none of the rest of a {size}-byte answer within "
                                            f"{self.limits.write_timeout_s} s (--write-timeout-s)") from None
            except OSError as e:
                raise anyio.BrokenResourceError(str(e)) from e

    def send_from_step_thread(self, header: dict, arrays: dict | None, finished: Callable[[], None]) -> None:
        """Step or reader thread: write an answer at once, so the loop does not wake up on the client's path.

        What the socket does not take (it is full, or another write holds it)
        goes out from a task on the loop; a partial write keeps write_lock held
        until that task has sent the rest, so nothing can come between.
        ``finished`` runs once the whole frame is written or the client is gone."""
        data = encode_answer(header, arrays)
        if not self.write_lock.acquire(blocking=False):
            self.loop.call_soon_threadsafe(self.start_write, self.send_later, data, finished)
            return
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:                     # the client is gone; the end of its connection frees its sessions
            sent = len(data)
        if sent == len(data):
            self.write_lock.release()
            finished()
        else:
            self.loop.call_soon_threadsafe(self.start_write, self.send_rest, memoryview(data)[sent:], finished)

    def start_write(self, write, data, finished) -> None:
        """Loop: a task that writes what the step thread could not."""
        try:
            (self.spawn or self.start_task)(write, data, finished)
        except RuntimeError:                # the daemon is stopping and its task group takes no new tasks
            if write == self.send_rest:
                self.write_lock.release()
            finished()

    async def send_rest(self, view: memoryview, finished) -> None:
        """Loop: the tail of a frame the step thread began; it left write_lock held for this."""
        try:
            await self.write(view)
        except GONE:
            pass                            # the reader sees the client leave and ends the connection
        finally:
            self.write_lock.release()
            finished()

    async def send_later(self, data: bytes, finished) -> None:
        try:
            await self.send_bytes(data)
        except GONE:
            pass
        finally:
            finished()
