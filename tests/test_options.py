"""Options: every KESTREL_* setting read once, where the engine is built; nothing reads them at import."""
import subprocess
import sys
from pathlib import Path

import pytest

from kestrel_stream.options import Options


def test_the_environment_becomes_one_options_object():
    env = {"KESTREL_PROF": "1", "KESTREL_TRACE": "t.json", "KESTREL_VERIFY": "1", "KESTREL_PDL": "0",
           "KESTREL_MINFLOP": "1e7", "KESTREL_GEMV_M1": "r4", "KESTREL_GEMV_MN": "o64r4u2",
           "KESTREL_KERNEL_CACHE": "/tmp/k", "KESTREL_CACHE_DIR": "/tmp/c"}
    o = Options.from_env(env, vram_budget="2GiB")
    assert (o.prof, o.trace_path, o.verify, o.programmatic_launch, o.minflop) == (True, "t.json", True, False, 1e7)
    assert (o.gemv_m1, o.gemv_mn, o.kernel_cache_dir, o.cache_dir) == ("r4", "o64r4u2", Path("/tmp/k"), Path("/tmp/c"))
    assert o.vram_budget == 2 << 30
    assert Options.from_env({}) == Options()
    assert Options.from_env({}, vram_budget=0.5).vram_budget == 0.5


@pytest.mark.parametrize("env, message", [({"KESTREL_MINFLOP": "lots"}, "KESTREL_MINFLOP"),
                                          ({"KESTREL_GEMV_M1": "w7"}, "KESTREL_GEMV_M1='w7'"),
                                          ({}, "--vram-budget")])
def test_a_bad_setting_names_itself(env, message):
    with pytest.raises(ValueError, match=message):
        Options.from_env(env, vram_budget="lots" if not env else None)


def test_no_module_reads_kestrel_settings_at_import():
    """Importing the runtime with every setting on changes nothing: the switches stay off until an engine is built."""
    code = ("import kestrel_stream, kestrel_stream.run.gpu_executor as g, kestrel_stream.obs.prof as p, "
            "kestrel_stream.obs.trace as t; assert not p.enabled and t.active is None; "
            "assert not hasattr(g.GpuExecutor, 'programmatic')")
    env = {"KESTREL_PROF": "1", "KESTREL_TRACE": "/nonexistent/t.json", "KESTREL_PDL": "0", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=Path(__file__).resolve().parents[1])


def test_the_engine_keeps_the_options_it_was_built_with(tmp_path, monkeypatch):
    from kestrel_stream.loading.presets import random_q8_weights
    from kestrel_stream.run.engine import Engine
    monkeypatch.setenv("KESTREL_MINFLOP", "5")
    engine = Engine(random_q8_weights("tiny", seed=1), device="cpu")
    assert engine.options.minflop == 5
    engine = Engine(random_q8_weights("tiny", seed=1), device="cpu", options=Options(minflop=7))
    assert engine.options.minflop == 7
