"""A session lives as long as its request, on every transport: clients that leave at any moment (HTTP/1.1 FIN or
RST, HTTP/2 stream resets, socket clients closing mid-open) leave no session open, a well-formed client is served
throughout (1,000 early disconnects of every kind on one daemon, /metrics' kestrel_sessions back to 0 after), and
--max-sessions holds against opens racing each other."""
from __future__ import annotations

import json
import logging
import random
import socket
import struct
import threading
import time

import numpy as np
import pytest
from daemon_helpers import raw_connect, read_frame
from http_helpers import chat_model, metric
from inprocess_daemon import MODEL_NAME, H2Client, InProcessDaemon, http_answer, http_request

import kestrel_stream as ks
from kestrel_stream.wire import protocol as wire

ROUNDS = 350            # a transport each: 1,050 early disconnects in all
MAX_SESSIONS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("sessions-model") / "model")


@pytest.fixture
def server(model, tmp_path, request):
    """request.param: --max-queue (0 unless a test asks for a queue: then clients also leave while queued)."""
    d = InProcessDaemon(model, tmp_path, max_sessions=MAX_SESSIONS, max_queue=getattr(request, "param", 0))
    yield d
    d.stop()


QUEUES = pytest.mark.parametrize("server", [0, 64], indirect=True, ids=["no-queue", "queue"])


def completion_body(i: int, stream: bool = False, max_tokens: int = 64) -> bytes:
    return json.dumps({"model": MODEL_NAME, "prompt": f"leave {i}", "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": stream}).encode()


def served(server, retry_for_s: float = 2.0) -> None:
    """A well-formed request gets its whole answer (as a client honouring Retry-After would: the places of clients
    that just left free as their cancellations land)."""
    deadline = time.monotonic() + retry_for_s
    while True:
        with server.connect_http() as sock:
            sock.sendall(http_request("POST", "/v1/completions", completion_body(0, max_tokens=4)))
            status, body = http_answer(sock)
        if status != 429 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert status == 200, (body, server.sessions())
    assert json.loads(body)["usage"]["completion_tokens"] == 4


def leave(sock: socket.socket, reset: bool) -> None:
    if reset:       # RST instead of FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@QUEUES
def test_http1_clients_leaving_at_any_moment_leave_no_session(server):
    rng = random.Random(1)
    for i in range(ROUNDS):
        sock = server.connect_http()
        sock.sendall(http_request("POST", "/v1/completions", completion_body(i, stream=i % 3 == 0)))
        time.sleep(rng.uniform(0, 0.002))
        leave(sock, reset=i % 2 == 1)
        if i % 50 == 49:
            served(server)
    assert server.settled_sessions() == 0, f"{server.sessions()} sessions left open by departed clients"
    assert server.service.held_sessions == 0 and server.service.admission.queued == 0
    served(server)


@QUEUES
def test_http2_streams_reset_at_any_moment_leave_no_session(server, caplog):
    """Reset streams leave no session, their connection serving and no traceback in the log (they once left a
    KeyError traceback there)."""
    rng = random.Random(2)
    client = H2Client(server.http_port)
    try:
        with caplog.at_level(logging.ERROR):
            for i in range(ROUNDS):
                stream = client.post("/v1/completions", completion_body(i, stream=i % 2 == 0))
                time.sleep(rng.uniform(0, 0.002))
                client.reset(stream)
                if i % 50 == 49:
                    served(server)
            assert server.settled_sessions() == 0, f"{server.sessions()} sessions left open by reset streams"
            assert server.service.held_sessions == 0 and server.service.admission.queued == 0
            assert not client.closed, "the server closed the connection of the reset streams"
        assert "KeyError" not in caplog.text and "Traceback" not in caplog.text, caplog.text[-2000:]
    finally:
        client.close()
    served(server)


