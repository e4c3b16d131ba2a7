"""What the HTTP API lets a client hold, and what a web page can make a browser do with it: generation slots are
taken only by whole, valid bodies; headers have a deadline; a refused HTTP/2 stream leaves its connection serving;
without a key only requests naming this server are answered; methods are taken as sent (case-sensitive); POST
bodies are JSON; no Location is built from the Host header; CORS is off unless configured."""
from __future__ import annotations

import json
import logging
import os
import time

import pytest
from http_helpers import chat_model
from inprocess_daemon import MODEL_NAME, H2Client, InProcessDaemon, http_answer, http_request

KEY = "limits-key"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("limits-model") / "model")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    d = InProcessDaemon(model, tmp_path_factory.mktemp("limits"), max_sessions=8, max_requests=2,
                        header_timeout_s=0.5, allowed_hosts=("myhost.local",))
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


def test_incomplete_headers_are_cut_off_at_the_header_timeout(server):
    with server.connect_http() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        started = time.monotonic()
        sock.settimeout(10)
        assert sock.recv(100) == b""            # closed, without an answer
        assert time.monotonic() - started < 5


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


@pytest.mark.parametrize("host, status", [("attacker.example", 421), ("attacker.example:8080", 421),
                                          ("localhost", 200), ("127.0.0.1:9", 200), ("[::1]:80", 200),
                                          ("myhost.local", 200), ("LOCALHOST.", 200), ("127.0.0.1.evil.example", 421)])
def test_without_a_key_only_requests_naming_this_server_are_answered(server, host, status):
    for request in (http_request("GET", "/v1/models", host=host),
                    http_request("POST", "/v1/completions", generation(), host=host)):
        got, _, body = ask(server, request)
        assert got == status, body
        if status == 421:
            assert json.loads(body)["error"]["code"] == "misdirected_request"


@pytest.mark.parametrize("method, path", [("get", "/health"), ("Get", "/v1/models"), ("post", "/v1/completions"),
                                          ("Post", "/v1/chat/completions")])
def test_methods_are_case_sensitive_on_http1_and_http2(server, method, path):
    """hypercorn upper-cases methods before the app sees them; the method as sent is what is checked, and a header
    a client sends to pass for it is dropped."""
    chat = json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    body = {"/v1/completions": generation(), "/v1/chat/completions": chat}.get(path, b"")
    got, _, answer = ask(server, http_request(method, path, body, extra=b"Kestrel-Method-As-Sent: " +
                                              method.upper().encode() + b"\r\n"))
    assert got == 501 and json.loads(answer)["error"]["code"] == "method_not_implemented", answer
    assert f"{method!r}" in json.loads(answer)["error"]["message"]
    client = H2Client(server.http_port)
    try:
        assert client.status(client.post(path, body, method=method)) == 501
        assert client.status(client.post(path, body, method=method.upper())) == 200 and not client.closed
    finally:
        client.close()


@pytest.mark.parametrize("content_type, status", [("text/plain", 415), ("application/x-www-form-urlencoded", 415),
                                                  ("multipart/form-data; boundary=x", 415), ("", 415),
                                                  ("application/json; charset=utf-8", 200),
                                                  ("Application/JSON", 200)])
def test_post_bodies_must_be_json(server, content_type, status):
    got, _, body = ask(server, http_request("POST", "/v1/completions", generation(), content_type=content_type))
    assert got == status, body
    if status == 415:
        assert json.loads(body)["error"]["code"] == "unsupported_media_type"


def test_other_routes_take_no_body(server):
    got, _, body = ask(server, http_request("GET", "/v1/models", b"{}"))
    assert got == 413 and "takes no request body" in json.loads(body)["error"]["message"]


def test_no_redirect_takes_its_location_from_the_host_header(model, tmp_path):
    d = InProcessDaemon(model, tmp_path, api_key=KEY)
    try:
        auth = f"Authorization: Bearer {KEY}\r\n".encode()
        got, head, _ = ask(d, http_request("GET", "/v1/models/", host="attacker.example", extra=auth))
        assert got == 404 and b"location:" not in head
        got, _, _ = ask(d, http_request("GET", "/v1/models", host="any.name", extra=auth))
        assert got == 200                       # with a key the Host header is not checked
    finally:
        d.stop()


def preflight(origin: str) -> bytes:
    return (f"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: {origin}\r\n"
            f"Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: content-type\r\n"
            f"Content-Length: 0\r\n\r\n").encode()


def test_cors_is_off_unless_an_origin_is_configured(server, model, tmp_path):
    got, head, _ = ask(server, preflight("http://localhost:3000"))
    assert got == 405 and b"access-control-allow-origin" not in head
    d = InProcessDaemon(model, tmp_path, cors_origins=("http://localhost:3000",))
    try:
        got, head, _ = ask(d, preflight("http://localhost:3000"))
        assert got == 200 and b"access-control-allow-origin: http://localhost:3000" in head
        got, head, _ = ask(d, preflight("http://attacker.example"))
        assert b"access-control-allow-origin" not in head
    finally:
        d.stop()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_connections_a_client_closed_give_their_descriptor_back_at_once(model, tmp_path):
    """1,000 quick connections (answered, or closed before a request) hold no descriptor a second later, well
    before the 5 s keep-alive timer that used to keep them."""
    d = InProcessDaemon(model, tmp_path)
    try:
        baseline = open_fds()
        for i in range(1000):
            with d.connect_http() as sock:
                if i % 2 == 0:
                    sock.sendall(http_request("GET", "/health"))
                    assert http_answer(sock)[0] == 200
        deadline = time.monotonic() + 1.0
        while (held := open_fds() - baseline) > 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert held <= 2, f"{held} descriptors still held 1 s after their clients closed"
    finally:
        d.stop()
