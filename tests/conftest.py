"""Shared fixtures: small random checkpoints, skipping of `gpu` tests without a GPU, and a stop at the first
GPU fault that loses the process's context (every GPU test after it would only error)."""
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


# driver errors after which the process's CUDA context is unusable: every later call returns the same error
STICKY = ("CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED",
          "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_INVALID_PC",
          "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_ASSERT", "CUDA_ERROR_ECC_UNCORRECTABLE")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A gpu test that fails on a sticky fault ends the run there, naming the test: the tests after it would
    each error on the lost context (one such fault once turned a whole GPU suite into errors)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and "gpu" in item.keywords and call.excinfo is not None:
        text = str(call.excinfo.value)
        fault = next((name for name in STICKY if name in text), None)
        if fault is not None:
            pytest.exit(f"{item.nodeid} hit {fault}, which loses this process's CUDA context: the run stops here "
                        f"(deselect the test, or run it alone, to run the others)", returncode=3)


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
