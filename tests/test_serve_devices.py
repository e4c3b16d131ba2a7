"""``serve --devices``: the list is checked before anything loads (each error names the flag and the value), a
replica that fails to load stops the daemon with its error and leaves nothing running, and ``--devices cpu,cpu``
runs as a process: two replicas, stopped cleanly."""
from __future__ import annotations

import threading

import pytest
from daemon_helpers import DaemonProcess

import fake_cuda
import kestrel_stream as ks
from kestrel_stream import api
from kestrel_stream.cli.main import main
from kestrel_stream.run.device_choice import gpu_count
from kestrel_stream.serve.devices import parse_devices
from kestrel_stream.serve.flags import DEFAULT_PREFIX_SLACK
from scheduler import replica_choice

REFUSED = [
    (["--devices", ""], "--devices '': expected a comma-separated list of GPU ordinals (0,1) or cpu"),
    (["--devices", "0,,1"], "--devices '0,,1': expected a comma-separated list"),
    (["--devices", "0,0"], "--devices '0,0': cuda:0 is named twice; one replica per GPU"),
    (["--devices", "1,cuda:1"], "--devices '1,cuda:1': cuda:1 is named twice"),
    (["--devices", "cpu,1"], "--devices 'cpu,1': mixes CPU engines and GPUs"),
    (["--devices", "0,gpu"], "--devices '0,gpu': 'gpu' is neither a GPU ordinal (0, 1, cuda:1) nor cpu"),
    (["--devices", "-1"], "--devices '-1': '-1' is neither a GPU ordinal"),
    (["--device", "cuda", "--devices", "cpu,cpu"], "--devices 'cpu,cpu' names CPU engines but --device is cuda"),
    (["--devices", "cpu,cpu", "--route-prefix-slack", "-1"], "--route-prefix-slack must be in 0.."),
]


@pytest.fixture
def no_load(monkeypatch):
    loads = []
    monkeypatch.setattr(api, "load", lambda *a, **k: loads.append(a))
    return loads


def serve(tiny_model, tmp_path, *flags: str) -> int:
    return main(["serve", "--model", str(tiny_model), "--socket", str(tmp_path / "ks.sock"), *flags])


def test_the_lists_spellings():
    assert parse_devices("0,1") == parse_devices("cuda:0, cuda:1") == ["cuda:0", "cuda:1"]
    assert parse_devices("cpu,CPU,cpu") == ["cpu"] * 3 and parse_devices("3") == ["cuda:3"]
    assert DEFAULT_PREFIX_SLACK == replica_choice.DEFAULT_PREFIX_SLACK      # flags.py keeps --help import-light


@pytest.mark.parametrize("flags, message", REFUSED)
def test_a_bad_list_is_refused_before_anything_loads(flags, message, tiny_model, tmp_path, no_load, capsys):
    assert serve(tiny_model, tmp_path, *flags) == 1
    assert message in capsys.readouterr().err and not no_load


@pytest.mark.skipif(gpu_count() > 0, reason="a machine without a GPU")
def test_gpus_on_a_machine_without_one(tiny_model, tmp_path, no_load, capsys):
    assert serve(tiny_model, tmp_path, "--devices", "0,1") == 1
    err = capsys.readouterr().err
    assert "--devices '0,1': cuda:0 does not exist: this machine has no usable GPU" in err
    assert "--devices cpu,cpu runs CPU engines" in err and not no_load


def test_a_gpu_this_machine_does_not_have(tiny_model, tmp_path, monkeypatch, no_load, capsys):
    fake_cuda.install(monkeypatch)                  # two emulated GPUs
    assert serve(tiny_model, tmp_path, "--devices", "1,2") == 1
    assert "--devices '1,2': cuda:2 does not exist: this machine has 2 GPU(s), 0..1" in capsys.readouterr().err
    assert not no_load


def test_a_replica_that_fails_to_load_stops_the_daemon_and_leaves_nothing_running(tiny_model, tmp_path, monkeypatch,
                                                                                     capsys):
    real_load, loaded, closed = api.load, [], []

    def load(path, device, **kwargs):
        if loaded:
            raise RuntimeError("the second device ran out of memory")
        engine = real_load(path, device=device, **kwargs)
        real_close = engine.close
        engine.close = lambda: (closed.append(engine), real_close())
        loaded.append(engine)
        return engine
    monkeypatch.setattr(api, "load", load)
    threads = set(threading.enumerate())
    assert serve(tiny_model, tmp_path, "--devices", "cpu,cpu") == 1
    assert ("--devices 'cpu,cpu': replica 1 (cpu) did not load: RuntimeError: the second device ran out of memory"
            in capsys.readouterr().err)
    assert closed == loaded and len(loaded) == 1            # the replica loaded before it is closed
    assert set(threading.enumerate()) <= threads and not (tmp_path / "ks.sock").exists()


def test_two_cpu_replicas_as_a_process(tiny_model, tmp_path):
    proc = DaemonProcess.on_socket(tiny_model, tmp_path, "--devices", "cpu,cpu", "--max-seq-len", "128")
    try:
        log = (tmp_path / "serve.log").read_text()
        assert "replica 1 (cpu) plan:" in log and "2 replicas (cpu, cpu)" in log
        with ks.Client(proc.address) as client:
            sessions = [client.new_session() for _ in range(2)]
            for s in sessions:
                s.generate([1, 2, 3], 3)
            stats = client.stats()
        assert [r["placed"] for r in stats["replicas"]] == [1, 1] and stats["decode_tokens"] == 4
    finally:
        assert proc.stop() == 0, (tmp_path / "serve.log").read_text()