def test_socket_clients_leaving_mid_open_leave_no_session(server):
    rng = random.Random(3)
    for i in range(ROUNDS):
        sock = raw_connect(str(server.socket_path))
        sock.sendall(wire.encode_frame({"op": "open", "id": 1}))
        time.sleep(rng.uniform(0, 0.002))
        leave(sock, reset=i % 2 == 1)
    assert server.settled_sessions() == 0, f"{server.sessions()} sessions left open by departed socket clients"
    served(server)


@pytest.mark.parametrize("server", [64], indirect=True, ids=["queue"])
def test_a_thousand_early_disconnects_of_every_kind_leave_no_session_while_a_client_is_served(server):
    """HTTP/1.1 clients closing (FIN and RST), HTTP/2 streams reset and socket clients closing mid-open, 1,000 in
    all, each at a random moment after its request, on one daemon; meanwhile a well-formed client generates again
    and again, and every answer it gets is whole (it waits its turn for a session as the admission queue lets
    it); the engine never holds more than --max-sessions, sampled throughout; after them /metrics says
    kestrel_sessions 0."""
    rng = random.Random(4)
    answered: list[tuple[float, int, bytes]] = []
    peak, storming = [0], threading.Event()
    storming.set()

    def sample() -> None:
        while storming.is_set():
            peak[0] = max(peak[0], server.sessions())
            time.sleep(0.0005)

    def well_formed() -> None:
        while storming.is_set():
            with server.connect_http() as sock:
                sock.sendall(http_request("POST", "/v1/completions", completion_body(0, max_tokens=4)))
                status, body = http_answer(sock)
            answered.append((time.monotonic(), status, body))
    client, sampler = threading.Thread(target=well_formed), threading.Thread(target=sample)
    h2_client = H2Client(server.http_port)
    started = time.monotonic()
    client.start()
    sampler.start()
    try:
        for i in range(1000):
            kind = i % 4
            if kind < 2:            # HTTP/1.1: FIN, RST
                sock = server.connect_http()
                sock.sendall(http_request("POST", "/v1/completions", completion_body(i, stream=i % 3 == 0)))
                time.sleep(rng.uniform(0, 0.002))
                leave(sock, reset=kind == 1)
            elif kind == 2:         # HTTP/2: a stream reset on a connection that goes on
                stream = h2_client.post("/v1/completions", completion_body(i, stream=i % 8 == 2))
                time.sleep(rng.uniform(0, 0.002))
                h2_client.reset(stream)
            else:                   # the socket: closed while its open is on its way
                sock = raw_connect(str(server.socket_path))
                sock.sendall(wire.encode_frame({"op": "open", "id": 1}))
                time.sleep(rng.uniform(0, 0.002))
                leave(sock, reset=i % 8 == 7)
    finally:
        ended = time.monotonic()
        storming.clear()
        client.join(60)
        sampler.join()
        h2_client.close()
    assert peak[0] <= MAX_SESSIONS, f"{peak[0]} sessions open at once, --max-sessions {MAX_SESSIONS}"
    assert answered and all(status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4
                            for _, status, body in answered), [a for a in answered if a[1] != 200][:3]
    times = [started] + [at for at, _, _ in answered if at <= ended] + [ended]
    longest_wait_s = max(b - a for a, b in zip(times, times[1:]))
    assert longest_wait_s < 5.0, f"the well-formed client waited {longest_wait_s:.1f} s for an answer"
    deadline = time.monotonic() + 10.0
    while True:
        with server.connect_http() as sock:
            sock.sendall(http_request("GET", "/metrics"))
            status, text = http_answer(sock)
        sessions = metric(text.decode(), "kestrel_sessions")
        if sessions == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert status == 200 and sessions == 0, f"kestrel_sessions {sessions} after the clients left"
    assert server.service.held_sessions == 0 and server.service.admission.queued == 0


