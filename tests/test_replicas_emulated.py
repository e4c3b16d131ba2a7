"""Replicas on two device ordinals of the emulated GPU (tests/fake_cuda.py: each device a context a thread makes
current, each arena its device's): ks.load(device="cuda:1") runs on device 1, two engines stepping in turn on
one thread each touch only their own device's memory and give the same greedy tokens, and the daemon's two
replicas (``serve --devices 0,1``) answer their sessions with the tokens one engine gives.  Marked `gpu`, the
daemon's test runs on a real GPU too: on two GPUs where there are two, else as two engines on the one GPU (its
primary context shared; the CLI refuses a device named twice, the service takes it)."""
from __future__ import annotations

import pytest

import fake_cuda
from kestrel_stream.run.device_choice import gpu_count
import kestrel_stream as ks
from kestrel_stream.cuda import driver
from kestrel_stream.errors import DeviceError

PROMPT = [5, 3, 200, 17, 42, 8, 1, 99, 250, 7, 64, 31]


@pytest.fixture
def emulated(monkeypatch):
    fake_cuda.install(monkeypatch)


@pytest.fixture(params=["emulated", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not driver.gpu_available(), reason=f"{driver.detect()}")])])
def two_devices(request, monkeypatch) -> list[str]:
    """The replicas' devices: two emulated GPUs, or the real ones (GPU 0 twice on a one-GPU machine)."""
    if request.param == "emulated":
        fake_cuda.install(monkeypatch)
        return ["cuda:0", "cuda:1"]
    return ["cuda:0", "cuda:1" if gpu_count() > 1 else "cuda:0"]


def greedy(engine, prompt, steps: int) -> list[int]:
    with engine.new_session() as s:
        token = int(s.prefill(prompt, logits="last").argmax())
        out = [token]
        for _ in range(steps - 1):
            token = int(s.decode(token).argmax())
            out.append(token)
    return out


def test_two_ordinals_each_engine_on_its_own_device(emulated, tiny_model):
    first = ks.load(tiny_model, device="cuda:0", mode="gpu", max_seq_len=64)
    second = ks.load(tiny_model, device="cuda:1", mode="gpu", max_seq_len=64)
    try:
        assert (first.executor.steps.backend.device.ordinal, second.executor.steps.backend.device.ordinal) == (0, 1)
        a, b = first.new_session(), second.new_session()
        token_a = int(a.prefill(PROMPT, logits="last").argmax())
        token_b = int(b.prefill(PROMPT, logits="last").argmax())
        for _ in range(6):          # steps interleaved on one thread: each makes its own context current
            assert token_a == token_b
            token_a, token_b = int(a.decode(token_a).argmax()), int(b.decode(token_b).argmax())
        # the emulation has teeth: device 0's memory read while device 1's context is current fails
        arena = first.executor.steps.backend.arena
        driver.Device(1)
        with pytest.raises(driver.CudaError, match="device 0 while device 1"):
            fake_cuda.dev(arena.base + next(iter(arena._live)), 4)
    finally:
        first.close()
        second.close()
    with pytest.raises(DeviceError, match="cuda:2 does not exist: this machine has 2 GPU"):
        ks.load(tiny_model, device="cuda:2", mode="gpu")


def test_the_daemon_serves_two_devices(two_devices, tiny_model, tmp_path):
    pytest.importorskip("h2", reason="the in-process daemon's HTTP front needs the test extras (h2)")
    from inprocess_daemon import InProcessDaemon
    solo = ks.load(tiny_model, device="cuda:0", mode="gpu", max_seq_len=64)
    expected = greedy(solo, PROMPT, 6)
    solo.close()
    d = InProcessDaemon(tiny_model, tmp_path, devices=two_devices, load={"mode": "gpu", "max_seq_len": 64})
    try:
        with ks.Client(str(d.socket_path)) as client:
            sessions = [client.new_session() for _ in range(2)]     # balance: one on each device
            assert [len(engine.sessions) for engine in d.engines] == [1, 1]
            for s in sessions:
                assert s.generate(PROMPT, 6).tokens == expected
            stats = client.stats()
        assert [r["device"] for r in stats["replicas"]] == two_devices
        assert [r["decode_tokens"] for r in stats["replicas"]] == [5, 5] and stats["decode_tokens"] == 10
    finally:
        d.stop()
