"""Memory comes back: after each round of an attack (large bodies, slow bodies, SSE clients that leave, socket
clients that never read) the daemon's RSS, read from /proc/PID/status, is back within 10 % of its idle figure,
taken after ordinary requests and before any attack.

The prefix cache is off here: what it holds is bounded by --prefix-cache-positions, by design, and which
prompts it holds changes from round to round (a round's new sessions evict its entries), which would move the
idle figure by a whole cached KV; the rounds measure what a request leaves behind once it has ended."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from daemon_helpers import raw_connect, read_frame, rss_bytes
from http_helpers import HttpDaemon, chat_model
from test_http_large_bodies import many_messages, one_long_text

import kestrel_stream as ks
from kestrel_stream.wire import protocol as wire

MODEL = "m"
pytestmark = pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="reads /proc")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    where = tmp_path_factory.mktemp("memory")
    d = HttpDaemon(chat_model(where / "model"), where, "--served-model-name", MODEL, "--http-body-timeout-s", "1",
                   "--write-timeout-s", "1", "--prefix-cache-positions", "0")
    yield d
    assert d.stop() == 0
    assert "Traceback" not in d.log_path.read_text()


def port_of(d) -> int:
    return int(d.base_url.removesuffix("/v1").rsplit(":", 1)[1])


def send_and_read(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(request)
        data = b""
        while part := sock.recv(65536):
            data += part
            if data.endswith(b"}") or data.endswith(b"[DONE]\n\n"):
                break
        return data


def post(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def large_bodies(d) -> None:
    """Eight 4 MB bodies at once, refused after parsing."""
    bodies = [many_messages() if i % 2 else one_long_text() for i in range(8)]
    threads = [threading.Thread(target=send_and_read, args=(port_of(d), post("/v1/chat/completions", b)))
               for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)


def slow_bodies(d) -> None:
    """64 requests announcing 1 MB and sending 64 KB of it, then nothing: each ends at the body timeout."""
    socks = []
    for _ in range(64):
        sock = socket.create_connection(("127.0.0.1", port_of(d)), timeout=30)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1048576\r\n\r\n" + b" " * 65536)
        socks.append(sock)
    for sock in socks:
        assert sock.recv(12) == b"HTTP/1.1 408"
        sock.close()


def sse_disconnects(d) -> None:
    """32 streams whose clients leave after their first event."""
    body = json.dumps({"model": MODEL, "prompt": "stream " * 50, "max_tokens": 500, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    for _ in range(32):
        with socket.create_connection(("127.0.0.1", port_of(d)), timeout=30) as sock:
            sock.sendall(post("/v1/completions", body))
            data = b""
            while b"data: {" not in data:
                data += sock.recv(65536)


def socket_clients_that_never_read(d) -> None:
    """60 socket clients asking for a prompt's logits, 2 MB of answer each, and never reading it: each is
    disconnected at the write timeout."""
    socks = []
    ids = list(range(1, 200)) * 10
    for _ in range(60):
        sock = raw_connect(d.address)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(wire.encode_frame({"op": "open", "id": 1}))
        session = read_frame(sock).header["session"]
        sock.sendall(wire.encode_frame({"op": "prefill", "id": 2, "session": session, "want": "logits"},
                                       {"ids": __import__("numpy").asarray(ids, "int64")}))
        socks.append(sock)
    time.sleep(1.5)                         # past the write timeout
    for sock in socks:
        sock.close()


ROUNDS = {"large bodies": large_bodies, "slow bodies": slow_bodies,
          "socket clients that never read": socket_clients_that_never_read, "SSE disconnects": sse_disconnects}


def settled_rss(pid: int, ceiling: int, timeout_s: float = 15.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (rss := rss_bytes(pid)) > ceiling and time.monotonic() < deadline:
        time.sleep(0.1)
    return rss


def ordinary_use(d) -> None:
    """Well-formed requests of each kind: completions whole and streamed, a chat, a socket client's generation."""
    for stream in (False, True):
        body = json.dumps({"model": MODEL, "prompt": "hello " * 50, "max_tokens": 32, "temperature": 0,
                           "stream": stream}).encode()
        send_and_read(port_of(d), post("/v1/completions", body))
    chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}).encode()
    send_and_read(port_of(d), post("/v1/chat/completions", chat))
    with ks.Client(d.address) as client:
        client.generate("hello there", max_new_tokens=16)


@pytest.fixture(scope="module")
def idle_rss(daemon) -> int:
    """RSS once the daemon has served ordinary requests (its threads, their allocator arenas and the interpreter's
    caches at their working size) and no attack: whatever an attack round leaves behind shows against it."""
    for _ in range(2):
        ordinary_use(daemon)
    time.sleep(2.0)
    return rss_bytes(daemon.proc.pid)


@pytest.mark.parametrize("name", list(ROUNDS))
def test_rss_comes_back_within_10_percent_of_idle_after_a_round(daemon, idle_rss, name):
    for _ in range(2):
        ROUNDS[name](daemon)
        rss = settled_rss(daemon.proc.pid, int(idle_rss * 1.1))
        print(f"after {name}: {rss >> 20} MiB, idle {idle_rss >> 20} MiB")
        assert rss <= idle_rss * 1.1, f"after {name}: {rss >> 20} MiB, idle {idle_rss >> 20} MiB"


def test_the_idle_collection_waits_until_no_work_is_in_progress(monkeypatch):
    """A full collection holds the interpreter (the event loop included) from start to end: it runs once sessions,
    socket requests and HTTP requests (bodies still read or parsed among them) have all ended."""
    import asyncio

    from kestrel_stream.serve import memory
    collected: list[float] = []
    monkeypatch.setattr(memory, "TRIM_INTERVAL_S", 0.02)
    monkeypatch.setattr(memory, "collect_cycles", lambda: collected.append(time.monotonic()))
    monkeypatch.setattr(memory, "release_freed_memory", lambda: True)
    requests_in_progress = [1]

    async def main() -> float:
        pages = memory.FreedPages()
        pages.count_busy(lambda: 0)                 # no session held
        pages.count_busy(lambda: requests_in_progress[0])
        pages.give_back_soon()                      # a body refused while another is still being parsed
        await asyncio.sleep(0.15)
        assert collected == []
        requests_in_progress[0] = 0
        ended = time.monotonic()
        await asyncio.sleep(0.1)
        return ended
    ended = asyncio.run(main())
    assert len(collected) == 1 and collected[0] >= ended
