"""The native host kernels' library as a whole: the portable build, the fallbacks to numpy with one line (no
compiler, a failed build, an unwritable cache), the cache by source, flags, compiler and CPU; its thread pool
(results independent of the threads, calls from several Python threads, a forked child, the spin mixed steps
set, a call's cost after a device segment's gap).  The kernels' numbers: test_native_kernels.py."""
from __future__ import annotations

import os
import shutil
import signal
import time

import numpy as np
import pytest

from kestrel_stream import native
from kestrel_stream.options import Options
from kestrel_stream.run import host
from test_native_kernels import assert_formats_match_twin, make_weight

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(scope="module")
def kernels():
    return native.load()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_count_changes_no_result(kernels, threads):
    rng = np.random.default_rng(threads)
    call, twin, _ = make_weight(rng, "Q4_0", 101, 320)
    x = rng.standard_normal((4, 320)).astype(np.float32)
    one = call(native.HostKernels(kernels.path, threads=1), x)
    np.testing.assert_array_equal(call(native.HostKernels(kernels.path, threads=threads), x), one)


def test_the_portable_build_runs_scalar_c_only(tmp_path):
    """Built without the x86 SIMD code and without _Float16 (as on other architectures and compilers):
    every ISA asked for runs the scalar C, halves converted by their bit fields."""
    from kestrel_stream.native.build import build_library
    path = build_library(tmp_path, extra_flags=("-DKS_NO_X86", "-DKS_NO_FLOAT16"))
    portable = native.HostKernels(path, isa="avx512vnni", threads=2)
    assert portable.supported == ("scalar",) and portable.isa == "scalar"
    rng = np.random.default_rng(11)
    assert_formats_match_twin([portable], rng, 1, (1, 17))
    gu = rng.standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_allclose(portable.silu_mul(gu[:, :32], gu[:, 32:]), host.silu_mul(gu[:, :32], gu[:, 32:]),
                               rtol=2e-6, atol=1e-7)
    q = rng.standard_normal((1, 4, 32)).astype(np.float32)
    kv = rng.standard_normal((9, 2, 32)).astype(np.float16)
    np.testing.assert_allclose(portable.attention(q, kv, kv, 8), host.attention(q, kv.astype(np.float32),
                               kv.astype(np.float32), 8), rtol=0, atol=2e-5)


def test_calls_from_several_python_threads_share_the_pool(kernels):
    import threading
    rng = np.random.default_rng(13)
    call, twin, _ = make_weight(rng, "Q8_0", 200, 256)
    xs = [rng.standard_normal((t, 256)).astype(np.float32) for t in (1, 3, 20)]
    expect = [twin(x) for x in xs]
    bad = []

    def run(seed):
        r = np.random.default_rng(seed)
        for _ in range(150):
            j, threads = int(r.integers(0, 3)), int(r.integers(1, 4))
            if not np.allclose(call(native.HostKernels(kernels.path, threads=threads), xs[j]), expect[j], atol=1e-5):
                bad.append((seed, j, threads))

    runners = [threading.Thread(target=run, args=(seed,)) for seed in range(3)]
    for r in runners:
        r.start()
    for r in runners:
        r.join(timeout=60)
    assert not any(r.is_alive() for r in runners) and not bad


def test_a_forked_child_runs_the_kernels_on_its_own_workers(kernels):
    """The parent's workers do not exist in a child; the child starts its own (GNU OpenMP's would hang)."""
    rng = np.random.default_rng(12)
    call, twin, _ = make_weight(rng, "Q8_0", 300, 256)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    two = native.HostKernels(kernels.path, threads=2)
    np.testing.assert_allclose(call(two, x), twin(x), rtol=0, atol=1e-5)
    assert two.pool_workers >= 1
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if np.allclose(call(two, x), twin(x), rtol=0, atol=1e-5) else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in the kernels")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_no_compiler_falls_back_with_one_line(tmp_path):
    ok, reason = native.availability(cc=str(tmp_path / "no-such-cc"), cache_dir=tmp_path)
    assert not ok and "\n" not in reason
    assert reason.startswith("kestrel-stream: native host kernels unavailable") and "using numpy" in reason
    with pytest.raises(native.NativeUnavailable, match="no C compiler"):
        native.load(Options.from_env({"CC": str(tmp_path / "no-such-cc")}), cache_dir=tmp_path)


