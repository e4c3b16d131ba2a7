"""The CPU engine's BLAS threads (run/blas_threads.py): set by ks.load's cpu_threads and --cpu-threads,
checked where they enter; one thread on the CPU engine over the native kernels unless blas_threads (or
KESTREL_BLAS_THREADS) says otherwise, the host's threads in the other modes."""
import shutil

import pytest

import kestrel_stream as ks
from kestrel_stream.options import Options
from kestrel_stream.run.blas_threads import cpu_threads_now, engine_blas_threads, set_cpu_threads
from test_cli import run_cli


@pytest.fixture
def restore_threads():
    before = cpu_threads_now()
    yield
    set_cpu_threads(before[0])


def test_cpu_threads_sets_blas_threads_and_the_engine_still_computes(tiny_model, restore_threads):
    engine = ks.load(tiny_model, device="cpu", cpu_threads=1)
    assert cpu_threads_now() and set(cpu_threads_now()) == {1}
    with engine.new_session() as s:
        assert s.prefill([1, 2, 3]).shape == (3, engine.config.vocab_size)
    engine.close()


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_a_bad_cpu_threads_is_refused_before_anything_loads(tiny_model, bad, restore_threads):
    before = cpu_threads_now()
    with pytest.raises(ValueError, match="cpu_threads"):
        ks.load(tiny_model, device="cpu", cpu_threads=bad)
    assert cpu_threads_now() == before


def test_the_cli_flag_is_checked_where_it_enters(tiny_model):
    proc = run_cli("generate", "--model", str(tiny_model), "--prompt-ids", "1,2", "--max-new-tokens", "2",
                   "--device", "cpu", "--cpu-threads", "0", check=False)
    assert proc.returncode == 2 and "--cpu-threads" in proc.stderr
    ok = run_cli("generate", "--model", str(tiny_model), "--prompt-ids", "1,2", "--max-new-tokens", "2",
                 "--device", "cpu", "--cpu-threads", "1", "--json")
    assert '"tokens"' in ok.stdout


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: no native kernels")
def test_the_cpu_engine_over_the_native_kernels_gives_blas_one_thread(tiny_model, restore_threads, monkeypatch):
    monkeypatch.delenv("KESTREL_BLAS_THREADS", raising=False)
    monkeypatch.delenv("KESTREL_HOST_KERNELS", raising=False)
    ks.load(tiny_model, device="cpu", cpu_threads=2).close()
    assert set(cpu_threads_now()) == {1}
    ks.load(tiny_model, device="cpu", cpu_threads=2, blas_threads=2).close()
    assert set(cpu_threads_now()) == {2}
    monkeypatch.setenv("KESTREL_BLAS_THREADS", "2")
    ks.load(tiny_model, device="cpu", cpu_threads=1).close()
    assert set(cpu_threads_now()) == {2}
    monkeypatch.delenv("KESTREL_BLAS_THREADS")
    monkeypatch.setenv("KESTREL_HOST_KERNELS", "numpy")           # numpy multiplies: BLAS gets the host's threads
    ks.load(tiny_model, device="cpu", cpu_threads=2).close()
    assert set(cpu_threads_now()) == {2}


def test_the_mixed_modes_keep_the_hosts_threads():
    options = Options(host_threads=4)
    assert engine_blas_threads(options, "layers=2", True) == 4 and engine_blas_threads(options, "offload", True) == 4
    assert engine_blas_threads(options, "cpu", True) == 1 and engine_blas_threads(options, "cpu", False) == 4
    assert engine_blas_threads(options.with_(blas_threads=3), "cpu", True) == 3


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_a_bad_blas_threads_is_refused_before_anything_loads(tiny_model, bad, restore_threads, monkeypatch):
    before = cpu_threads_now()
    with pytest.raises(ValueError, match="blas_threads"):
        ks.load(tiny_model, device="cpu", blas_threads=bad)
    monkeypatch.setenv("KESTREL_BLAS_THREADS", "0")
    with pytest.raises(ValueError, match="KESTREL_BLAS_THREADS"):
        ks.load(tiny_model, device="cpu")
    assert cpu_threads_now() == before
