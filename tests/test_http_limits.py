"""What the HTTP API lets a client hold: generation slots are taken only by whole, valid bodies; a refused HTTP/2
stream leaves its connection serving."""
from __future__ import annotations

import json
import logging
import time

import pytest
from http_helpers import chat_model
from inprocess_daemon import MODEL_NAME, H2Client, InProcessDaemon, http_answer, http_request

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("limits-model") / "model")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    d = InProcessDaemon(model, tmp_path_factory.mktemp("limits"), max_sessions=8, max_requests=2)
    yield d
    d.stop()


def generation(max_tokens: int = 4) -> bytes:
    return json.dumps({"model": MODEL_NAME, "prompt": "limits", "max_tokens": max_tokens, "temperature": 0}).encode()


def ask(server, request: bytes) -> tuple[int, bytes, bytes]:
    """(status, headers, body) of one request on a connection of its own."""
    with server.connect_http() as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            part = sock.recv(65536)
            assert part, f"closed after {data!r}"
            data += part
        head, _, _ = data.partition(b"\r\n\r\n")
    with server.connect_http() as sock:         # the same request again, read by http_answer for its body
        sock.sendall(request)
        status, body = http_answer(sock)
    return status, head.lower(), body


def test_bodies_still_arriving_hold_no_generation_slot(server):
    """Eight requests announce 1,000 bytes and send 10 (--http-max-requests 2): a well-formed generation is still
    answered, and the slow ones get 408 once their body timeout passes."""
    slow = [server.connect_http() for _ in range(8)]
    try:
        for sock in slow:
            sock.sendall(http_request("POST", "/v1/completions", b"", extra=b"")
                         .replace(b"Content-Length: 0", b"Content-Length: 1000") + b'{"model": ')
        time.sleep(0.3)
        status, _, body = ask(server, http_request("POST", "/v1/completions", generation()))
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] == 4
    finally:
        for sock in slow:
            sock.close()


def test_a_refused_http2_stream_leaves_its_connection_serving(server, caplog):
    """An answer given before its request's body arrived (a wrong method here) used to make hypercorn close the
    whole HTTP/2 connection with a KeyError traceback when the rest of the body came."""
    client = H2Client(server.http_port)
    try:
        with caplog.at_level(logging.ERROR):
            refused = client.post("/v1/models", b"x" * 300_000)
            assert client.status(refused) == 405
            answered = client.post("/v1/completions", generation())
            assert client.status(answered) == 200 and not client.closed
        assert "KeyError" not in caplog.text and "Traceback" not in caplog.text
    finally:
        client.close()
