"""Models by name (org/repo, org/repo:QUANT, org/repo:FILE.gguf, --hf-file) from a Hugging Face cache laid out as
huggingface_hub lays it out, in offline mode: no network is used."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_export import export_gguf

REVISION = "0123456789abcdef0123456789abcdef01234567"


def cached_repo(hub: Path, repo: str, files: dict[str, Path]) -> Path:
    """models--org--repo/{refs/main, snapshots/REV/...}: what huggingface_hub leaves after a download."""
    folder = hub / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(REVISION)
    for name, source in files.items():
        shutil.copyfile(source, snapshot / name)
    return snapshot


@pytest.fixture(scope="module")
def hub(tiny_model, tmp_path_factory):
    import kestrel_stream as ks
    hub = tmp_path_factory.mktemp("hub")
    cached_repo(hub, "org/tiny", {f.name: f for f in Path(tiny_model).iterdir() if f.is_file()})
    engine = ks.load(tiny_model, device="cpu", cache=False)
    gguf = export_gguf(engine.weights, hub / "tiny.gguf", byte_tokenizer=True)
    engine.close()
    cached_repo(hub, "org/tiny-GGUF", {"tiny-Q8_0.gguf": gguf, "tiny-Q4_K_M.gguf": gguf, "tiny-Q4_K_S.gguf": gguf,
                                       "README.md": gguf})
    return hub


def run(hub: Path, *args, cwd=None):
    env = dict(os.environ, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "kestrel_stream", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=cwd)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def tokens(hub, model, *flags):
    proc = run(hub, "generate", "-m", model, *flags, "-p", "hi", "-n", "4", "--json", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["tokens"]


def test_names_resolve_from_the_cache_to_the_same_model(hub, tiny_model):
    local = tokens(hub, tiny_model)
    assert tokens(hub, "org/tiny") == local                        # the safetensors checkpoint
    assert tokens(hub, "org/tiny-GGUF:q8_0") == local              # a quant, case-insensitive
    assert tokens(hub, "org/tiny-GGUF:tiny-Q4_K_S.gguf") == local  # a file
    assert tokens(hub, "org/tiny-GGUF", "--hf-file", "tiny-Q4_K_M.gguf") == local


@pytest.mark.parametrize("model,flags,message", [
    ("org/tiny-GGUF", [], "org/tiny-GGUF has 3 GGUF files; name one as org/tiny-GGUF:QUANT (e.g. org/tiny-GGUF:"
                          "Q4_K_M) or --hf-file FILE: tiny-Q4_K_M.gguf, tiny-Q4_K_S.gguf, tiny-Q8_0.gguf"),
    ("org/tiny-GGUF:Q4_K", [], "2 GGUF files match 'Q4_K'; name one as org/tiny-GGUF:FILE.gguf or --hf-file FILE: "
                               "tiny-Q4_K_M.gguf, tiny-Q4_K_S.gguf"),
    ("org/tiny-GGUF:IQ2_XS", [], "has no GGUF file whose name contains 'IQ2_XS'; its GGUF files: tiny-Q4_K_M.gguf"),
    ("org/tiny-GGUF:Q8_0", ["--hf-file", "tiny-Q4_K_M.gguf"], "names a file and --hf-file tiny-Q4_K_M.gguf another"),
    ("org/elsewhere", [], "org/elsewhere: not in the Hugging Face cache and HF_HUB_OFFLINE is set"),
])
def test_a_name_that_does_not_resolve_says_why_and_what_there_is(hub, model, flags, message):
    proc = run(hub, "generate", "-m", model, *flags, "-p", "hi", "--device", "cpu")
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kestrel-stream: error: ") and message in lines[0], proc.stderr


def test_a_local_path_wins_and_ks_load_takes_names(hub, tmp_path, llama_model):
    shutil.copytree(llama_model, tmp_path / "org" / "tiny")       # a local folder spelled like the Hub name
    code = ("import kestrel_stream as ks\n"
            "for name in ('org/tiny', 'org/tiny-GGUF:Q8_0'):\n"
            "    e = ks.load(name, device='cpu'); print(e.config.arch, e.weights.source); e.close()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(os.environ, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr
    local, gguf = proc.stdout.splitlines()
    assert local.split()[0] == "llama" and "snapshots" not in local
    assert gguf.endswith(f"models--org--tiny-GGUF/snapshots/{REVISION}/tiny-Q8_0.gguf")


def test_what_reads_as_a_name():
    from kestrel_stream.cli.main import build_parser
    from kestrel_stream.loading.hub import is_hub_name
    assert is_hub_name("org/tiny-GGUF:Q8_0") and not is_hub_name("/no/such/dir") and not is_hub_name("model.gguf")
    assert build_parser().parse_args(["serve", "-hf", "org/tiny", "-hff", "x.gguf"]).hf_file == "x.gguf"


def test_which_files_of_a_repo_make_the_checkpoint_and_which_gguf_a_quant_names():
    from kestrel_stream.loading.hub import checkpoint_files, choose_gguf
    mistral = ["config.json", "consolidated.safetensors", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
               "tokenizer.model", "params.json", "README.md", "original/model.safetensors"]
    assert sorted(checkpoint_files(mistral)) == ["config.json", "model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                                                 "params.json", "tokenizer.json", "tokenizer.model"]
    assert checkpoint_files(["model.safetensors", "README.md"]) == []          # no config: not a checkpoint
    ggufs = ["Qwen3-8B-Q4_K_M.gguf", "Qwen3-8B-Q4_K_S.gguf", "Qwen3-8B-Q4_K.gguf", "sub/Qwen3-8B-Q8_0.gguf"]
    assert choose_gguf("o/r", "q4_k", ggufs) == "Qwen3-8B-Q4_K.gguf"          # a whole part of the name wins
    assert choose_gguf("o/r", "Q8_0", ggufs) == "sub/Qwen3-8B-Q8_0.gguf"
    assert choose_gguf("o/r", "Qwen3-8B-Q8_0.gguf", ggufs) == "sub/Qwen3-8B-Q8_0.gguf"
