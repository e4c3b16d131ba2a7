"""The daemon's connections: accepting them within serve/limits.py's bounds (pausing when out of file
descriptors), the hello and its token, each connection's request loop until it ends, and at a stop the
drain and a shutdown notice to every client.  Whatever goes wrong inside one connection ends that
connection, never the daemon.
"""
from __future__ import annotations

import errno
import hmac
import time

import anyio

from kestrel_stream.errors import CapacityError, KestrelError
from kestrel_stream.serve.endpoint import log
from kestrel_stream.serve.limits import Limits
from kestrel_stream.serve.peer import Peer, WriteTimeoutError
from kestrel_stream.serve.socket_peer import SocketPeer
from kestrel_stream.wire.protocol import (VERSION, AuthError, DaemonError, IdleTimeoutError, ProtocolError, encode_frame,
                                          error_header)

DRAIN_TIMEOUT_S = 30.0          # how long a shutdown waits for in-flight requests
GONE = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.IncompleteRead,
        ConnectionError)                # the client went away; its sessions are freed
OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class Daemon:
    def __init__(self, engine, service, token: str | None, limits: Limits | None = None):
        self.engine, self.service, self.token = engine, service, token
        self.limits = limits or Limits()
        self.peers: set[Peer] = set()
        self.unauthenticated = 0            # of the connections (peers), those that have not said hello
        self.spawn = None                   # the task group's start_soon, once serving
        self.reader = None                  # the SocketReader of Unix-socket connections, once serving
        self.accept_errors_logged_at = 0.0

    async def accept_forever(self, listener, tg) -> None:
        """Serve every connection; out of file descriptors (or any accept error), pause and go on."""
        while True:
            try:
                stream = await listener.accept()
            except anyio.ClosedResourceError:
                return                          # the daemon is stopping
            except (OSError, anyio.BrokenResourceError) as e:     # anyio wraps a Unix socket's OSError
                e = e.__cause__ if isinstance(e.__cause__, OSError) else e
                now = time.monotonic()
                if now - self.accept_errors_logged_at > 5.0:
                    self.accept_errors_logged_at = now
                    busy = "out of file descriptors; " if getattr(e, "errno", None) in OUT_OF_DESCRIPTORS else ""
                    log(f"accept failed ({busy}{e}); pausing new connections {self.limits.accept_pause_s} s, "
                        f"serving the {len(self.peers)} open ones")
                await anyio.sleep(self.limits.accept_pause_s)
                continue
            tg.start_soon(self.serve_connection, stream)

    async def serve_connection(self, stream) -> None:
        """One connection, start to end.  Whatever happens in it ends it alone: never the daemon."""
        try:
            full = self.over_connection_limits()
            if full is not None:
                await self.refuse_stream(stream, full)
                return
            await self.serve_admitted(stream)
        except Exception as e:          # a bug, logged; the daemon goes on
            log(f"a connection ended by an internal error: {type(e).__name__}: {e}")
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                await stream.aclose()

    def over_connection_limits(self) -> CapacityError | None:
        limits = self.limits
        if len(self.peers) >= limits.max_connections:
            return CapacityError(f"the daemon holds {len(self.peers)} connections (--max-connections "
                                 f"{limits.max_connections}); try again later")
        if self.unauthenticated >= limits.max_unauthenticated:
            return CapacityError(f"{self.unauthenticated} connections are waiting to say hello "
                                 f"(--max-unauthenticated {limits.max_unauthenticated}); try again later")
        return None

    async def refuse_stream(self, stream, error: KestrelError) -> None:
        self.service.counters["errors"] += 1
        with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
            try:
                await stream.send(encode_frame(error_header(None, error)))
            except (*GONE, OSError):
                pass
            await stream.aclose()

    async def serve_admitted(self, stream) -> None:
        from kestrel_stream.serve.service import Connection
        if isinstance(stream, anyio.abc.UNIXSocketStream):
            peer = SocketPeer(stream, self.limits.max_frame_bytes, self.spawn, self.reader, self.limits)
            conn = Connection(peer=str(id(stream)), send_from_step=peer.send_from_step_thread, send_frame=peer.send)
            peer.take_at_once = lambda frame: self.take_at_once(peer, conn, frame)
        else:
            peer = Peer(stream, self.limits.max_frame_bytes, self.spawn, self.limits)
            conn = Connection(peer=str(id(stream)), send_frame=peer.send)
        self.peers.add(peer)
        self.unauthenticated += 1
        self.service.connections.add(id(peer))
        try:
            await self.converse(peer, conn)
        except WriteTimeoutError as e:
            log(f"a client was disconnected: {e}")
        except GONE:
            pass
        except Exception as e:          # the catch-all of this connection: log, answer, close it
            log(f"a connection ended by an internal error: {type(e).__name__}: {e}")
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                try:
                    await self.refuse(peer, None, DaemonError(f"internal error, connection closed "
                                                              f"({type(e).__name__}: {e})"))
                except Exception:
                    pass
        finally:
            self.peers.discard(peer)
            if not conn.authenticated:
                self.unauthenticated -= 1
            self.service.connections.discard(id(peer))
            peer.close()
            with anyio.CancelScope(shield=True):
                # Queued behind every decode of this connection: once it returns, the step thread writes no
                # more to this socket, which may then close.
                try:
                    if conn.sessions or peer.pending is not None:
                        await self.service.close_sessions(conn, list(conn.sessions))
                    await self.service.client_left(conn)
                finally:
                    conn.send_from_step = None      # the last reference between peer and connection
                    await stream.aclose()
                    self.service.freed_pages.give_back_soon()

    async def next_frame(self, peer: Peer, conn):
        """The next frame, within the hello timeout before hello and the idle timeout after it."""
        limits = self.limits
        if not conn.authenticated:
            try:
                with anyio.fail_after(limits.hello_timeout_s):
                    return await peer.read_frame()
            except TimeoutError:
                raise AuthError(f"no hello within {limits.hello_timeout_s} s (--hello-timeout-s); "
                                f"connection closed") from None
        if not limits.idle_timeout_s:
            return await peer.read_frame()
        while True:         # bytes the reader thread answers itself (decodes at once) keep the connection alive
            with anyio.move_on_after(max(peer.last_active + limits.idle_timeout_s - time.monotonic(), 0.0)):
                return await peer.read_frame()
            if (time.monotonic() - peer.last_active >= limits.idle_timeout_s
                    and (peer.pending is None or peer.pending.done)):
                raise IdleTimeoutError(f"no request for {limits.idle_timeout_s} s (--idle-timeout-s); "
                                       f"connection closed, its sessions freed")

    async def converse(self, peer: Peer, conn) -> None:
        while True:
            try:
                frame = await self.next_frame(peer, conn)
            except (AuthError, IdleTimeoutError) as e:
                await peer.settled()
                await self.refuse(peer, None, e)
                return
            except ProtocolError as e:
                await peer.settled()
                await self.refuse(peer, None, e)
                if e.fatal or not conn.authenticated:
                    return
                continue
            await peer.settled()
            request_id = frame.header.get("id")
            if request_id is not None and type(request_id) is not int:
                await self.refuse(peer, None, ProtocolError(f"frame header: 'id' must be an integer, "
                                                            f"got {request_id!r}"))
                continue
            if not conn.authenticated:
                try:
                    self.check_hello(frame.header)
                except KestrelError as e:
                    await self.refuse(peer, request_id, e)
                    return              # a peer that cannot say hello gets nothing else
                conn.authenticated = True
                self.unauthenticated -= 1
                peer.authenticate()
                await peer.send({"id": request_id, "ok": True, "v": VERSION, "vocab_size": self.engine.config.vocab_size,
                                 "max_seq_len": self.engine.max_seq_len, "device": self.engine.device,
                                 "mode": self.engine.mode, "replicas": len(self.service.replicas)})
                continue
            try:
                with anyio.CancelScope() as request:
                    peer.on_gone = request.cancel          # a client that closed its socket needs no answer
                    answer = await self.service.handle(conn, frame)
            except KestrelError as e:
                await self.refuse(peer, request_id, e)
                continue
            except Exception as e:      # a bug must not take the other sessions down with it
                await self.refuse(peer, request_id, DaemonError(f"{type(e).__name__}: {e}"))
                continue
            finally:
                peer.on_gone = None
            if request.cancelled_caught:
                return                  # serve_admitted's cleanup frees the sessions and drops their queued work
            if type(answer) is not tuple:       # a decode the step thread answers
                peer.pending = answer
                continue
            fields, arrays = answer
            await peer.send({"id": request_id, "ok": True, **fields}, arrays)

    def take_at_once(self, peer: SocketPeer, conn, frame) -> bool:
        """Reader thread: queue a decode request of an idle connection, or answer its stats request, without
        waking its coroutine.

        Anything else (or an unauthenticated connection, or stats while an
        engine call runs) is left to the coroutine, which checks it again and
        answers it."""
        request_id = frame.header.get("id")
        if not conn.authenticated or (request_id is not None and type(request_id) is not int):
            return False
        if frame.header.get("op") == "stats":
            stats = self.service.stats_at_once()
            if stats is None:
                return False
            peer.send_from_step_thread({"id": request_id, "ok": True, "stats": stats}, None, lambda: None)
            return True
        job = self.service.queue_decode(conn, frame.header)
        if job is None:
            return False
        peer.pending = job
        return True

    async def refuse(self, peer: Peer, request_id, error: BaseException) -> None:
        self.service.counters["errors"] += 1
        await peer.send(error_header(request_id, error))

    def check_hello(self, header: dict) -> None:
        if header.get("op") != "hello":
            raise AuthError(f"the first frame must be op 'hello', got {header.get('op')!r}")
        if type(header.get("v")) is not int or header.get("v") != VERSION:       # not 1.0, not true
            raise ProtocolError(f"hello: client speaks protocol version {header.get('v')!r}, daemon {VERSION}")
        if self.token is not None:
            offered = header.get("token")
            if not isinstance(offered, str) or not hmac.compare_digest(offered.encode(), self.token.encode()):
                raise AuthError("hello: missing or wrong token (TCP connections need the daemon's token)")

    async def shutdown(self, scope: anyio.CancelScope, why: str) -> None:
        log(f"{why}: finishing in-flight steps")
        self.service.start_draining()
        with anyio.move_on_after(DRAIN_TIMEOUT_S):
            while self.service.inflight:        # some finish on the step thread, which does not wake the loop
                await anyio.sleep(0.005)
        for peer in list(self.peers):
            with anyio.move_on_after(1.0):
                try:
                    await peer.send({"id": None, "op": "shutdown", "ok": False, "code": "shutting_down",
                                     "message": f"daemon shutting down ({why})"})
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    pass
        scope.cancel()
