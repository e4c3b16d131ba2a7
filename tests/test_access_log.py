"""One access-log line per HTTP request on stderr (method, path, status, prompt and completion tokens, queue wait,
time to first token, duration); serve --no-access-log silences them."""
from __future__ import annotations

import re
import time

import pytest
from http_helpers import HttpDaemon, chat_model

httpx = pytest.importorskip("httpx")

LINE = re.compile(r'^kestrel-stream serve: 127\.0\.0\.1:\d+ "(\w+) (\S+)" (\d{3})(.*) time=(\d+\.\d{3})s$', re.MULTILINE)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("access-model") / "model")


def lines_of(d, count: int, timeout_s: float = 10.0) -> list[tuple]:
    deadline = time.monotonic() + timeout_s
    while len(found := LINE.findall(d.log_path.read_text())) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


def test_each_request_logs_one_line_with_its_tokens_and_times(model, tmp_path):
    d = HttpDaemon(model, tmp_path, "--served-model-name", "m")
    try:
        with httpx.Client(timeout=60) as http:
            base = d.base_url.removesuffix("/v1")
            assert http.post(d.base_url + "/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 5,
                                                                "temperature": 0}).status_code == 200
            assert http.get(base + "/health").status_code == 200
            assert http.get(base + "/nowhere").status_code == 404
            assert http.post(d.base_url + "/completions", json={"model": "m", "prompt": "x",
                                                                "top_p": 7}).status_code == 400
        found = lines_of(d, 4)
    finally:
        assert d.stop() == 0
    assert [(m, p, s) for m, p, s, _, _ in found] == [("POST", "/v1/completions", "200"), ("GET", "/health", "200"),
                                                      ("GET", "/nowhere", "404"), ("POST", "/v1/completions", "400")]
    generation = found[0][3]
    assert re.fullmatch(r" prompt=5 completion=5 queue=\d+\.\d{3}s ttft=\d+\.\d{3}s", generation), generation
    assert found[1][3] == "" and found[2][3] == ""


def test_no_access_log_silences_them(model, tmp_path):
    d = HttpDaemon(model, tmp_path, "--served-model-name", "m", "--no-access-log")
    try:
        with httpx.Client(timeout=60) as http:
            assert http.get(d.base_url.removesuffix("/v1") + "/health").status_code == 200
            assert http.post(d.base_url + "/completions", json={"model": "m", "prompt": "Hello",
                                                                "max_tokens": 2}).status_code == 200
    finally:
        assert d.stop() == 0
    assert LINE.findall(d.log_path.read_text()) == []