def test_max_sessions_holds_against_racing_opens(server):
    """Three times --max-sessions socket clients open a session each, all at once, and keep it: exactly
    --max-sessions succeed, the others get a capacity error naming the flag."""
    clients = [raw_connect(str(server.socket_path)) for _ in range(3 * MAX_SESSIONS)]
    try:
        for sock in clients:
            sock.sendall(wire.encode_frame({"op": "open", "id": 1}))
        replies = [read_frame(sock).header for sock in clients]
        opened = [r for r in replies if r["ok"]]
        refused = [r for r in replies if not r["ok"]]
        assert len(opened) == MAX_SESSIONS and server.sessions() == MAX_SESSIONS
        assert all(r["code"] == "capacity" and "--max-sessions" in r["message"] for r in refused)
    finally:
        for sock in clients:
            sock.close()
    assert server.settled_sessions() == 0
    with ks.Client(str(server.socket_path)) as client, client.new_session():
        assert client.stats()["sessions"] == 1


def test_socket_clients_closing_during_long_prefills_stop_their_work(server):
    """Eight clients send a 2,000-token prompt each (64 steps of 256 tokens in all) and close their sockets: their
    prompts stop being computed and their sessions are freed after a few steps, not when the prompts would have
    ended; a client that only shuts its writing side still gets its answer."""
    ids = np.arange(1, 2001, dtype=np.int64) % 250 + 1
    clients = []
    for _ in range(8):
        sock = raw_connect(str(server.socket_path))
        sock.sendall(wire.encode_frame({"op": "open", "id": 1}))
        session = read_frame(sock).header["session"]
        sock.sendall(wire.encode_frame({"op": "prefill", "id": 2, "session": session, "want": "logits"},
                                       {"ids": ids}))
        clients.append(sock)
    time.sleep(0.1)
    steps_at_close = server.service.stats()["steps"]
    for sock in clients:
        leave(sock, reset=False)
    assert server.settled_sessions(timeout_s=30) == 0
    steps_after = server.service.stats()["steps"] - steps_at_close
    assert steps_after <= 16, f"{steps_after} steps ran for clients that had left (their prompts needed 64)"
    assert server.service.stats()["queue_depth"] == 0
    with raw_connect(str(server.socket_path)) as sock:
        sock.sendall(wire.encode_frame({"op": "open", "id": 1}))
        session = read_frame(sock).header["session"]
        sock.sendall(wire.encode_frame({"op": "prefill", "id": 2, "session": session, "want": "token"},
                                       {"ids": ids[:50]}))
        sock.shutdown(socket.SHUT_WR)
        assert read_frame(sock).header["ok"]


def test_max_sessions_holds_against_http_and_socket_opens_together(server):
    """Socket opens and HTTP generations racing for the same --max-sessions: the engine never holds more, sampled
    throughout; every HTTP request is answered whole or refused with 429 naming the flag."""
    peak, racing = [0], threading.Event()
    racing.set()

    def sample() -> None:
        while racing.is_set():
            peak[0] = max(peak[0], server.sessions())
    sampler = threading.Thread(target=sample)
    sampler.start()
    statuses: list = []

    def generate(i: int) -> None:
        with server.connect_http() as sock:
            sock.sendall(http_request("POST", "/v1/completions", completion_body(i, max_tokens=16)))
            status, body = http_answer(sock)
        statuses.append((status, body))
    clients = [raw_connect(str(server.socket_path)) for _ in range(2 * MAX_SESSIONS)]
    try:
        senders = [threading.Thread(target=generate, args=(i,)) for i in range(MAX_SESSIONS)]
        for t in senders:
            t.start()
        for sock in clients:
            sock.sendall(wire.encode_frame({"op": "open", "id": 1}))
        opened = sum(read_frame(sock).header["ok"] for sock in clients)
        for t in senders:
            t.join(60)
    finally:
        racing.clear()
        sampler.join()
        for sock in clients:
            sock.close()
    assert peak[0] <= MAX_SESSIONS and opened <= MAX_SESSIONS
    assert all(status == 200 or (status == 429 and b"--max-sessions" in body) for status, body in statuses), statuses
    assert server.settled_sessions() == 0
