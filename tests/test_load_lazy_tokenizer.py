"""ks.load leaves the tokenizer unbuilt: engine.tokenizer builds it on first use, once, from any thread;
an error building it surfaces there, with the model named; servers build it in the background."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import anyio
import numpy as np
import pytest
from gguf_export import export_gguf

import kestrel_stream as ks
from kestrel_stream.loading.presets import PRESETS
from bench.synthetic import random_q8_weights
from kestrel_stream.obs import load_stages
from kestrel_stream.text import tokenizer as tokenizer_module
from kestrel_stream.text.lazy_tokenizer import STAGE
from kestrel_stream.text.tokenizer import TokenizerError


@pytest.fixture(scope="module")
def gguf_with_tokenizer(tmp_path_factory):
    return export_gguf(random_q8_weights(PRESETS["tiny"], seed=0), tmp_path_factory.mktemp("tok") / "tiny.gguf",
                       byte_tokenizer=True)


@pytest.fixture
def builds(monkeypatch):
    """Every call of the tokenizer's builder, recorded (and slowed, so that threads overlap in it)."""
    calls = []
    real = tokenizer_module.load_tokenizer

    def counted(path):
        calls.append(threading.current_thread().name)
        time.sleep(0.2)
        return real(path)
    monkeypatch.setattr(tokenizer_module, "load_tokenizer", counted)
    return calls


def test_a_load_does_not_build_the_tokenizer_and_the_first_use_does(gguf_with_tokenizer, builds):
    load_stages.reset()
    engine = ks.load(gguf_with_tokenizer, device="cpu", max_seq_len=32)
    assert builds == [] and not engine.tokenizer_built and STAGE not in load_stages.snapshot()
    with engine.new_session() as s:                    # token ids need no tokenizer
        s.prefill([1, 2, 3])
    assert builds == []
    assert engine.tokenizer.decode(engine.tokenizer.encode("Hi there")) == "Hi there"
    assert builds == [threading.current_thread().name] and engine.tokenizer_built
    assert load_stages.snapshot()[STAGE]["count"] == 1      # the stage table still shows what it cost
    engine.close()