def test_a_failed_build_falls_back_with_one_line_and_keeps_the_log(tmp_path):
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo broken 1.0; exit 0; fi\n"
                      "echo 'host_kernels.c:1: error: nothing works' >&2; exit 1\n")
    broken.chmod(0o755)
    with pytest.raises(native.NativeUnavailable) as info:
        native.load(cc=str(broken), cache_dir=tmp_path)
    assert "\n" not in str(info.value) and "status 1" in str(info.value)
    assert "nothing works" in info.value.log
    assert not list(tmp_path.glob("*.so"))


def test_an_unwritable_cache_falls_back_with_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    ok, reason = native.availability(cache_dir=blocker / "host_kernels")
    assert not ok and "\n" not in reason and "cannot write the host kernels' cache" in reason


def test_the_library_is_cached_by_source_flags_compiler_and_cpu(tmp_path):
    first = native.load(cache_dir=tmp_path)
    assert first.path.parent == tmp_path and first.path.exists()
    mtime = first.path.stat().st_mtime_ns
    assert native.load(cache_dir=tmp_path).path == first.path and first.path.stat().st_mtime_ns == mtime
    assert native.load(Options.from_env({"KESTREL_CACHE_DIR": str(tmp_path)})).path.parent == tmp_path / "host_kernels"


def test_host_call_cost_is_measured_after_a_device_segments_gap():
    """calibrate's host_call_us: a small call after a busy gap, at the pool spin mixed steps set."""
    from kestrel_stream.native import load
    from kestrel_stream.options import Options
    from kestrel_stream.run import calibrate
    kernels = load(Options.from_env({}), threads=2)
    call_us = calibrate._host_call_us(kernels, Options.from_env({}))
    assert 0 < call_us < 50_000


def test_each_formats_kernel_rate_is_measured_by_tokens_and_prices_a_profile():
    """calibrate's host_format_tokens_GBps: Q8_0, Q4_K and Q6_K at 1 .. 32 tokens a call, a rate each; 32 tokens
    take longer than one over the same bytes on any host; the curves are a valid DeviceProfile field."""
    import dataclasses

    from kestrel_stream.native import load
    from kestrel_stream.options import Options
    from kestrel_stream.run import calibrate
    from scheduler.profile import H200_POOL
    kernels = load(Options.from_env({}), threads=2)
    curves = calibrate._format_token_rates(kernels, total_bytes=40 << 20)
    assert sorted(curves) == ["Q4_K", "Q6_K", "Q8_0"]
    for fmt, curve in curves.items():
        assert [t for t, _ in curve] == list(calibrate.KERNEL_TOKENS), fmt
        assert all(rate > 0 for _, rate in curve) and curve[-1][1] < curve[0][1], (fmt, curve)
    assert dataclasses.replace(H200_POOL, host_format_tokens_GBps=curves).host_format_tokens_GBps == curves


def test_mixed_steps_raise_the_pool_spin_only_where_asked_and_with_cpus_to_spare(monkeypatch):
    from kestrel_stream.options import Options
    from kestrel_stream.run.host import pool_spin as mixed
    monkeypatch.setattr(mixed.os, "cpu_count", lambda: 16)
    assert mixed.mixed_spin(Options.from_env({}))
    assert not mixed.mixed_spin(Options.from_env({"KESTREL_HOST_SPIN_US": "0"}))
    monkeypatch.setattr(mixed.os, "cpu_count", lambda: 2)
    assert not mixed.mixed_spin(Options.from_env({}))


def test_a_profile_names_the_host_kernels_its_rates_are_of(tmp_path):
    """calibrate keeps a profile only for the host kernels it measured: `library:ISA`, another ISA (or another
    library: new sources, compiler or CPU) is another name, and the name survives the profile's file."""
    import dataclasses

    from kestrel_stream.options import Options
    from kestrel_stream.run import calibrate
    from scheduler.profile import H200_POOL, DeviceProfile
    widest = calibrate.host_kernels_name(Options.from_env({"KESTREL_CACHE_DIR": str(tmp_path)}))
    scalar = calibrate.host_kernels_name(Options.from_env({"KESTREL_CACHE_DIR": str(tmp_path), "KESTREL_HOST_ISA": "scalar"}))
    assert widest.startswith("host_kernels-") and widest.endswith(":" + native.load().isa)
    assert scalar == widest.rsplit(":", 1)[0] + ":scalar"
    profile = dataclasses.replace(H200_POOL, host_kernels=widest)
    assert DeviceProfile.from_dict(profile.to_dict()).host_kernels == widest
