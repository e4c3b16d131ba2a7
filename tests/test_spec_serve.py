"""Speculative decoding in the daemon (serve -md / --spec lookup): greedy output through the socket and HTTP equals
plain decoding's with a draft that agrees everywhere (the model itself), somewhere (a perturbed copy) or nowhere
(an unrelated model), also with speculative and plain sessions sharing steps; "speculative": false opts a request
out; bad fields and a draft of another tokenizer are refused saying so; the figures reach stats and /metrics; and
clients leaving mid-round leave no session open, in the model or in the draft."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from daemon_helpers import ENV
from http_helpers import HttpDaemon, chat_model, metric
from inprocess_daemon import MODEL_NAME, InProcessDaemon, http_request

import kestrel_stream as ks
from kestrel_stream.loading.presets import make_model
from kestrel_stream.wire.protocol import ProtocolError

PROMPTS = ("Hello world", "abcabcabcabc", "The quick brown fox")
NEW_TOKENS = 40


def run_threads(threads: list[threading.Thread], errors: list) -> None:
    """Start the client threads together, wait for each (120 s at most), and fail on what any of them raised."""
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors


@pytest.fixture(scope="module", autouse=True)
def batch_invariant_arithmetic():
    """numpy's arithmetic: a row's logits whatever the step's size, so a verify pass of nine tokens and nine
    plain steps pick the same argmax (the native kernels agree within 2e-3, not bit for bit)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KESTREL_HOST_KERNELS", "numpy")
        yield


def perturbed_copy(source, destination, scale: float):
    """The checkpoint with every o_proj and down_proj jittered by `scale` of its spread: a draft that agrees
    with the model in places."""
    from safetensors.numpy import load_file, save_file
    shutil.copytree(source, destination)
    rng = np.random.default_rng(5)
    for file in destination.glob("*.safetensors"):
        tensors = load_file(file)
        for name, value in tensors.items():
            if "o_proj" in name or "down_proj" in name:
                tensors[name] = (value + scale * value.std() * rng.standard_normal(value.shape)).astype(value.dtype)
        save_file(tensors, file)
    return destination


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    where = tmp_path_factory.mktemp("spec-serve")
    target = chat_model(where / "target")
    return {"itself": target, "perturbed": perturbed_copy(target, where / "perturbed", 0.05),
            "unrelated": make_model(where / "unrelated", "tiny", seed=7, dtype="f32")}


@pytest.fixture(scope="module")
def plain(models):
    engine = ks.load(str(models["itself"]), device="cpu")
    out = {prompt: engine.generate(prompt, NEW_TOKENS) for prompt in PROMPTS}
    engine.close()
    return out


def completion(port: int, prompt: str, **fields) -> dict:
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                       **fields}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def refused(port: int, prompt: str, **fields) -> tuple[int, dict]:
    with pytest.raises(urllib.error.HTTPError) as info:
        completion(port, prompt, **fields)
    return info.value.code, json.loads(info.value.read())["error"]


def spec_stats(daemon) -> dict:
    return daemon.service.stats()["speculation"]


@pytest.mark.parametrize("draft", ["itself", "perturbed", "unrelated"])
def test_greedy_output_through_socket_and_http_equals_plain_decoding(draft, models, plain, tmp_path):
    d = InProcessDaemon(models["itself"], tmp_path, load={"draft": str(models[draft]), "spec_policy": "always"})
    try:
        with ks.Client(str(d.socket_path)) as client:
            for prompt in PROMPTS:
                answer = client.generate(prompt, NEW_TOKENS)
                assert answer.tokens == plain[prompt].tokens, prompt
                assert answer.speculation["spec_passes"] >= 1
                if draft == "itself":       # every tree's deepest path kept (a session with room for its trees)
                    assert answer.speculation["spec_acceptance"] == 1.0
                # the session holds what plain decoding's would: prompt and every token but the last
                assert answer.position == len(plain[prompt].tokens) + plain[prompt].prompt_len - 1
                streamed = [piece.token for piece in client.generate(prompt, NEW_TOKENS, stream=True)]
                assert streamed == plain[prompt].tokens
        for prompt in PROMPTS:
            assert completion(d.http_port, prompt)["choices"][0]["text"] == plain[prompt].text
        stats = spec_stats(d)
        assert stats["kind"] == "draft" and stats["spec_drafted"] > 0
        if draft == "itself":
            # an HTTP session has room for its answer alone: near its end a tree of fewer nodes may hold its
            # deepest node off the model's own path
            assert stats["spec_acceptance"] > 0.9 and stats["spec_tokens_per_pass"] > 4
        elif draft == "perturbed":
            assert 0.0 < stats["spec_acceptance"] < 1.0
        else:
            assert stats["spec_acceptance"] < 0.2
        assert d.settled_sessions() == 0 and not d.engine.speculation.draft.engine.sessions
    finally:
        d.stop()


