"""``kestrel-stream serve``: the daemon that owns the model and answers clients over a socket.

Transport: a Unix socket (mode 0600, in a per-user runtime dir by default) or
TCP on loopback, where the first frame must carry the token.  Each connection
is answered in order, one request at a time (peer.py reads and writes its
bytes; one reader thread reads every Unix socket, socket_reader.py); decode
steps of different connections meet in the batcher on the step thread
(service.py, step_thread.py).  SIGINT/SIGTERM stop new work, let
in-flight steps finish, tell every client, and exit 0.  What one client may
hold (connections, bytes, time, sessions) is bounded by serve/limits.py, and
whatever goes wrong inside one connection ends that connection, never the
daemon; endpoint.py guards the socket path and the token.

One concern, the daemon's lifetime: listening, accepting, the per-connection request loop and an orderly
stop live together because each decides what the others may still do.
"""
from __future__ import annotations

import contextlib
import errno
import hmac
import signal
import sys
import time
from functools import partial
from pathlib import Path

import anyio

from kestrel_stream.errors import CapacityError, KestrelError
from kestrel_stream.serve.endpoint import log, load_token, prepare_socket_path, private_umask
from kestrel_stream.serve.flags import check_serve_args
from kestrel_stream.serve.limits import Limits, limits_from_args
from kestrel_stream.serve.memory import freeze_loaded_objects, map_large_buffers
from kestrel_stream.serve.sampling_defaults import (model_sampling_defaults, sampling_defaults_from_args,
                                                    with_model_defaults)
from kestrel_stream.serve.peer import Peer, WriteTimeoutError
from kestrel_stream.serve.socket_peer import SocketPeer
from kestrel_stream.serve.socket_reader import SocketReader
from kestrel_stream.wire.protocol import (VERSION, AuthError, DaemonError, IdleTimeoutError,
                                          ProtocolError, default_socket_path, default_token_path, encode_frame,
                                          error_header, make_runtime_dir)

DRAIN_TIMEOUT_S = 30.0          # how long a shutdown waits for in-flight requests
# The event loop lets go of the interpreter lock in every socket call and epoll wait.  While a worker thread runs
# Python (a large body parsed, a prompt rendered, a step's host work), the loop gets it back only once that thread
# is asked to let go, after the switch interval (5 ms by default), and it pays that at every such call: a small
# request behind a few busy connections waited tens of milliseconds.
LOOP_SWITCH_INTERVAL_S = 0.0005


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


