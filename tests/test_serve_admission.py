"""Admission: --max-sessions places and a bounded queue of generations waiting for one (--max-queue).

The queue on its own (serve/admission.py), then through the HTTP API: a queue that fills and drains, 429 only when
it is full (with a message naming both flags), a client that leaves while queued frees its place, the queue's depth
and wait in stats and /metrics, and no session left open."""
from __future__ import annotations

import json
import socket
import threading
import time

import anyio
import httpx
import pytest
from http_helpers import chat_model, metric
from inprocess_daemon import MODEL_NAME, InProcessDaemon, http_answer, http_request

from kestrel_stream.errors import CapacityError
from kestrel_stream.serve.admission import Admission


def run(fn):
    return anyio.run(fn)


def test_places_are_taken_at_once_until_held_then_queued_first_come_first_served():
    async def main():
        admission = Admission(max_sessions=2, max_queue=2)
        assert await admission.take() == 0.0 and await admission.take() == 0.0
        order = []

        async def wait(name):
            await admission.take(what=name)
            order.append(name)
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait, "first")
            await anyio.sleep(0.01)
            tg.start_soon(wait, "second")
            await anyio.sleep(0.01)
            assert admission.queued == 2 and admission.held == 2
            assert not admission.try_take()         # a newcomer does not overtake the queue
            with pytest.raises(CapacityError, match=r"all 2 sessions are in use \(--max-sessions 2\) and 2 requests "
                                                    r"are waiting.*--max-queue 2"):
                await admission.take(what="third")
            admission.give_back()
            await anyio.sleep(0.01)
            assert order == ["first"] and admission.held == 2 and admission.queued == 1
            admission.give_back()
        assert order == ["first", "second"] and admission.held == 2
        stats = admission.stats()
        assert stats["admission_waited"] == 2 and stats["admission_refused_queue_full"] == 1
        assert stats["admission_max_wait_ms"] >= 10 and stats["admission_queue_depth"] == 0
    run(main)


def test_a_waiter_that_leaves_frees_its_place_in_the_queue_and_any_place_handed_to_it():
    async def main():
        admission = Admission(max_sessions=1, max_queue=1)
        assert admission.try_take()
        with anyio.move_on_after(0.02):             # the client leaves while queued
            await admission.take()
        assert admission.queued == 0 and admission.held == 1
        got = []

        async def take():
            got.append(await admission.take())
        async with anyio.create_task_group() as tg:
            tg.start_soon(take)
            await anyio.sleep(0.01)
            admission.give_back()                   # handed to the waiter ...
            tg.cancel_scope.cancel()                # ... which leaves around the moment it resumes
        # either it left (its place handed on) or it returned holding it: never a place lost or held twice
        assert admission.held == len(got) and admission.queued == 0
        assert admission.left_while_queued == 2 - len(got)
    run(main)


def test_a_request_for_more_sessions_than_exist_is_refused_and_none_waits_without_a_queue():
    async def main():
        admission = Admission(max_sessions=2, max_queue=0)
        with pytest.raises(CapacityError, match="needs 3 sessions at once"):
            await admission.take(3)
        await admission.take(2)
        with pytest.raises(CapacityError, match="--max-queue 0"):
            await admission.take()
    run(main)


def test_a_stopping_daemon_refuses_every_waiter_and_every_newcomer():
    async def main():
        admission = Admission(max_sessions=1, max_queue=4)
        assert admission.try_take()
        errors = []

        async def wait():
            try:
                await admission.take()
            except RuntimeError as e:
                errors.append(str(e))
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(wait)
            await anyio.sleep(0.01)
            assert admission.queued == 3
            admission.refuse_all(RuntimeError("stopping"))
        assert errors == ["stopping"] * 3 and admission.queued == 0 and admission.held == 1
        with pytest.raises(RuntimeError, match="stopping"):
            await admission.take()
        admission.give_back()
        assert await admission.take() == 0.0          # a free place is still taken at once (a close, a drain)
    run(main)


MAX_SESSIONS, MAX_QUEUE = 2, 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("admission-model") / "model")


@pytest.fixture
def server(model, tmp_path):
    d = InProcessDaemon(model, tmp_path, max_sessions=MAX_SESSIONS, max_queue=MAX_QUEUE)
    yield d
    d.stop()


def body(max_tokens: int, stream: bool = False) -> bytes:
    return json.dumps({"model": MODEL_NAME, "prompt": "queue", "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": stream}).encode()


