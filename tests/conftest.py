"""Shared fixtures: small random checkpoints, and skipping of `gpu` tests without a GPU."""
from __future__ import annotations

import pytest

from kestrel_stream.run.engine import gpu_status
from kestrel_stream.loading.presets import make_model


def pytest_collection_modifyitems(config, items):
    available, reason = gpu_status()
    if available:
        return
    skip = pytest.mark.skip(reason=f"no GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A random Qwen3 checkpoint (preset tiny), float32 safetensors."""
    return make_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=1, dtype="f32")


@pytest.fixture(scope="session")
def long_tiny_model(tmp_path_factory):
    """The tiny preset's weights with a 4,096-position context (its own is 512), for long prompts."""
    from dataclasses import replace
    from kestrel_stream.loading.presets import PRESETS
    return make_model(tmp_path_factory.mktemp("tiny-long"), replace(PRESETS["tiny"], max_position_embeddings=4096),
                      seed=1, dtype="f32")


@pytest.fixture(scope="session")
def llama_model(tmp_path_factory):
    """A random Llama checkpoint (preset llama-tiny, GQA 4, untied), float32 safetensors."""
    return make_model(tmp_path_factory.mktemp("llama"), "llama-tiny", seed=2, dtype="f32")


@pytest.fixture(scope="module")
def daemon_engine(tiny_model):
    """The in-process engine a daemon test compares the daemon's answers with."""
    import kestrel_stream as ks
    eng = ks.load(tiny_model, device="cpu", max_seq_len=128)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def daemon(tiny_model, tmp_path_factory, request):
    """A `kestrel-stream serve` process on a temp Unix socket, shared by one test module; a module's
    ``DAEMON_FLAGS`` (a tuple of serve flags) are added to its daemon's."""
    from daemon_helpers import DaemonProcess
    where = tmp_path_factory.mktemp("daemon")
    proc = DaemonProcess.on_socket(tiny_model, where, "--max-seq-len", "128", "--max-sessions", "48",
                                   "--trace-dir", str(where / "traces"), *getattr(request.module, "DAEMON_FLAGS", ()))
    yield proc
    assert proc.stop() == 0, (where / "serve.log").read_text()