async def serve(engines, args, environment, devices: list[str] | None = None) -> int:
    """Serve the engines (one replica each, on ``devices``) until SIGINT/SIGTERM."""
    from scheduler.batcher import StepBatcher, default_step_tokens
    from kestrel_stream.serve.service import Service
    from kestrel_stream.serve.traces import DaemonTraces, prepare_trace_dir
    from kestrel_stream.serve.http.server import http_server
    http = http_server(args)
    limits = limits_from_args(args)
    uses_runtime_dir = not args.trace_dir or not (args.socket or args.tcp)
    made_dir = make_runtime_dir(environment.runtime_dir) if uses_runtime_dir else None     # removed at exit, once empty
    traces = DaemonTraces(prepare_trace_dir(args.trace_dir, environment.runtime_dir), limits.trace_max_events)
    engine = engines[0]
    sampling_defaults = with_model_defaults(sampling_defaults_from_args(args),
                                            model_sampling_defaults(engine.weights.source))
    if sampling_defaults.given():
        log("requests that set none get " + ", ".join(f"{k} {v:g}" for k, v in sampling_defaults.given().items()))
    step_tokens = args.step_tokens or default_step_tokens(on_device=engine.device == "cuda")
    batchers = [StepBatcher(max_batch=args.max_batch, window_s=args.batch_window_ms / 1e3, step_tokens=step_tokens)
                for _ in engines]                   # each replica forms its own steps
    service = Service(engines, args.max_sessions, batchers, inline_max_s=args.inline_max_ms / 1e3,
                      sessions_per_client=limits.sessions_per_client, traces=traces, max_queue=args.max_queue,
                      sampling_defaults=sampling_defaults, devices=devices, prefix_slack=args.route_prefix_slack)
    socket_path = None
    if args.tcp:
        host, _, port = args.tcp.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        if host not in ("127.0.0.1", "localhost", "::1"):
            log(f"WARNING: listening on {host}, which is not loopback; anyone with the token can connect")
        token_path = Path(args.token_file) if args.token_file else default_token_path(environment.runtime_dir)
        daemon = Daemon(engine, service, load_token(args, token_path, environment.token), limits)
        listener = await anyio.create_tcp_listener(local_host=host, local_port=int(port))
        bound = listener.listeners[0].extra(anyio.abc.SocketAttribute.local_address)
        where = f"tcp:{bound[0]}:{bound[1]} (token required)"
    else:
        socket_path = Path(args.socket) if args.socket else default_socket_path(environment.runtime_dir)
        prepare_socket_path(socket_path)
        with private_umask():
            listener = await anyio.create_unix_listener(socket_path, mode=0o600)
        daemon = Daemon(engine, service, None, limits)
        daemon.reader = SocketReader()
        if args.spin_us > 0:
            for replica in service.replicas:
                replica.steps.after_inline = partial(daemon.reader.spin_for, args.spin_us / 1e6)
        where = f"unix:{socket_path} (mode 0600)"
    if len(engines) > 1:
        log(f"{len(engines)} replicas ({', '.join(replica.device for replica in service.replicas)}): a session "
            f"stays on its replica; a new one goes to the least loaded, or to one caching a longer prefix of its "
            f"prompt up to {args.route_prefix_slack} sessions busier (--route-prefix-slack)")
    log(f"max {args.max_sessions} sessions ({limits.sessions_per_client} per client; {args.max_queue} HTTP "
        f"generations may wait for one), steps of up to "
        f"{args.max_batch} sessions and {step_tokens} tokens within {args.batch_window_ms} ms"
        f"{' on each replica' if len(engines) > 1 else ''}; "
        f"max {limits.max_connections} connections "
        f"({limits.max_unauthenticated} before hello); traces in {traces.directory}")
    map_large_buffers()
    sys.setswitchinterval(LOOP_SWITCH_INTERVAL_S)
    log(f"listening on {where}")
    try:
        async with anyio.create_task_group() as tg:
            daemon.spawn = tg.start_soon
            if http is not None:        # the OpenAI-compatible API on the same service (serve/http/)
                await tg.start(http.run, service)
            freeze_loaded_objects()     # the model, the modules and both servers: no full collection walks them
            for one in getattr(listener, "listeners", [listener]):     # TCP may listen on IPv4 and IPv6
                tg.start_soon(daemon.accept_forever, one, tg)
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    if http is not None:        # no new generations; running HTTP responses end first
                        service.start_draining()
                        await http.stop()
                    await daemon.shutdown(tg.cancel_scope, signal.Signals(signum).name)
                    break
    finally:
        with anyio.CancelScope(shield=True):
            await listener.aclose()
        if socket_path is not None:
            socket_path.unlink(missing_ok=True)
        if made_dir is not None:
            with contextlib.suppress(OSError):      # not empty: traces were written, or something else put a file there
                if traces.directory.parent == made_dir:
                    traces.directory.rmdir()
                made_dir.rmdir()
        service.stop()                      # waits for a step still running (a drain that timed out)
        if daemon.reader is not None:
            daemon.reader.stop()
    log("stopped")
    return 0


def run_daemon(args, environment) -> int:
    """Load the model (one engine per device of --devices, else one), log what was loaded, and serve until
    SIGINT/SIGTERM.

    environment: the process's Environment (socket directory, token), read by the CLI."""
    from kestrel_stream.api import load
    from kestrel_stream.serve.devices import load_replicas, make_ready, serve_devices
    check_serve_args(args)
    devices = serve_devices(args)           # bad --devices fail before anything loads
    from kestrel_stream.serve.http.server import http_options
    http_options(args)                      # bad --http flags fail before the model loads
    if getattr(args, "trace", None):          # `serve --trace FILE`: the CLI stops and writes it at exit
        from kestrel_stream.obs import trace
        trace.start(args.trace, command="serve")

    def load_one(device: str):
        return load(args.model, device=device, mode=args.mode, vram_budget=args.vram_budget,
                    max_seq_len=args.max_seq_len, max_batch=args.max_batch, max_sessions=args.max_sessions,
                    cache=not args.no_cache, kv_dtype=args.kv_dtype, cpu_threads=args.cpu_threads,
                    draft=args.model_draft, spec=args.spec, draft_max=args.draft_max, spec_policy=args.spec_policy)
    engines = load_replicas(load_one, devices or [args.device], args.devices)
    try:
        engine = engines[0]
        engine.build_tokenizer_in_background()   # while the daemon starts: the first text request rarely waits
        prefix_positions = (4 * engine.max_seq_len if args.prefix_cache_positions is None
                            else args.prefix_cache_positions)
        cfg = engine.config
        log(f"model {args.model}: {cfg.arch}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
            f"vocab {cfg.vocab_size}; device {engine.device}, mode {engine.mode}, max_seq_len {engine.max_seq_len}")
        make_ready(engines, devices, prefix_positions, log)
        return anyio.run(serve, engines, args, environment, devices)
    finally:
        for engine in engines:
            engine.close()
