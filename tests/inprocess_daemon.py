"""The daemon's service, HTTP API and Unix socket served from an event loop on a thread of the test's process,
so a test can race thousands of clients against it in seconds and look at the engine's sessions directly."""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import anyio
import h2.config
import h2.connection
import h2.events
from anyio.from_thread import start_blocking_portal

import kestrel_stream as ks
from kestrel_stream.serve.http.options import HttpOptions
from kestrel_stream.serve.limits import Limits

MODEL_NAME = "m"


class InProcessDaemon:
    """``serve --socket SOCKET --http 127.0.0.1:0`` without its process: ``service``, ``engine``, ``http_port``
    and ``socket_path`` are the real ones; ``stop()`` ends the loop.  With ``devices`` (``serve --devices``) one
    engine per device, ``engines``, the first of them ``engine``."""

    def __init__(self, model, where: Path, max_sessions: int = 8, max_queue: int = 0, load: dict | None = None,
                 devices: list[str] | None = None, prefix_slack: int = 4, limits: Limits | None = None,
                 **http_fields):
        """load: more of ks.load's arguments (e.g. a draft, a device); limits: the socket's (serve/limits.py)."""
        from scheduler.batcher import StepBatcher

        from kestrel_stream.serve.daemon import Daemon
        from kestrel_stream.serve.http.server import HttpServer
        from kestrel_stream.serve.service import Service
        from kestrel_stream.serve.socket_reader import SocketReader
        self.engines = [ks.load(str(model), **{"max_sessions": max_sessions, **(load or {}), "device": device})
                        for device in devices or [(load or {}).get("device", "cpu")]]
        self.engine = self.engines[0]
        for engine in self.engines:
            engine.enable_prefix_cache(4 * engine.max_seq_len)
        self.portal_cm = start_blocking_portal()
        self.portal = self.portal_cm.__enter__()

        async def make_service():
            return Service(self.engines, max_sessions, [StepBatcher() for _ in self.engines], max_queue=max_queue,
                           devices=devices, prefix_slack=prefix_slack)
        self.service = self.portal.call(make_service)
        options = HttpOptions(**{"host": "127.0.0.1", "port": 0, "api_key": None, "max_requests": max_sessions if not max_queue else None,
                                 "max_body_bytes": 4 << 20, "model_name": MODEL_NAME, "access_log": False,
                                 **http_fields})
        self.http = HttpServer(options)
        self.http_future, _ = self.portal.start_task(self.http.run, self.service)
        self.http_port = self.bound_port()
        self.socket_path = where / "ks.sock"
        self.daemon = Daemon(self.engine, self.service, None, limits or Limits())
        self.daemon.reader = SocketReader()
        self.socket_future, _ = self.portal.start_task(self.serve_socket)

    def bound_port(self) -> int:
        while self.http.bound is None:
            time.sleep(0.01)
        return self.http.bound[1]

    async def serve_socket(self, task_status) -> None:
        listener = await anyio.create_unix_listener(self.socket_path, mode=0o600)
        async with listener, anyio.create_task_group() as tg:
            self.daemon.spawn = tg.start_soon
            self.stop_socket = tg.cancel_scope
            task_status.started()
            await self.daemon.accept_forever(listener, tg)

    def sessions(self) -> int:
        return sum(len(engine.sessions) for engine in self.engines)

    def settled_sessions(self, timeout_s: float = 10.0) -> int:
        """The engine's open sessions once no close is on its way (or timeout_s has passed)."""
        deadline = time.monotonic() + timeout_s
        while (self.sessions() or self.service.held_sessions) and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.sessions()

    def connect_http(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.http_port), timeout=10)

    def stop(self) -> None:
        self.portal.call(self.http.stop)
        self.portal.call(self.stop_socket.cancel)
        self.portal_cm.__exit__(None, None, None)
        self.service.stop()
        self.daemon.reader.stop()
        for engine in self.engines:
            engine.close()


def http_request(method: str, path: str, body: bytes = b"", host: str = "127.0.0.1",
                 content_type: str = "application/json", extra: bytes = b"") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n").encode() + extra + b"\r\n" + body


def http_answer(sock: socket.socket) -> tuple[int, bytes]:
    """The status and body of one answer with Content-Length (read to the end of its body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        if not part:
            raise ConnectionError(f"closed after {data!r}")
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), None)
    while length is not None and len(body) < length:
        part = sock.recv(65536)
        if not part:
            break
        body += part
    return int(head.split(b" ")[1]), body


class H2Client:
    """HTTP/2 with prior knowledge over one connection, its answers read and dropped on a thread."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.lock = threading.Lock()
        self.closed = False             # the server closed the connection
        self.ended: set[int] = set()
        self.statuses: dict[int, int] = {}
        with self.lock:
            self.conn.initiate_connection()
            self.flush()
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def flush(self) -> None:
        self.sock.sendall(self.conn.data_to_send())

    def read(self) -> None:
        try:
            while data := self.sock.recv(65536):
                with self.lock:
                    for event in self.conn.receive_data(data):
                        if isinstance(event, h2.events.DataReceived):
                            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                        elif isinstance(event, h2.events.ResponseReceived):
                            self.statuses[event.stream_id] = int(dict(event.headers)[b":status"])
                        elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                            self.ended.add(event.stream_id)
                    self.flush()
        except OSError:
            pass
        finally:
            self.closed = True

    def post(self, path: str, body: bytes, method: str = "POST") -> int:
        """Stream id of a request sent whole; its body in frames as flow control lets them go."""
        with self.lock:
            stream = self.conn.get_next_available_stream_id()
            self.conn.send_headers(stream, [(":method", method), (":path", path), (":scheme", "http"),
                                            (":authority", "127.0.0.1"), ("content-type", "application/json"),
                                            ("content-length", str(len(body)))], end_stream=not body)
            self.flush()
        sent = 0
        while sent < len(body):
            with self.lock:
                if stream in self.ended:
                    break
                room = min(self.conn.local_flow_control_window(stream), self.conn.max_outbound_frame_size)
                if room > 0:
                    part = body[sent:sent + room]
                    sent += len(part)
                    self.conn.send_data(stream, part, end_stream=sent == len(body))
                    self.flush()
            if room <= 0:
                time.sleep(0.001)
        return stream

    def status(self, stream: int, timeout_s: float = 10.0) -> int | None:
        """The status of a stream's answer once it has ended (None: reset without one)."""
        deadline = time.monotonic() + timeout_s
        while stream not in self.ended:
            assert time.monotonic() < deadline, f"stream {stream} did not end"
            time.sleep(0.005)
        return self.statuses.get(stream)

    def reset(self, stream: int) -> None:
        with self.lock:
            if stream not in self.ended:
                self.conn.reset_stream(stream)
                self.flush()

    def close(self) -> None:
        self.sock.close()
