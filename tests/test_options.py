"""Options: every KESTREL_* setting read once, where the engine is built; nothing reads them at import."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kestrel_stream.options import Options


def test_the_environment_becomes_one_options_object():
    env = {"KESTREL_PROF": "1", "KESTREL_TRACE": "t.json", "KESTREL_VERIFY": "1", "KESTREL_PDL": "0",
           "KESTREL_FUSED_ROPE": "0", "KESTREL_STEP_GRAPHS": "0", "KESTREL_MINFLOP": "1e7", "KESTREL_GEMV_M1": "r4",
           "KESTREL_GEMV_MN": "o64r4u2",
           "KESTREL_KERNEL_CACHE": "/tmp/k", "KESTREL_CACHE_DIR": "/tmp/c"}
    o = Options.from_env(env, vram_budget="2GiB")
    assert (o.prof, o.trace_path, o.verify, o.programmatic_launch, o.minflop) == (True, "t.json", True, False, 1e7)
    assert (o.gemv_m1, o.gemv_mn, o.kernel_cache_dir, o.cache_dir) == ("r4", "o64r4u2", Path("/tmp/k"), Path("/tmp/c"))
    assert o.vram_budget == 2 << 30 and not o.fused_rope and not o.step_graphs
    assert Options.from_env({"KESTREL_STEP_GRAPHS": "1"}).step_graphs and Options().step_graphs
    assert Options.from_env({}) == Options()
    assert Options.from_env({}, vram_budget=0.5).vram_budget == 0.5
    assert Options.from_env({"KESTREL_HOST_RESERVE": "8GiB"}).host_reserve == 8 << 30
    assert Options.from_env({"KESTREL_HOST_RESERVE": "0"}).host_reserve == 0
    assert Options.from_env({"KESTREL_HOST_READS_IMAGES": "1"}).host_reads_images and not Options().host_reads_images
    links = [Options.from_env({"KESTREL_LINK_EXPERTS": v}).link_experts for v in ("3", "0", "Auto", "defer", "")]
    assert links == [3, 0, "auto", "defer", 0]


@pytest.mark.parametrize("env, message", [({"KESTREL_MINFLOP": "lots"}, "KESTREL_MINFLOP"),
                                          ({"KESTREL_GEMV_M1": "w7"}, "KESTREL_GEMV_M1='w7'"),
                                          ({"KESTREL_STEP_GRAPHS": "yes"}, "KESTREL_STEP_GRAPHS='yes'"),
                                          ({"KESTREL_HOST_RESERVE": "lots"}, "KESTREL_HOST_RESERVE='lots'"),
                                          ({"KESTREL_LINK_EXPERTS": "half"}, "KESTREL_LINK_EXPERTS='half'.*auto or defer"),
                                          ({"KESTREL_HOST_READS_IMAGES": "yes"}, "KESTREL_HOST_READS_IMAGES='yes'"),
                                          ({}, "--vram-budget")])
def test_a_bad_setting_names_itself(env, message):
    with pytest.raises(ValueError, match=message):
        Options.from_env(env, vram_budget="lots" if not env else None)


def test_no_module_reads_kestrel_settings_at_import():
    """Importing the runtime with every setting on changes nothing: the switches stay off until an engine is built."""
    code = ("import kestrel_stream, kestrel_stream.run.compat as g, kestrel_stream.obs.prof as p, "
            "kestrel_stream.obs.trace as t; assert not p.enabled and t.active is None; "
            "assert not hasattr(g.GpuExecutor, 'programmatic')")
    env = {"KESTREL_PROF": "1", "KESTREL_TRACE": "/nonexistent/t.json", "KESTREL_PDL": "0", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=Path(__file__).resolve().parents[1])


def test_the_engine_keeps_the_options_it_was_built_with(tmp_path, monkeypatch):
    from bench.synthetic import random_q8_weights
    from kestrel_stream.run.engine import Engine
    monkeypatch.setenv("KESTREL_MINFLOP", "5")
    engine = Engine(random_q8_weights("tiny", seed=1), device="cpu")
    assert engine.options.minflop == 5
    engine = Engine(random_q8_weights("tiny", seed=1), device="cpu", options=Options(minflop=7))
    assert engine.options.minflop == 7


# The variables still read outside options.py, each with why; a read of any other fails the test below, and
# so does a listed one no longer read (the list only shrinks).
PENDING: set[str] = set()
READS = re.compile(r"\bos\s*\.\s*(environb?|getenv|putenv|unsetenv)\b|from\s+os\s+import[^\n]*\b(environb?|getenv)\b")


def test_only_options_reads_the_environment():
    root = Path(__file__).resolve().parents[1]
    read, unnamed = set(), []
    for package in ("kestrel_stream", "scheduler", "kernels_ptx"):
        for path in sorted((root / package).rglob("*.py")):
            if path == root / "kestrel_stream" / "options.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if READS.search(line):
                    names = re.findall(r"""["']([A-Z][A-Z0-9_]+)["']""", line)
                    read.update(names)
                    if not names or not set(names) <= PENDING:
                        unnamed.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not unnamed, ("read settings in kestrel_stream/options.py (Options or Environment) and pass them down:\n"
                         + "\n".join(unnamed))
    assert read == PENDING, f"no longer read outside options.py (drop from PENDING): {PENDING - read}"


def test_the_daemon_and_client_variables_become_one_environment_object(tmp_path):
    from kestrel_stream.client.sync import parse_address, resolve_token
    from kestrel_stream.options import Environment
    env = Environment.from_env({"KESTREL_SOCKET": "tcp://127.0.0.1:7001", "KESTREL_TOKEN": "t0k",
                                "KESTREL_API_KEY": "k3y", "KESTREL_COMMIT": "abc1234",
                                "XDG_RUNTIME_DIR": str(tmp_path)})
    assert env == Environment("tcp://127.0.0.1:7001", "t0k", "k3y", "abc1234", tmp_path)
    assert Environment.from_env({"KESTREL_TOKEN": "", "XDG_RUNTIME_DIR": ""}) == Environment()
    assert parse_address(None, env) == ("tcp", ("127.0.0.1", 7001))
    assert parse_address("/x.sock", env) == ("unix", "/x.sock")
    assert parse_address(None, Environment(runtime_dir=tmp_path)) == ("unix", str(tmp_path / "kestrel-stream.sock"))
    assert resolve_token("tcp", None, env) == "t0k" and resolve_token("tcp", "given", env) == "given"
    (tmp_path / "kestrel-stream.token").write_text("from-file\n")
    assert resolve_token("tcp", None, Environment(runtime_dir=tmp_path)) == "from-file"
    from kestrel_stream.cli.bench import environment
    assert environment(env)["commit"] == "abc1234"