def test_a_load_in_a_fresh_process_imports_no_tokenizer_code(gguf_with_tokenizer):
    code = ("import sys, kestrel_stream as ks\n"
            f"e = ks.load({str(gguf_with_tokenizer)!r}, device='cpu', max_seq_len=32)\n"
            "e.new_session().prefill([1, 2])\n"
            "print(sorted(m for m in sys.modules if m == 'tokenizers' or m.endswith('text.tokenizer')))\n"
            "e.tokenizer\n"
            "print(sorted(m for m in sys.modules if m == 'tokenizers' or m.endswith('text.tokenizer')))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = proc.stdout.splitlines()
    assert before == "[]"
    assert after == "['kestrel_stream.text.tokenizer', 'tokenizers']"


def test_many_threads_asking_at_once_build_it_once(gguf_with_tokenizer, builds):
    engine = ks.load(gguf_with_tokenizer, device="cpu", max_seq_len=32)
    start = threading.Barrier(8)
    got = []

    def ask():
        start.wait()
        got.append(engine.tokenizer)
    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len(got) == 8 and all(t is got[0] for t in got) and got[0] is not None
    engine.close()


def test_a_tokenizer_that_cannot_be_built_fails_at_first_use_and_every_use(gguf_with_tokenizer, monkeypatch):
    calls = []

    def broken(path):
        calls.append(path)
        raise RuntimeError("vocabulary unreadable")
    monkeypatch.setattr(tokenizer_module, "load_tokenizer", broken)
    engine = ks.load(gguf_with_tokenizer, device="cpu", max_seq_len=32)      # the load itself succeeds
    for _ in range(2):
        with pytest.raises(TokenizerError, match=r"tiny\.gguf: the model's tokenizer cannot be built "
                                                 r"\(RuntimeError: vocabulary unreadable\)"):
            engine.tokenizer
    with pytest.raises(TokenizerError, match="cannot be built"):
        engine.generate("Hello", max_new_tokens=2)
    assert len(calls) == 1                             # the failure is kept, not retried per request
    with engine.new_session() as s:
        assert s.prefill([1, 2, 3]).shape == (3, PRESETS["tiny"].vocab_size)
    engine.close()


def test_a_tokenizer_error_keeps_its_own_message(tmp_path):
    from kestrel_stream.loading.presets import make_model
    model = make_model(tmp_path / "m", "tiny", seed=1, dtype="f32")
    (model / "tokenizer.json").write_text("{not json")
    engine = ks.load(model, device="cpu", max_seq_len=32)
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: cannot be read by the tokenizers library"):
        engine.tokenizer
    engine.close()


def test_an_engine_built_directly_has_what_it_was_given():
    from kestrel_stream.run.engine import Engine
    engine = Engine(random_q8_weights(PRESETS["tiny"], seed=0), device="cpu", max_seq_len=16)
    assert engine.tokenizer is None and engine.tokenizer_built
    engine.close()


def test_the_background_build_finishes_without_a_request(gguf_with_tokenizer, builds):
    engine = ks.load(gguf_with_tokenizer, device="cpu", max_seq_len=32)
    engine.build_tokenizer_in_background()
    deadline = time.monotonic() + 30
    while not engine.tokenizer_built and time.monotonic() < deadline:
        time.sleep(0.01)
    assert builds == ["kestrel-tokenizer"] and engine.tokenizer is not None
    engine.build_tokenizer_in_background()            # built: nothing more to do
    assert builds == ["kestrel-tokenizer"]
    engine.close()


def test_the_daemon_waits_for_the_tokenizer_off_its_event_loop(gguf_with_tokenizer, monkeypatch):
    """A text request during the background build: the loop keeps running while it waits."""
    from scheduler.batcher import StepBatcher
    from kestrel_stream.serve.service import Service
    release = threading.Event()
    real = tokenizer_module.load_tokenizer
    monkeypatch.setattr(tokenizer_module, "load_tokenizer", lambda path: release.wait(30) and real(path))
    engine = ks.load(gguf_with_tokenizer, device="cpu", max_seq_len=32)
    engine.build_tokenizer_in_background()
    ticks = []

    async def main():
        service = Service(engine, 4, StepBatcher())       # its step thread needs the running loop

        async def tick():
            for _ in range(5):
                ticks.append(engine.tokenizer_built)
                await anyio.sleep(0.02)
            release.set()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(tick)
                return await service.tokenizer()
        finally:
            service.stop()
    try:
        tok = anyio.run(main)
    finally:
        release.set()
        engine.close()
    assert ticks == [False] * 5 and tok is not None and tok.encode("Hi") == [72, 105]


def test_the_daemon_refuses_text_with_the_reason_and_serves_token_ids(tmp_path):
    """A model whose tokenizer.json is broken: the daemon starts, says why at the first text request
    (socket: unavailable; HTTP: 500), and token-id sessions still run."""
    httpx = pytest.importorskip("httpx")
    from http_helpers import HttpDaemon
    from kestrel_stream.loading.presets import make_model
    model = make_model(tmp_path / "m", "tiny", seed=1, dtype="f32")
    (model / "tokenizer.json").write_text("{not json")
    d = HttpDaemon(model, tmp_path)
    try:
        answer = httpx.post(d.base_url + "/completions", json={"model": model.name, "prompt": "Hi", "max_tokens": 2},
                            timeout=30)
        assert answer.status_code == 500, answer.text
        error = answer.json()["error"]
        assert error["code"] == "tokenizer_unavailable" and "tokenizer.json" in error["message"]
        with ks.Client(d.address) as client:
            with client.new_session() as s:
                assert np.asarray(s.prefill([1, 2, 3])).shape == (3, PRESETS["tiny"].vocab_size)
                with pytest.raises(ks.KestrelError, match="cannot be read by the tokenizers library"):
                    s.generate("Hi", max_new_tokens=2)
    finally:
        d.stop()