def test_speculative_and_plain_sessions_share_steps_and_keep_their_tokens(models, plain, tmp_path):
    """Socket and HTTP clients at once, some speculating and some not: every verify pass is a job of the same
    batched steps as the others' decode tokens, and each answer is its plain decoding."""
    d = InProcessDaemon(models["itself"], tmp_path, max_sessions=16,
                        load={"draft": str(models["perturbed"]), "spec_policy": "always"})
    results, errors = {}, []

    def socket_client(i: int, speculative) -> None:
        try:
            with ks.Client(str(d.socket_path)) as client:
                prompt = PROMPTS[i % len(PROMPTS)]
                results[("socket", i)] = (prompt, client.generate(prompt, NEW_TOKENS, speculative=speculative).tokens)
        except Exception as e:
            errors.append(e)

    def http_client(i: int, speculative: bool) -> None:
        try:
            prompt = PROMPTS[i % len(PROMPTS)]
            answer = completion(d.http_port, prompt, speculative=speculative)
            results[("http", i)] = (prompt, answer["choices"][0]["text"])
        except Exception as e:
            errors.append(e)
    steps_before = d.service.stats().get("steps", 0)
    threads = [threading.Thread(target=socket_client, args=(i, None if i % 2 else False)) for i in range(6)]
    threads += [threading.Thread(target=http_client, args=(i, i % 2 == 0)) for i in range(4)]
    try:
        run_threads(threads, errors)
        assert len(results) == 10
        for (transport, _), (prompt, got) in results.items():
            assert got == (plain[prompt].tokens if transport == "socket" else plain[prompt].text), (transport, prompt)
        stats = d.service.stats()
        assert stats["speculation"]["spec_passes"] > 0 and stats["steps"] > steps_before
        assert stats["mean_batch"] > 1.0            # the sessions did share steps
        assert d.settled_sessions() == 0 and not d.engine.speculation.draft.engine.sessions
    finally:
        d.stop()


def test_a_request_opts_out_or_caps_its_chains_and_bad_fields_are_refused(models, plain, tmp_path):
    d = InProcessDaemon(models["itself"], tmp_path, load={"draft": str(models["itself"]), "spec_policy": "always"})
    prompt = PROMPTS[0]
    try:
        with ks.Client(str(d.socket_path)) as client:
            passes = spec_stats(d)["spec_passes"]
            answer = client.generate(prompt, NEW_TOKENS, speculative=False)
            assert answer.tokens == plain[prompt].tokens and answer.speculation is None
            assert spec_stats(d)["spec_passes"] == passes
            capped = client.generate(prompt, NEW_TOKENS, speculative={"draft_max": 2})
            assert capped.tokens == plain[prompt].tokens
            assert 0 < capped.speculation["spec_draft_length"] <= 2
            for bad, words in (("yes", "must be true, false"), ({"draft_max": 0}, "draft_max"),
                               ({"k": 3}, "takes only 'draft_max'")):
                with pytest.raises(ProtocolError, match=words) as info:
                    client.generate(prompt, 4, speculative=bad)
                assert "speculative" in str(info.value)
            assert client.generate(prompt, 4).tokens == plain[prompt].tokens[:4]     # the connection serves on
        assert completion(d.http_port, prompt, speculative=False)["choices"][0]["text"] == plain[prompt].text
        status, error = refused(d.http_port, prompt, speculative="yes")
        assert status == 400 and error["param"] == "speculative"
        assert d.settled_sessions() == 0
    finally:
        d.stop()


def test_a_daemon_without_a_draft_refuses_speculative_true(models, tmp_path):
    d = InProcessDaemon(models["itself"], tmp_path)
    try:
        with ks.Client(str(d.socket_path)) as client:
            with pytest.raises(ProtocolError, match="no draft.*--model-draft"):
                client.generate(PROMPTS[0], 4, speculative=True)
            assert client.generate(PROMPTS[0], 4, speculative=False).speculation is None
        status, error = refused(d.http_port, PROMPTS[0], speculative=True)
        assert status == 400 and error["param"] == "speculative" and "--model-draft" in error["message"]
        assert d.service.stats()["speculation"] is None
    finally:
        d.stop()