def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_queue_fills_refuses_only_when_full_and_drains(server):
    holders = []
    for _ in range(MAX_SESSIONS):           # two long streams hold every session
        sock = server.connect_http()
        sock.sendall(http_request("POST", "/v1/completions", body(1500, stream=True)))
        data = b""
        while b"data: {" not in data:
            data += sock.recv(65536)
        holders.append(sock)
    answers: dict[int, tuple[int, bytes]] = {}

    def queued(i: int, sock) -> None:
        sock.sendall(http_request("POST", "/v1/completions", body(8)))
        try:
            answers[i] = http_answer(sock)
        except OSError:                     # the one that leaves
            answers[i] = (None, b"")
    waiting = [server.connect_http() for _ in range(MAX_QUEUE)]
    threads = [threading.Thread(target=queued, args=(i, s)) for i, s in enumerate(waiting)]
    for t in threads:
        t.start()
    wait_for(lambda: server.service.stats()["admission_queue_depth"] == MAX_QUEUE)
    with server.connect_http() as sock:     # the queue is full: refused at once, naming both flags
        sock.sendall(http_request("POST", "/v1/completions", body(8)))
        status, refused = http_answer(sock)
    assert status == 429, refused
    error = json.loads(refused)["error"]
    assert "--max-sessions 2" in error["message"] and "--max-queue 3" in error["message"]
    assert server.service.stats()["admission_refused_queue_full"] == 1

    leaver = waiting.pop()                  # a queued client leaves: its place in the queue is freed
    leaver.shutdown(socket.SHUT_RDWR)
    leaver.close()
    wait_for(lambda: server.service.stats()["admission_left_while_queued"] == 1)
    assert server.service.stats()["admission_queue_depth"] == MAX_QUEUE - 1
    with server.connect_http() as sock:     # so one more may wait: it is queued, not refused
        sock.sendall(http_request("POST", "/v1/completions", body(8)))
        wait_for(lambda: server.service.stats()["admission_queue_depth"] == MAX_QUEUE)
        for holder in holders:              # the holders leave: the queue drains in order
            holder.close()
        status, late = http_answer(sock)
    assert status == 200 and json.loads(late)["usage"]["completion_tokens"] == 8
    for t in threads[:-1]:
        t.join(30)
    assert [answers[i][0] for i in range(MAX_QUEUE - 1)] == [200] * (MAX_QUEUE - 1), answers
    assert server.settled_sessions() == 0 and server.service.held_sessions == 0
    stats = server.service.stats()
    assert stats["admission_queue_depth"] == 0 and stats["admission_waited"] == MAX_QUEUE
    assert stats["admission_max_wait_ms"] > 0
    with server.connect_http() as sock:
        sock.sendall(http_request("GET", "/metrics"))
        status, text = http_answer(sock)
    text = text.decode()
    assert metric(text, "kestrel_admission_queue_depth") == 0
    assert metric(text, "kestrel_admission_waited_total") == MAX_QUEUE
    assert metric(text, "kestrel_admission_wait_seconds_total") > 0
    assert metric(text, "kestrel_admission_refused_total") == 1


def test_many_more_generations_than_sessions_are_all_served(server):
    """4 x (--max-sessions + --max-queue) is over the queue; clients that retry on 429 as the openai client does are
    all served, and at most --max-sessions sessions are ever open."""
    peak, statuses = [0], []
    sampling = threading.Event()
    sampling.set()

    def sample():
        while sampling.is_set():
            peak[0] = max(peak[0], server.sessions())
            time.sleep(0.001)

    def client(i: int):
        while True:
            with server.connect_http() as sock:
                sock.sendall(http_request("POST", "/v1/completions", body(4)))
                status, answer = http_answer(sock)
            if status != 429:
                statuses.append(status)
                return
            time.sleep(0.05)
    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(4 * (MAX_SESSIONS + MAX_QUEUE))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    sampling.clear()
    sampler.join()
    assert statuses == [200] * len(threads)
    assert peak[0] <= MAX_SESSIONS and server.settled_sessions() == 0


