"""Server-side sampling defaults: serve's --temp, --top-k, --top-p, --min-p, penalties and --max-tokens apply to
requests (HTTP and socket) that leave those fields out; a request's own value wins; a bad flag fails before the
model loads."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from daemon_helpers import ENV
from http_helpers import HttpDaemon, chat_model

import kestrel_stream as ks
from kestrel_stream.serve.generate_op import parse_generate
from kestrel_stream.serve.http.requests import parse_request
from kestrel_stream.serve.sampling_defaults import SamplingDefaults

httpx = pytest.importorskip("httpx")

HOT = ("--temp", "2", "--top-k", "0", "--top-p", "1", "--min-p", "0", "--max-tokens", "7")


def test_parse_request_takes_the_servers_defaults_for_fields_left_out():
    defaults = SamplingDefaults(temperature=0.3, top_p=0.8, max_tokens=9, repeat_penalty=1.1)
    r = parse_request({"model": "m", "prompt": "x"}, chat=False, vocab_size=256, defaults=defaults)
    assert (r.params.temperature, r.params.top_p, r.params.repeat_penalty, r.max_tokens) == (0.3, 0.8, 1.1, 9)
    assert r.params.top_k == 0 and r.params.min_p == 0.0          # not set by a flag: OpenAI's defaults
    r = parse_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0,
                       "max_tokens": 2}, chat=True, vocab_size=256, defaults=defaults)
    assert r.params.temperature == 0 and r.max_tokens == 2 and r.params.top_p == 0.8
    plain = parse_request({"model": "m", "prompt": "x"}, chat=False, vocab_size=256)
    assert plain.params.temperature == 1.0 and plain.max_tokens == 16


class NoTokenizer:
    tokenizer = None
    speculation = None      # no draft

    @staticmethod
    def check_tokens(ids, where):
        import numpy as np
        return np.asarray(ids, np.int64)


def test_the_socket_generate_takes_them_too():
    import numpy as np
    defaults = SamplingDefaults(temperature=0.7, top_k=5, max_tokens=4)
    request = parse_generate(NoTokenizer, {"op": "generate"}, {"ids": np.array([1, 2])}, 100, defaults)
    params = request.generation.params
    assert params.temperature == 0.7 and params.top_k == 5 and request.generation.stop.max_new_tokens == 4
    request = parse_generate(NoTokenizer, {"op": "generate", "temperature": 0.0, "n": 2}, {"ids": np.array([1])},
                             100, defaults)
    assert request.generation.params.temperature == 0.0 and request.generation.stop.max_new_tokens == 2


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    where = tmp_path_factory.mktemp("defaults")
    d = HttpDaemon(chat_model(where / "model"), where, "--served-model-name", "m", *HOT)
    yield d
    assert d.stop() == 0


def test_http_requests_without_the_fields_get_the_flags_values(daemon):
    url = daemon.base_url + "/completions"
    with httpx.Client(timeout=60) as http:
        bare = http.post(url, json={"model": "m", "prompt": "Once", "seed": 11}).json()
        explicit = http.post(url, json={"model": "m", "prompt": "Once", "seed": 11, "temperature": 2, "top_k": 0,
                                        "top_p": 1, "min_p": 0, "max_tokens": 7}).json()
        greedy = http.post(url, json={"model": "m", "prompt": "Once", "temperature": 0, "max_tokens": 3}).json()
    assert bare["usage"]["completion_tokens"] == 7
    assert bare["choices"][0]["text"] == explicit["choices"][0]["text"]
    assert greedy["usage"]["completion_tokens"] == 3


def test_socket_generations_without_the_fields_get_the_flags_values(daemon):
    with ks.Client(daemon.address) as client:
        bare = client.generate([5, 6, 7], 12, seed=3)
        explicit = client.generate([5, 6, 7], 12, seed=3, temperature=2.0, top_k=0, top_p=1.0, min_p=0.0)
        greedy = client.generate([5, 6, 7], 12, temperature=0.0)
    assert bare.tokens == explicit.tokens and bare.tokens != greedy.tokens


@pytest.mark.parametrize("flag, value", [("--top-p", "2"), ("--temp", "-1"), ("--max-tokens", "0"),
                                         ("--repeat-penalty", "0"), ("--max-queue", "-1")])
def test_a_bad_default_fails_before_the_model_loads(tmp_path, flag, value):
    proc = subprocess.run([sys.executable, "-m", "kestrel_stream", "serve", "--model", str(tmp_path / "none"),
                           "--socket", str(tmp_path / "s"), flag, value], capture_output=True, text=True,
                          timeout=60, env=ENV)
    assert proc.returncode != 0 and f"{flag} must be in" in proc.stderr and "Traceback" not in proc.stderr


def test_the_step_budget_defaults_to_the_hosts_on_the_cpu_engine(daemon):
    with ks.Client(daemon.address) as client:
        assert client.stats()["step_tokens"] == 256
    assert "sessions and 256 tokens within" in daemon.log_path.read_text()


def test_the_models_recommended_sampling_is_read_and_checked():
    import numpy as np

    from kestrel_stream.serve.sampling_defaults import (from_generation_config, from_gguf_metadata,
                                                        with_model_defaults)
    qwen3 = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [1, 2]}
    assert from_generation_config(qwen3) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert from_generation_config({"do_sample": False, "temperature": 0.6}) == {"temperature": 0.0}
    assert from_generation_config({"temperature": 500, "top_p": 2, "top_k": 1.5, "min_p": True}) == {}
    assert from_gguf_metadata({"general.sampling.temp": np.float32(0.5), "general.sampling.top_k": np.int32(40),
                               "general.sampling.penalty_repeat": 1.1}) == {"temperature": 0.5, "top_k": 40,
                                                                            "repeat_penalty": 1.1}
    merged = with_model_defaults(SamplingDefaults(top_p=0.5), {"temperature": 0.6, "top_p": 0.95})
    assert merged.given() == {"temperature": 0.6, "top_p": 0.5}        # a flag wins over the model


def test_a_checkpoints_generation_config_sets_the_defaults_flags_override_it(tmp_path):
    model = chat_model(tmp_path / "model")
    (model / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 2.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}))
    d = HttpDaemon(model, tmp_path, "--served-model-name", "m", "--top-p", "0.5")
    try:
        url = d.base_url + "/completions"
        with httpx.Client(timeout=60) as http:
            bare = http.post(url, json={"model": "m", "prompt": "Once", "seed": 5, "max_tokens": 8}).json()
            explicit = http.post(url, json={"model": "m", "prompt": "Once", "seed": 5, "max_tokens": 8,
                                            "temperature": 2, "top_k": 0, "top_p": 0.5, "min_p": 0}).json()
            greedy = http.post(url, json={"model": "m", "prompt": "Once", "max_tokens": 8, "temperature": 0}).json()
        assert bare["choices"][0]["text"] == explicit["choices"][0]["text"] != greedy["choices"][0]["text"]
        assert "requests that set none get temperature 2, top_k 0, top_p 0.5, min_p 0" in d.log_path.read_text()
    finally:
        assert d.stop() == 0
