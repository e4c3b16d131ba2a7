"""The OpenAI-compatible HTTP API (serve --http) against a daemon started here, with the real openai client
(httpx for raw bodies): completions, chat, streaming, stop strings, max_tokens, logprobs, errors, a client
leaving mid-stream, and concurrent streams batched together that give the tokens of solo runs."""
from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time

import pytest
from http_helpers import CONTEXT, HttpDaemon, chat_model, metric

import kestrel_stream as ks
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")   # the test extra; absent on a bare GPU machine

KEY = "test-key-0123456789"
MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("http-model") / "model")


@pytest.fixture(scope="module")
def daemon(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("http")
    # numpy's arithmetic: a session's rows come out the same whatever else its step holds (within ~1e-6; the
    # native kernels' batched and single-row sums differ by ~1e-4, enough to turn a near tie of this random
    # model), so concurrent streams can be held to their solo texts
    d = HttpDaemon(model, tmp, "--served-model-name", MODEL, "--http-max-body-kb", "64",
                   env={**__import__("daemon_helpers").ENV, "KESTREL_API_KEY": KEY, "KESTREL_HOST_KERNELS": "numpy"})
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base_url, api_key=KEY, max_retries=0, timeout=30)


def raw(daemon, method: str, path: str, key: str | None = KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if method == "POST":
        headers["Content-Type"] = "application/json"
    return httpx.request(method, daemon.base_url.removesuffix("/v1") + path, headers=headers, timeout=30, **kwargs)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_models_and_health(daemon, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert raw(daemon, "GET", "/health", key=None).json() == {"status": "ok"}


def test_completion_greedy_max_tokens_and_usage(client):
    first = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=12, temperature=0)
    again = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=12, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "length" and choice.text == again.choices[0].text
    assert first.usage.prompt_tokens == len("Hello there".encode()) and first.usage.completion_tokens == 12
    assert first.usage.total_tokens == first.usage.prompt_tokens + 12
    short = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3


def test_completion_stream_equals_whole_answer(client):
    whole = client.completions.create(model=MODEL, prompt="Stream me", max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="Stream me", max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20


def test_chat_through_template_and_stream(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    prompt = "<system>be brief\n<user>hi\n<assistant>"
    assert whole.usage.prompt_tokens == len(prompt.encode())
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 16
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_end_with_stop(client):
    text = client.completions.create(model=MODEL, prompt="abc", max_tokens=40, temperature=0).choices[0].text
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    expected = text[:text.find(stop)]
    for stream in (False, True):
        got = client.completions.create(model=MODEL, prompt="abc", max_tokens=40, temperature=0,
                                        stop=["never-there", stop], stream=stream)
        choices = [c.choices[0] for c in got] if stream else [got.choices[0]]
        assert "".join(c.text for c in choices) == expected and choices[-1].finish_reason == "stop"


def test_sampling_with_a_seed_repeats(client):
    args = dict(model=MODEL, prompt="seeded", max_tokens=16, temperature=0.9, top_p=0.9, presence_penalty=0.5,
                frequency_penalty=0.5, extra_body={"top_k": 50, "min_p": 0.01})
    a = client.completions.create(seed=7, **args).choices[0].text
    assert a == client.completions.create(seed=7, **args).choices[0].text
    others = {client.completions.create(seed=s, **args).choices[0].text for s in (8, 9, 10)}
    assert others != {a}


def test_logprobs_completions_and_chat(client):
    done = client.completions.create(model=MODEL, prompt="lp", max_tokens=6, temperature=0, logprobs=3)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(p <= 0 and max(top.values()) == pytest.approx(p) for p, top in zip(lp.token_logprobs, lp.top_logprobs))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "lp"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=4)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 4 and tops == sorted(tops, reverse=True) and entry.logprob == pytest.approx(tops[0])
        assert sum(math.exp(t) for t in tops) <= 1.0 + 1e-9


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": 5}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": "x", "n": "2"}, "n"),
    ({"prompt": "x", "n": 65}, "n"),                  # more choices than --max-sessions (64)
    ({"prompt": "x", "logit_bias": {"300": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": [5]}, "logit_bias"),
    ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format"),
    ({"prompt": "x", "response_format": "json"}, "response_format"),
    ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": 3}}},
     "response_format.json_schema.schema"),
    ({"prompt": "x", "tools": [{"type": "function"}]}, "tools"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "logprobs": 9}, "logprobs"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": [999]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
])
def test_bad_parameters_are_400_naming_the_field(daemon, body, param):
    error = error_of(raw(daemon, "POST", "/v1/completions", json={"model": MODEL, **body}), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_bad_chat_bodies(daemon):
    for body, param in (({"messages": []}, "messages"), ({"messages": [{"role": "user", "content": 3}]},
                                                          "messages[0].content"),
                        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs")):
        assert error_of(raw(daemon, "POST", "/v1/chat/completions", json={"model": MODEL, **body}), 400)["param"] == param


def test_bad_json_unknown_model_too_long_and_too_large(daemon, client):
    assert error_of(raw(daemon, "POST", "/v1/completions", content=b"{not json"), 400)["code"] == "invalid_json"
    assert error_of(raw(daemon, "POST", "/v1/completions", content=b"[1, 2]"), 400)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="y" * CONTEXT, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="y" * (CONTEXT - 10), max_tokens=20)
    assert e.value.body["param"] == "max_tokens"
    big = json.dumps({"model": MODEL, "prompt": "z" * (70 << 10)}).encode()
    assert error_of(raw(daemon, "POST", "/v1/completions", content=big), 413)["code"] == "request_too_large"
    assert error_of(raw(daemon, "GET", "/v1/nowhere"), 404)
    assert error_of(raw(daemon, "GET", "/v1/completions"), 405)


def test_wrong_or_missing_key_is_401(daemon):
    wrong = openai.OpenAI(base_url=daemon.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert e.value.body["code"] == "invalid_api_key"
    assert error_of(raw(daemon, "POST", "/v1/completions", key=None, json={"model": MODEL, "prompt": "x"}),
                    401)["type"] == "authentication_error"
    assert error_of(raw(daemon, "GET", "/metrics", key=KEY[:-1]), 401)


def test_disconnect_mid_stream_frees_the_session(daemon):
    metrics = lambda: raw(daemon, "GET", "/metrics").text      # noqa: E731
    before = metric(metrics(), "kestrel_http_completion_tokens_total")
    body = {"model": MODEL, "prompt": "long", "max_tokens": CONTEXT - 10, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", daemon.base_url + "/completions", json=body,
                         headers={"Authorization": f"Bearer {KEY}"}) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            assert metric(metrics(), "kestrel_sessions") == 1
    deadline = time.monotonic() + 5
    while metric(metrics(), "kestrel_sessions") != 0:
        assert time.monotonic() < deadline, "the session stayed open after its client left"
        time.sleep(0.02)
    generated = metric(metrics(), "kestrel_http_completion_tokens_total") - before
    assert 0 < generated < CONTEXT - 10         # it stopped when the client left, not at max_tokens


def wait_for(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_client_leaving_before_a_whole_answer_cancels_it_and_others_run_on(daemon, client):
    """A non-streaming request's client closes its socket mid-generation: the generation stops there (not at
    max_tokens), its session is closed, the step thread goes idle, and a stream running beside is undisturbed."""
    beside_args = dict(model=MODEL, prompt="beside", max_tokens=300, temperature=0, extra_body={"ignore_eos": True})
    solo = client.completions.create(**beside_args).choices[0].text
    text = lambda: raw(daemon, "GET", "/metrics").text                   # noqa: E731
    before = metric(text(), "kestrel_http_completion_tokens_total")
    body = json.dumps({"model": MODEL, "prompt": "long", "max_tokens": CONTEXT - 10, "temperature": 0,
                       "ignore_eos": True}).encode()
    host, port = daemon.base_url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    beside, got = threading.Event(), {}

    def stream_beside() -> None:
        chunks = client.completions.create(stream=True, **beside_args)
        parts = []
        for chunk in chunks:
            parts.append(chunk.choices[0].text)
            beside.set()
        got["text"] = "".join(parts)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        wait_for(lambda: metric(text(), "kestrel_sessions") == 1, "the long generation did not start")
        thread = threading.Thread(target=stream_beside)
        thread.start()
        assert beside.wait(10)
    thread.join(30)
    assert got["text"] == solo
    with ks.Client(daemon.address) as sock_client:
        wait_for(lambda: sock_client.stats()["sessions"] == 0, "the departed client's session stayed open")
        steps = sock_client.stats()["steps"]
        time.sleep(0.2)
        stats = sock_client.stats()
        assert stats["steps"] == steps and stats["queue_depth"] == 0, "the step thread kept stepping for nobody"
    generated = metric(text(), "kestrel_http_completion_tokens_total") - before - beside_args["max_tokens"]
    assert 0 < generated < CONTEXT - 10             # it stopped when its client left, not at max_tokens
    assert 'kestrel_http_requests_total{path="/v1/completions",status="499"} 1.0' in text()


def test_concurrent_streaming_chats_equal_solo_runs(daemon):
    """32 streams at once, batched together (mean batch > 1), each text the same as its chat alone."""
    chats = [[{"role": "user", "content": f"question {i} " + "x" * (i % 7)}] for i in range(32)]

    async def one(client, messages) -> str:
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                                      temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main():
        async with openai.AsyncOpenAI(base_url=daemon.base_url, api_key=KEY, max_retries=0, timeout=60) as client:
            solo = [await one(client, m) for m in chats]
            batches_before = metric(raw(daemon, "GET", "/metrics").text, "kestrel_mean_batch")
            together = await asyncio.gather(*(one(client, m) for m in chats))
            return solo, together, batches_before
    solo, together, mean_before = asyncio.run(main())
    assert together == solo and len(set(solo)) > 1
    assert metric(raw(daemon, "GET", "/metrics").text, "kestrel_mean_batch") > mean_before


def test_chats_sharing_a_system_prompt_reuse_its_kv_and_keep_their_texts(daemon, client, model, monkeypatch):
    """The second chat's prompt starts with the first's system turn: its blocks come from the prefix cache
    (counted in the socket clients' stats; /metrics publishes them a minute at a time) and its text is still the
    one Engine.generate gives it alone."""
    system = {"role": "system", "content": "Answer in one short sentence, and never repeat yourself. " * 4}
    chats = [[system, {"role": "user", "content": question}] for question in ("first?", "second?")]
    monkeypatch.setenv("KESTREL_HOST_KERNELS", "numpy")         # as the daemon's
    engine = ks.load(str(model), device="cpu")
    alone = [engine.generate(messages, max_new_tokens=12).text for messages in chats]
    engine.close()
    with ks.Client(daemon.address) as sock:
        before = sock.stats()["prefix_cache"]
        answers = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
                   for messages in chats]
        after = sock.stats()["prefix_cache"]
    assert [a.choices[0].message.content for a in answers] == alone
    assert after["prefix_hits"] == before["prefix_hits"] + 1
    reused = after["prefix_reused_tokens"] - before["prefix_reused_tokens"]
    assert reused >= len(system["content"]) - 32     # the system turn, whole blocks of it (byte tokens)
    # usage says it as the OpenAI API does
    assert answers[0].usage.prompt_tokens_details.cached_tokens == 0
    assert answers[1].usage.prompt_tokens_details.cached_tokens == reused


def test_metrics_count_requests_and_tokens(daemon, client):
    client.completions.create(model=MODEL, prompt="count", max_tokens=4, temperature=0)
    text = raw(daemon, "GET", "/metrics").text
    assert 'kestrel_http_requests_total{path="/v1/completions",status="200"}' in text
    assert metric(text, "kestrel_http_completion_tokens_total") >= 4
    assert metric(text, "kestrel_http_time_to_first_token_seconds_count") >= 1
    for name in ("kestrel_steps_total", "kestrel_decode_step_seconds_total", "kestrel_queue_depth",
                 "kestrel_kv_positions_used"):
        metric(text, name)