def test_clients_leaving_while_queued_at_any_moment_leave_nothing_behind(server):
    """Every session held (by socket clients), 200 HTTP clients send a generation and leave 0-2 ms later, FIN or
    RST, HTTP/1.1: the queue empties as they go, no place is lost, and once the sessions are let go a
    well-formed request is served at once."""
    import random
    import struct

    from daemon_helpers import raw_connect, read_frame

    from kestrel_stream.wire import protocol as wire
    holders = [raw_connect(str(server.socket_path)) for _ in range(MAX_SESSIONS)]
    for sock in holders:
        sock.sendall(wire.encode_frame({"op": "open", "id": 1}))
        assert read_frame(sock).header["ok"]
    rng = random.Random(4)
    for i in range(200):
        sock = server.connect_http()
        sock.sendall(http_request("POST", "/v1/completions", body(8, stream=i % 2 == 0)))
        time.sleep(rng.uniform(0, 0.002))
        if i % 2:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    wait_for(lambda: server.service.admission.queued == 0)
    assert server.service.held_sessions == MAX_SESSIONS and server.service.stats()["admission_left_while_queued"] > 0
    for sock in holders:
        sock.close()
    assert server.settled_sessions() == 0 and server.service.held_sessions == 0
    with server.connect_http() as sock:
        sock.sendall(http_request("POST", "/v1/completions", body(4)))
        status, answer = http_answer(sock)
    assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 4


def test_socket_clients_may_wait_for_a_session_and_their_generate_does(server):
    """new_session(wait=True) and Client.generate wait in the admission queue while every session is held (a
    plain open is refused at once, as before), and get one as soon as it is freed; a waiting socket client that
    leaves frees its place."""
    import kestrel_stream as ks
    from daemon_helpers import raw_connect, read_frame

    from kestrel_stream.wire import protocol as wire
    holders = [ks.Client(str(server.socket_path)) for _ in range(MAX_SESSIONS)]
    held = [c.new_session() for c in holders]
    results = {}

    def wait_for_one():
        with ks.Client(str(server.socket_path)) as client, client.new_session(wait=True) as s:
            results["session"] = s.prefill([1, 2], want="token")

    def generate():
        with ks.Client(str(server.socket_path)) as client:
            results["generated"] = client.generate([3, 4], 3, temperature=0.0).tokens
    try:
        with ks.Client(str(server.socket_path)) as client:
            with pytest.raises(ks.CapacityError, match="--max-sessions 2"):
                client.new_session()
        leaver = raw_connect(str(server.socket_path))
        leaver.sendall(wire.encode_frame({"op": "open", "id": 1, "wait": True}))
        wait_for(lambda: server.service.admission.queued == 1)
        leaver.close()
        wait_for(lambda: server.service.admission.queued == 0)
        threads = [threading.Thread(target=wait_for_one), threading.Thread(target=generate)]
        for t in threads:
            t.start()
        wait_for(lambda: server.service.admission.queued == 2)
        held[0].close()
        held[1].close()
        for t in threads:
            t.join(30)
        assert set(results) == {"session", "generated"} and len(results["generated"]) == 3
        with raw_connect(str(server.socket_path)) as sock:
            sock.sendall(wire.encode_frame({"op": "open", "id": 1, "wait": "yes"}))
            reply = read_frame(sock).header
        assert not reply["ok"] and "'wait' must be true or false" in reply["message"]
    finally:
        for c in holders:
            c.close()
    assert server.settled_sessions() == 0 and server.service.stats()["admission_left_while_queued"] == 1


def test_sigterm_answers_queued_generations_at_once_and_the_daemon_stops(model, tmp_path):
    import signal

    from http_helpers import HttpDaemon
    d = HttpDaemon(model, tmp_path, "--served-model-name", MODEL_NAME, "--max-sessions", "1", "--no-access-log")
    port = int(d.base_url.removesuffix("/v1").rsplit(":", 1)[1])
    try:
        import socket as sockets
        holder = sockets.create_connection(("127.0.0.1", port), timeout=30)
        holder.sendall(http_request("POST", "/v1/completions", body(1500, stream=True)))
        data = b""
        while b"data: {" not in data:
            data += holder.recv(65536)
        queued = sockets.create_connection(("127.0.0.1", port), timeout=30)
        queued.sendall(http_request("POST", "/v1/completions", body(8)))
        # in the queue behind the stream (polled: a fixed sleep let the stream finish first on a fast machine)
        wait_for(lambda: metric(httpx.get(d.base_url.removesuffix("/v1") + "/metrics", timeout=10).text,
                                "kestrel_admission_queue_depth") == 1, timeout_s=10)
        started = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        status, answer = http_answer(queued)
        assert status == 503 and json.loads(answer)["error"]["code"] == "shutting_down", answer
        assert time.monotonic() - started < 3.0
        assert d.proc.wait(20) == 0
        holder.close()
        queued.close()
    finally:
        d.stop()
    assert "Traceback" not in d.log_path.read_text()
