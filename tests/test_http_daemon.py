"""serve --http beside the socket: the same batcher and engine for both transports, texts as Engine.generate
gives them, the start-up checks of --http and the key, the concurrency limit, and a shutdown mid-stream."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from daemon_helpers import ENV
from http_helpers import HttpDaemon, chat_model, metric

import kestrel_stream as ks
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")   # the test extra; absent on a bare GPU machine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("http-model") / "model")


def test_texts_equal_engine_generate_and_socket_clients_share_steps(model, tmp_path):
    """Greedy and seeded sampled texts equal Engine.generate in process; a socket client's greedy tokens
    decoded at the same time as HTTP streams run in the same steps (mean batch > 1) and equal its solo run."""
    engine = ks.load(str(model), device="cpu")
    messages = [{"role": "user", "content": "same text"}]
    greedy = engine.generate(messages, max_new_tokens=20).text
    sampled = engine.generate("sampled", max_new_tokens=20, temperature=0.8, top_k=0, top_p=0.9, min_p=0.0,
                              seed=11).text
    engine.close()
    d = HttpDaemon(model, tmp_path, "--served-model-name", "m")
    try:
        client = openai.OpenAI(base_url=d.base_url, api_key="unused", max_retries=0)
        got = client.chat.completions.create(model="m", messages=messages, max_tokens=20, temperature=0)
        assert got.choices[0].message.content == greedy
        got = client.completions.create(model="m", prompt="sampled", max_tokens=20, temperature=0.8, top_p=0.9,
                                        seed=11)
        assert got.choices[0].text == sampled
        prompt = list(range(40, 90))
        with ks.Client(d.address) as sock, sock.new_session() as s:
            alone = s.generate(prompt, 30)
        results, errors = {}, []

        def stream(i: int) -> None:
            try:
                chunks = client.completions.create(model="m", prompt=f"stream {i}", max_tokens=60, temperature=0,
                                                   stream=True)
                results[i] = "".join(c.choices[0].text for c in chunks)
            except Exception as e:          # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        with ks.Client(d.address) as sock, sock.new_session() as s:
            together = s.generate(prompt, 30)
        for t in threads:
            t.join()
        assert not errors and len(results) == 6 and together == alone
        stats = httpx.get(d.base_url.removesuffix("/v1") + "/metrics").text
        assert metric(stats, "kestrel_mean_batch") > 1.0
    finally:
        assert d.stop() == 0


def run_serve(model, *flags, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kestrel_stream", "serve", "--model", str(model), "--device", "cpu",
                           *flags], capture_output=True, text=True, timeout=60, env=env or ENV)


def test_non_loopback_bind_needs_a_key_and_bad_flags_fail_before_loading(model, tmp_path):
    proc = run_serve(model, "--socket", str(tmp_path / "s"), "--http", "0.0.0.0:0")
    assert proc.returncode != 0 and "needs an API key" in proc.stderr and "model " not in proc.stderr
    proc = run_serve(model, "--socket", str(tmp_path / "s"), "--http", "localhost")
    assert proc.returncode != 0 and "expected HOST:PORT" in proc.stderr
    key_file = tmp_path / "key"
    key_file.write_text("k\n")
    key_file.chmod(0o644)
    proc = run_serve(model, "--socket", str(tmp_path / "s"), "--http", "127.0.0.1:0", "--api-key-file", str(key_file))
    assert proc.returncode != 0 and "mode 0600" in proc.stderr


def test_key_file_concurrency_limit_and_shutdown_mid_stream(model, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("file-key\n")
    key_file.chmod(0o600)
    d = HttpDaemon(model, tmp_path, "--served-model-name", "m", "--api-key-file", str(key_file),
                   "--http-max-requests", "1")
    headers = {"Authorization": "Bearer file-key"}
    body = {"model": "m", "prompt": "long", "max_tokens": 400, "temperature": 0, "stream": True}
    try:
        with httpx.Client(timeout=30, headers=headers) as http:
            with http.stream("POST", d.base_url + "/completions", json=body) as first:
                lines = first.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))
                second = http.post(d.base_url + "/completions", json={**body, "stream": False})
                assert second.status_code == 429 and second.json()["error"]["code"] == "too_many_requests"
                assert second.headers["Retry-After"] == "1"
                d.proc.send_signal(signal.SIGTERM)          # shutdown while the stream runs
                rest = list(lines)
            assert "data: [DONE]" in rest          # the running stream ended whole
        assert d.proc.wait(20) == 0
        log = d.log_path.read_text()
        assert "stopped" in log and "Traceback" not in log
    finally:
        d.stop()


def trickle(host: str, port: int) -> socket.socket:
    """A request whose headers arrived and whose body never ends."""
    slow = socket.create_connection((host, port), timeout=30)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"model\": ")
    return slow


def answered(sock: socket.socket) -> bool:
    """The daemon has written to (or closed) the socket; nothing is read."""
    try:
        sock.setblocking(False)
        sock.recv(1, socket.MSG_PEEK)
        return True
    except BlockingIOError:
        return False
    finally:
        sock.settimeout(30)


def test_requests_at_once_are_capped_and_a_trickling_body_times_out(model, tmp_path):
    """--http-max-concurrent 1: a request whose body has not all arrived holds the one place, so another path
    gets 503 with Retry-After (/health still answers); --http-body-timeout-s ends the trickle with 408."""
    d = HttpDaemon(model, tmp_path, "--served-model-name", "m", "--http-max-concurrent", "1",
                   "--http-body-timeout-s", "2")
    base = d.base_url.removesuffix("/v1")
    host, port = base.removeprefix("http://").rsplit(":", 1)
    try:
        with httpx.Client(timeout=30) as http:
            deadline, trickles, busy = time.monotonic() + 60, 0, None
            while busy is None:             # on a loaded machine a trickle may time out before a poll sees it
                assert time.monotonic() < deadline, "no trickling request was seen holding its place"
                slow, trickles = trickle(host, int(port)), trickles + 1
                while busy is None and not answered(slow):
                    polled = http.get(d.base_url + "/models")
                    busy = polled if polled.status_code == 503 else None
                if busy is None:
                    slow.close()
            assert busy.headers["Retry-After"] == "1" and "--http-max-concurrent 1" in busy.text
            assert busy.json()["error"]["code"] == "server_overloaded"
            assert http.get(base + "/health").json() == {"status": "ok"}
            answer = b""
            while b"request_timeout" not in answer and (part := slow.recv(4096)):
                answer += part
            slow.close()
            assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
            deadline = time.monotonic() + 30
            while http.get(d.base_url + "/models").status_code != 200:
                assert time.monotonic() < deadline, "the place stayed taken after the 408"
                time.sleep(0.02)
            text = http.get(base + "/metrics").text
        assert f'kestrel_http_requests_total{{path="/v1/completions",status="408"}} {trickles}.0' in text
    finally:
        assert d.stop() == 0


def test_a_port_in_use_is_one_line_before_the_model_loads(model, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for flags in (("--socket", str(tmp_path / "s"), "--http", f"127.0.0.1:{port}"), ("--tcp", f"127.0.0.1:{port}")):
            proc = run_serve(model, *flags)
            assert proc.returncode == 1, proc.stderr
            assert proc.stderr.splitlines() == [f"kestrel-stream: error: {flags[-2]} 127.0.0.1:{port}: the address is "
                                                f"in use by another process; stop it or choose another port"]
