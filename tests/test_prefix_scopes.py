"""Tenants kept apart in the prefix cache: a request's cache_salt reuses only prefixes cached by requests with the
same salt, --prefix-cache-scope key keeps HTTP requests' prefixes apart from the socket clients', the scopes stay
within the cache's budget, and the texts are those of a run without any cache."""
from __future__ import annotations

import json

import pytest
from http_helpers import chat_model
from inprocess_daemon import MODEL_NAME, InProcessDaemon, http_answer, http_request

import kestrel_stream as ks
from kestrel_stream.serve.prefix_scopes import MAX_SCOPES

SYSTEM = "You are a careful assistant of the ACME company; its secret launch code is 7-4-1. " * 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("scopes-model") / "model")


@pytest.fixture
def server(model, tmp_path):
    d = InProcessDaemon(model, tmp_path)
    yield d
    d.stop()


def chat(server, question: str, **fields) -> tuple[int, dict]:
    body = json.dumps({"model": MODEL_NAME, "max_tokens": 6, "temperature": 0, **fields,
                       "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})
    with server.connect_http() as sock:
        sock.sendall(http_request("POST", "/v1/chat/completions", body.encode()))
        status, answer = http_answer(sock)
    return status, json.loads(answer)


def complete(server, prompt: str) -> tuple[int, dict]:
    body = json.dumps({"model": MODEL_NAME, "max_tokens": 2, "temperature": 0, "prompt": prompt})
    with server.connect_http() as sock:
        sock.sendall(http_request("POST", "/v1/completions", body.encode()))
        status, answer = http_answer(sock)
    return status, json.loads(answer)


def reused_by(server, question: str, **fields) -> tuple[int, str]:
    """(prompt positions taken from the prefix cache, text) of one request."""
    before = server.service.stats()["prefix_cache"]["prefix_reused_tokens"]
    status, answer = chat(server, question, **fields)
    assert status == 200, answer
    return (server.service.stats()["prefix_cache"]["prefix_reused_tokens"] - before,
            answer["choices"][0]["message"]["content"])


def test_a_cache_salt_reuses_only_its_own_prefixes(server):
    shared, text = reused_by(server, "one?")
    assert shared == 0
    assert reused_by(server, "two?")[0] > 0                         # shared: the system turn is reused
    salted, salted_text = reused_by(server, "one?", cache_salt="tenant-a")
    assert salted == 0 and salted_text == text                       # nothing of the shared cache, same text
    assert reused_by(server, "two?", cache_salt="tenant-a")[0] > 0  # its own prefix, cached by the request before
    assert reused_by(server, "three?", cache_salt="tenant-b")[0] == 0


def test_scope_key_keeps_http_requests_apart_from_socket_clients(model, tmp_path):
    d = InProcessDaemon(model, tmp_path, prefix_scope="key")
    try:
        prompt = f"<system>{SYSTEM}\n<user>one?\n<assistant>"
        with ks.Client(str(d.socket_path)) as client:
            client.generate(prompt, 4)
            assert client.generate(prompt, 4) and client.stats()["prefix_cache"]["prefix_hits"] == 1
        assert reused_by(d, "one?")[0] == 0                 # the socket client's prompt is not the API's to reuse
        assert reused_by(d, "two?")[0] > 0                  # the API's own is
    finally:
        d.stop()


def test_many_salts_stay_within_the_budget_and_the_scope_count(server):
    budget = server.service.stats()["prefix_cache"]["budget_positions"]
    for i in range(MAX_SCOPES + 4):
        assert reused_by(server, "q?", cache_salt=f"salt {i}")[0] == 0
    stats = server.service.stats()["prefix_cache"]
    assert stats["scopes"] == MAX_SCOPES and stats["cached_positions"] <= budget


@pytest.mark.parametrize("salt", [3, "", "x" * 257, ["a"]])
def test_a_bad_cache_salt_is_400_naming_it(server, salt):
    status, answer = chat(server, "q?", cache_salt=salt)
    assert status == 400 and answer["error"]["param"] == "cache_salt"


def test_the_first_token_does_not_wait_for_the_prompt_to_be_cached(server):
    """The prompt's blocks are cached on the step thread after its prefill, queued but not awaited: a streamed
    answer's first chunk arrives while that store is still held up, and the request ends once it is let go
    (its later steps queue behind it), with its prefix cached for the next request."""
    import threading
    scopes = server.service.replicas.all[0].prefix_scopes
    held, release, store = threading.Event(), threading.Event(), scopes.store

    def slow_store(*args):
        held.set()
        assert release.wait(10), "the test never let the store go"
        return store(*args)

    scopes.store = slow_store
    try:
        # a completion's first event is its first token (a chat's would be the role alone)
        body = json.dumps({"model": MODEL_NAME, "max_tokens": 4, "temperature": 0, "stream": True,
                           "prompt": SYSTEM + "one?"})
        with server.connect_http() as sock:
            sock.sendall(http_request("POST", "/v1/completions", body.encode()))
            data = b""
            while b"data: {" not in data:            # the first token, before the store can have finished
                part = sock.recv(65536)
                assert part, data
                data += part
            release.set()
            while b"data: [DONE]" not in data:
                part = sock.recv(65536)
                assert part, data
                data += part
    finally:
        release.set()
        scopes.store = store
    assert held.is_set(), "the store ran"
    before = server.service.stats()["prefix_cache"]["prefix_reused_tokens"]
    status, answer = complete(server, SYSTEM + "two?")
    assert status == 200, answer
    assert server.service.stats()["prefix_cache"]["prefix_reused_tokens"] > before, "the held store cached it"


def test_a_one_choice_request_visits_the_step_thread_once_before_its_prompt_runs(server):
    """Its session is made, the prompt's cached prefix adopted and the rest of the prompt queued in one call on the
    step thread, run ahead of the steps ready there (any other call waits for those): nothing else goes there
    before its first token, after which its prompt is cached, ahead too (it holds back no request's open); a
    request of two choices makes its sessions first and adopts and queues per choice, after the first choice's
    prompt is cached; its sessions close ahead of the steps too."""
    replica = server.service.replicas.all[0]
    steps, log = replica.steps, []
    run_ahead, queue_ahead, queue_call, submit = steps.run_ahead, steps.queue_ahead, steps.queue_call, steps.submit

    def name(fn) -> str:
        return getattr(fn, "__name__", repr(fn))

    async def logged_ahead(fn, *args):
        log.append(f"ahead {name(fn)}")
        return await queue_ahead(fn, *args)

    def logged_queue_ahead(fn, *args):
        log.append(f"ahead {name(fn)}")
        return queue_ahead(fn, *args)

    def logged_call(fn, *args):
        log.append(name(fn))
        return queue_call(fn, *args)

    def logged_submit(job, at_once=False):
        log.append(type(job).__name__)
        return submit(job, at_once)

    steps.run_ahead, steps.queue_ahead, steps.queue_call, steps.submit = (logged_ahead, logged_queue_ahead, logged_call,
                                                                          logged_submit)
    try:
        assert reused_by(server, "one?")[0] == 0
        first = log[:log.index("ahead store")]
        log.clear()
        assert reused_by(server, "two?")[0] > 0           # the adopted prefix was used
        second = log[:log.index("ahead store")]
        log.clear()
        status, answer = chat(server, "three?", n=2)
        assert status == 200 and len(answer["choices"]) == 2, answer
    finally:
        steps.run_ahead, steps.queue_ahead, steps.queue_call, steps.submit = run_ahead, queue_ahead, queue_call, submit
    assert first == second == ["ahead open_prefilling"], (first, second)
    # two choices: each session opened, then each prompt adopted and queued, every visit ahead of the steps
    assert log.count("ahead new_session") == 2 and log.count("ahead queue_prompt") == 2, log
    assert "PrefillJob" not in log and "adopt" not in log, log
    assert "ahead close_sessions" in log and "close_sessions" not in log, log      # its end waits for no step
    assert "ahead store" in log and "store" not in log, log     # nor does caching its prompt


def test_a_failing_adopt_serves_the_request_without_the_cache_and_holds_nothing(server):
    """A bug in adopting a prefix (at the session's open, new_session_adopting) costs the request its cache, not
    its answer, and leaves no session behind."""
    scopes = server.service.replicas.all[0].prefix_scopes
    reused_by(server, "one?")                                  # the system turn cached
    want = reused_by(server, "two?")[1]
    adopt = scopes.adopt

    def broken(*args):
        raise RuntimeError("a bug in adopt")

    scopes.adopt = broken
    try:
        reused, text = reused_by(server, "two?")
    finally:
        scopes.adopt = adopt
    assert (reused, text) == (0, want)                          # served in full, the same text
    assert server.service.held_sessions == 0 and not server.engine.sessions, "the failed adopt's session closed"
