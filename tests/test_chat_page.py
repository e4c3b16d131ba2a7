"""serve --http's chat page at /, in a real headless chromium: the key, a streamed answer with its tokens/s, Stop.
The screenshot of the conversation goes to bench/results/chat-page.png."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cdp_pipe import CHROMIUM, Browser
from daemon_helpers import ENV
from http_helpers import HttpDaemon, chat_model

KEY = "page-test-key"
SCREENSHOT = Path(__file__).resolve().parents[1] / "bench" / "results" / "chat-page.png"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    where = tmp_path_factory.mktemp("page")
    daemon = HttpDaemon(chat_model(where / "model"), where, "--device", "cpu", env=dict(ENV, KESTREL_API_KEY=KEY))
    yield daemon, daemon.base_url.removesuffix("/v1")
    assert daemon.stop() == 0, daemon.log_path.read_text()


def get(url: str, key: str | None = None):
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def test_the_page_is_one_self_contained_file_served_without_the_key(server):
    _, root = server
    status, headers, page = get(root + "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in headers["content-security-policy"]
    assert "http://" not in page and "https://" not in page and "<script src" not in page      # nothing fetched
    assert get(root + "/v1/models")[0] == 401                                                   # the API keeps its key
    assert get(root + "/elsewhere")[0] == 401


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (CI installs it with apt-get)")
def test_send_see_the_answer_stream_and_stop_it(server, tmp_path):
    daemon, root = server
    model_name = json.loads(get(root + "/v1/models", KEY)[2])["data"][0]["id"]
    browser = Browser(tmp_path / "profile")
    try:
        browser.open(root + "/")
        assert "API key" in browser.wait_for("document.getElementById('model').textContent.includes('API key') "
                                             "&& document.getElementById('model').textContent")
        browser.eval(f"const k = document.getElementById('key'); k.value = {KEY!r}; "
                     f"k.dispatchEvent(new Event('change'))")
        browser.wait_for(f"document.getElementById('model').textContent === {model_name!r}")

        def send(text: str, max_tokens: str = "") -> None:
            browser.eval(f"document.getElementById('max').value = {max_tokens!r}; "
                         f"document.getElementById('input').value = {text!r}; document.getElementById('send').click()")

        send("Hello there", "40")
        browser.wait_for("document.body.dataset.state === 'idle' && document.getElementById('stats').dataset.tokens "
                         "=== '40'")
        stats = browser.eval("document.getElementById('stats').textContent")
        assert stats.startswith("40 tokens · ") and " tok/s" in stats and "length" in stats, stats
        rate = float(stats.split(" · ")[1].split()[0])
        assert rate > 0
        answers = browser.eval("[...document.querySelectorAll('.assistant')].map(a => a.textContent)")
        assert len(answers) == 1 and answers[0]

        send("Now a long one")                          # no max tokens: to the end of the context, unless stopped
        seen = browser.wait_for("document.body.dataset.state === 'streaming' && "
                                "Number(document.getElementById('stats').dataset.tokens) >= 8 && "
                                "document.getElementById('stats').dataset.tokens")
        browser.eval("document.getElementById('stop').click()")
        browser.wait_for("document.body.dataset.state === 'idle'")
        stats = browser.eval("document.getElementById('stats').textContent")
        tokens = int(browser.eval("document.getElementById('stats').dataset.tokens"))
        assert stats.endswith("stopped") and int(seen) <= tokens < 1500, stats
        assert browser.eval("document.querySelectorAll('.error').length") == 0
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        SCREENSHOT.write_bytes(browser.screenshot())

        send("And after the stop?", "5")                # the conversation goes on
        browser.wait_for("document.body.dataset.state === 'idle' && document.getElementById('stats').dataset.tokens "
                         "=== '5'")
        assert browser.eval("document.querySelectorAll('.assistant').length") == 3
    finally:
        browser.close()
    from test_timeline import read_png_rgb
    pixels = read_png_rgb(SCREENSHOT.read_bytes())
    assert pixels.shape[0] > 400 and len({tuple(c) for c in pixels.reshape(-1, 3)[::5].tolist()}) > 20
