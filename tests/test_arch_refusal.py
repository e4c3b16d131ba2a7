"""A checkpoint of an architecture (or rope scaling) kestrel-stream does not run is refused by name, through
ks.load and through the CLI, before any weight is read."""
import json
import os
import subprocess
import sys

import pytest

import kestrel_stream as ks
from kestrel_stream.loading.presets import make_model
from kestrel_stream.model.config import ConfigError


@pytest.mark.parametrize("config,named", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
    ({"model_type": "phi3"}, "model_type='phi3'"),
])
def test_an_unsupported_architecture_is_named(tmp_path, config, named):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"unsupported architecture {named}.*LlamaForCausalLM") as info:
        ks.load(tmp_path, device="cpu")
    assert str(tmp_path / "config.json") in str(info.value)
    done = subprocess.run([sys.executable, "-m", "kestrel_stream", "generate", "--model", str(tmp_path),
                           "--prompt-ids", "1,2"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert done.returncode == 1
    first = done.stderr.splitlines()[0]
    assert first.startswith("kestrel-stream: error: ") and named in first, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("rope,said", [({"rope_type": "dynamic", "factor": 2.0}, "'dynamic' is not supported"),
                                       ({"rope_type": "longrope", "factor": 2.0}, "'longrope' is not supported")])
def test_an_unsupported_rope_scaling_is_named(tmp_path, rope, said):
    model_dir = make_model(tmp_path / "m", "llama3-tiny", seed=1, dtype="f32")
    cfg_path = model_dir / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "rope_scaling": rope}))
    with pytest.raises(ValueError, match=said):
        ks.load(model_dir, device="cpu", cache=False)
