"""The CPU engine's BLAS threads (run/blas_threads.py): set by ks.load's cpu_threads and --cpu-threads,
checked where they enter."""
import pytest

import kestrel_stream as ks
from kestrel_stream.run.blas_threads import cpu_threads_now, set_cpu_threads
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
