"""KernelSet's modules are compiled (or read from the disk cache) on threads at once and then loaded in
the caller's thread (cuda/kernels.load_modules); a module that fails to compile loads none of them."""
import threading
import time

import pytest
from cuda.bindings import driver as cu

from kestrel_stream.cuda import kernels


@pytest.fixture
def fake_build(monkeypatch):
    calls = {"compiled": [], "threads": set(), "loaded": [], "load_threads": set(), "active": 0, "overlap": 0}
    lock = threading.Lock()

    def compile_cubin(name, arch, cache_dir=None):
        with lock:
            calls["active"] += 1
            calls["overlap"] = max(calls["overlap"], calls["active"])
            calls["threads"].add(threading.current_thread().name)
        time.sleep(0.2)             # a compile: the others run meanwhile
        if name == "broken.cu":
            raise RuntimeError("NVRTC compile of broken.cu for sm_90 failed")
        with lock:
            calls["active"] -= 1
            calls["compiled"].append(name)
        return f"cubin of {name}".encode(), ""

    def load(cubin):
        calls["loaded"].append(cubin)
        calls["load_threads"].add(threading.current_thread().name)
        return cu.CUresult.CUDA_SUCCESS, f"module {cubin.decode()}"

    monkeypatch.setattr(kernels, "compile_cubin", compile_cubin)
    monkeypatch.setattr(kernels.cu, "cuModuleLoadData", load)
    monkeypatch.setattr(kernels, "_modules", {})
    return calls


def test_modules_compile_at_once_and_load_in_the_calling_thread(fake_build):
    names = ["a.cu", "b.cu", "c.cu", "d.cu"]
    start = time.perf_counter()
    kernels.load_modules(names, "sm_90")
    assert time.perf_counter() - start < 0.2 * len(names) * 0.75       # not one after another
    assert fake_build["overlap"] >= 2 and all(t.startswith("kestrel-nvrtc") for t in fake_build["threads"])
    assert fake_build["load_threads"] == {threading.current_thread().name}
    assert sorted(kernels._modules) == [(n, "sm_90", 0) for n in names]
    assert kernels.load_module("b.cu", "sm_90") == "module cubin of b.cu"     # loaded once, kept
    kernels.load_modules(names, "sm_90")
    assert len(fake_build["loaded"]) == len(names)
    # a module belongs to one context: a second device (the daemon's replicas) loads its own
    kernels.load_modules(names, "sm_90", ordinal=1)
    assert len(fake_build["loaded"]) == 2 * len(names) and (names[0], "sm_90", 1) in kernels._modules


def test_a_module_that_fails_to_compile_loads_none(fake_build):
    with pytest.raises(RuntimeError, match="broken.cu"):
        kernels.load_modules(["a.cu", "broken.cu", "c.cu"], "sm_90")
    assert kernels._modules == {} and fake_build["loaded"] == []