def test_clients_leaving_mid_round_leave_no_session(models, tmp_path):
    """Socket streams closed after a few tokens and HTTP streams dropped mid-answer, over speculative rounds: the
    model's sessions and the draft's streams all close."""
    d = InProcessDaemon(models["itself"], tmp_path, load={"draft": str(models["perturbed"]), "spec_policy": "always"})
    try:
        for i in range(6):
            client = ks.Client(str(d.socket_path))
            stream = client.generate(PROMPTS[i % 3], 200, stream=True, ignore_eos=True)
            for _, _ in zip(range(3 + i), stream):
                pass
            client.close()
        body = json.dumps({"model": MODEL_NAME, "prompt": "leave", "max_tokens": 200, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()
        for i in range(6):
            with socket.create_connection(("127.0.0.1", d.http_port), timeout=10) as sock:
                sock.sendall(http_request("POST", "/v1/completions", body))
                received = b""
                while received.count(b"data:") < 2 + i:
                    received += sock.recv(4096)
        assert d.settled_sessions() == 0
        deadline = __import__("time").monotonic() + 10
        while d.engine.speculation.draft.engine.sessions and __import__("time").monotonic() < deadline:
            __import__("time").sleep(0.01)
        assert not d.engine.speculation.draft.engine.sessions
        assert completion(d.http_port, PROMPTS[0], max_tokens=4)["usage"]["completion_tokens"] == 4
    finally:
        d.stop()


def test_serve_with_prompt_lookup_publishes_its_figures(models, plain, tmp_path):
    """`serve --spec lookup` (policy auto: the pass times measured before it listens): the same tokens as plain
    decoding, and the figures in stats and under kestrel_spec_* in /metrics."""
    d = HttpDaemon(models["itself"], tmp_path, "--spec", "lookup", "--draft-max", "4")
    try:
        log = d.log_path.read_text()
        assert ("speculative decoding: prompt lookup, chains of up to 4 tokens, policy auto; "
                "pass time (tokens: ms) 1:") in log
        port = int(d.base_url.rsplit(":", 1)[1].split("/")[0])
        for prompt in PROMPTS:
            assert completion(port, prompt, model="target")["choices"][0]["text"] == plain[prompt].text
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        assert metric(text, "kestrel_spec_passes_total") >= 3
        assert metric(text, "kestrel_spec_drafted_tokens_total") >= metric(text, "kestrel_spec_accepted_tokens_total")
        assert 1.0 <= metric(text, "kestrel_spec_tokens_per_pass") <= 5.0
        with ks.Client(str(tmp_path / "d.sock")) as client:
            stats = client.stats()["speculation"]
        assert stats["policy"] == "auto" and stats["pass_curve"]["tokens"][0] == 1
    finally:
        assert d.stop() == 0


def test_a_draft_of_another_tokenizer_is_refused_at_serve_start(models, tmp_path):
    other = make_model(tmp_path / "other", "tiny", seed=3, dtype="f32")
    vocab = json.loads((other / "tokenizer.json").read_text())
    table = vocab["model"]["vocab"]
    a, b = [k for k, v in table.items() if v in (65, 66)]
    table[a], table[b] = table[b], table[a]
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    proc = subprocess.run([sys.executable, "-m", "kestrel_stream", "serve", "-m", str(models["itself"]),
                           "--device", "cpu", "--socket", str(tmp_path / "s.sock"), "-md", str(other)],
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"draft model {other} does not share the tokenizer of {models['itself']}" in proc.stderr
    assert "token 65" in proc.stderr and "listening" not in proc.stderr


def test_a_round_that_fails_answers_an_error_and_loses_no_session(models, plain, tmp_path, monkeypatch):
    """A verify pass whose check raises fails its own request, over the socket and HTTP: the other requests and the
    connection go on, and every session of the model and the draft closes."""
    from kestrel_stream.spec.decoder import SpecDecoder
    d = InProcessDaemon(models["itself"], tmp_path, load={"draft": str(models["itself"]), "spec_policy": "always"})
    real_verdict = SpecDecoder.verdict
    failing = {"left": 0}

    def verdict(self, *args):
        if failing["left"]:
            failing["left"] -= 1
            raise RuntimeError("verification broke")
        return real_verdict(self, *args)
    monkeypatch.setattr(SpecDecoder, "verdict", verdict)
    prompt = PROMPTS[0]
    try:
        with ks.Client(str(d.socket_path)) as client:
            failing["left"] = 1
            with pytest.raises(Exception, match="verification broke"):
                client.generate(prompt, NEW_TOKENS)
            assert client.generate(prompt, NEW_TOKENS).tokens == plain[prompt].tokens
        failing["left"] = 1
        with pytest.raises(urllib.error.HTTPError) as info:
            completion(d.http_port, prompt)
        assert info.value.code == 500
        assert completion(d.http_port, prompt)["choices"][0]["text"] == plain[prompt].text
        assert d.settled_sessions() == 0 and not d.engine.speculation.draft.engine.sessions
    finally:
        d.stop()


def test_sampled_speculative_output_repeats_and_is_the_engines(models, tmp_path):
    """Sampled rounds through the daemon draw the numbers Engine.generate's rounds draw (the same draft, seed and
    rounds): the same tokens as in process, and again with the same seed."""
    load = {"draft": str(models["perturbed"]), "spec_policy": "always"}
    engine = ks.load(str(models["itself"]), device="cpu", **load)
    sampled = dict(temperature=0.9, seed=11)
    expected = {prompt: engine.generate(prompt, NEW_TOKENS, **sampled) for prompt in PROMPTS}
    engine.close()
    d = InProcessDaemon(models["itself"], tmp_path, load=load)
    try:
        with ks.Client(str(d.socket_path)) as client:
            for prompt in PROMPTS:
                first = client.generate(prompt, NEW_TOKENS, **sampled)
                assert first.tokens == expected[prompt].tokens, prompt
                assert first.speculation["spec_drafted"] == expected[prompt].stats["spec_drafted"]
                assert client.generate(prompt, NEW_TOKENS, **sampled).tokens == first.tokens
            other = client.generate(PROMPTS[0], NEW_TOKENS, temperature=0.9, seed=12)
            assert other.tokens != expected[PROMPTS[0]].tokens
    finally:
        d.stop()


def test_where_drafting_would_not_pay_the_daemon_decodes_plainly(models, plain, tmp_path):
    """Policy auto on a pass-time curve where k tokens cost k times one (a model in VRAM): every step of every
    transport is a plain one, the same tokens, and the draft is never asked."""
    from test_spec_cost import PROPORTIONAL
    d = InProcessDaemon(models["itself"], tmp_path, load={"draft": str(models["itself"])})
    d.engine.speculation.curve, d.engine.speculation.draft_s_per_token = PROPORTIONAL, 0.0
    draft_engine = d.engine.speculation.draft.engine
    try:
        draft_steps = draft_engine.executor.counters.as_dict()
        with ks.Client(str(d.socket_path)) as client:
            answer = client.generate(PROMPTS[0], NEW_TOKENS)
        assert answer.tokens == plain[PROMPTS[0]].tokens
        assert answer.speculation["spec_drafted"] == 0
        assert answer.speculation["spec_plain_passes"] == answer.speculation["spec_passes"] == NEW_TOKENS - 1
        assert completion(d.http_port, PROMPTS[1])["choices"][0]["text"] == plain[PROMPTS[1]].text
        stats = spec_stats(d)
        assert stats["spec_drafted"] == 0 and stats["spec_plain_passes"] == 2 * (NEW_TOKENS - 1)
        assert draft_engine.executor.counters.as_dict() == draft_steps
    finally:
        d.stop()


@pytest.mark.parametrize("mode", ["gpu", "layers=1"], ids=["whole-device", "layers"])
def test_greedy_output_through_the_daemon_on_the_emulated_device(mode, models, tmp_path, monkeypatch):
    """The verify passes as jobs of the device's batched steps (every row's logits back for that step), the draft
    resident beside the model: the same tokens as the daemon's plain decoding there."""
    import fake_cuda
    fake_cuda.install(monkeypatch, mode="deferred")
    d = InProcessDaemon(models["itself"], tmp_path, load={"device": "cuda", "mode": mode, "max_seq_len": 256,
                                                         "draft": str(models["perturbed"]), "spec_policy": "always"})
    try:
        assert d.engine.speculation.draft.engine.mode == "gpu"
        with ks.Client(str(d.socket_path)) as client:
            for prompt in PROMPTS:
                plain = client.generate(prompt, NEW_TOKENS, speculative=False)
                answer = client.generate(prompt, NEW_TOKENS)
                assert answer.tokens == plain.tokens, prompt
                assert answer.speculation["spec_drafted"] > 0
                assert completion(d.http_port, prompt)["choices"][0]["text"] == plain.text
        assert 0.0 < spec_stats(d)["spec_acceptance"] < 1.0
        assert d.settled_sessions() == 0 and not d.engine.speculation.draft.engine.sessions
    finally:
        d.stop()


def test_choices_of_one_request_each_speculate_and_answer_as_a_request_of_their_own(models, plain, tmp_path):
    """n > 1: every choice runs its own rounds; greedy choices are plain decoding's text, and sampled choice i
    is the answer of a request of n=1 with seed + i."""
    d = InProcessDaemon(models["itself"], tmp_path, load={"draft": str(models["itself"]), "spec_policy": "always"})
    try:
        prompt = PROMPTS[1]
        greedy = completion(d.http_port, prompt, n=2)["choices"]
        assert [c["text"] for c in greedy] == [plain[prompt].text] * 2
        sampled = completion(d.http_port, prompt, n=2, temperature=0.8, seed=11)["choices"]
        alone = [completion(d.http_port, prompt, temperature=0.8, seed=11 + i)["choices"][0]["text"] for i in (0, 1)]
        assert [c["text"] for c in sorted(sampled, key=lambda c: c["index"])] == alone
        assert spec_stats(d)["spec_drafted"] > 0
        assert d.settled_sessions() == 0 and not d.engine.speculation.draft.engine.sessions
    finally:
        d.stop()
