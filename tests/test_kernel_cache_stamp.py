"""The kernel disk cache's key names the compiler by the installed wheels' versions, read without loading
NVRTC, so a load whose kernels are all cached never imports or loads it; a new NVRTC still recompiles."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels_ptx import build

ROOT = Path(__file__).resolve().parents[1]


def fake_site(root: Path, nvrtc_version: str | None, bindings_version: str | None, library: bool = True) -> Path:
    """A site-packages directory holding only the dist-info (and library file) of the two wheels."""
    root.mkdir(parents=True, exist_ok=True)
    if nvrtc_version is not None:
        info = root / f"nvidia_cuda_nvrtc-{nvrtc_version}.dist-info"
        info.mkdir()
        (info / "RECORD").write_text("nvidia/cu13/lib/libnvrtc-builtins.so.13.5,,\n"
                                     "nvidia/cu13/lib/libnvrtc.so.13,sha256=x,1\n")
        if library:
            (root / "nvidia/cu13/lib").mkdir(parents=True)
            (root / "nvidia/cu13/lib/libnvrtc.so.13").write_bytes(b"")
    if bindings_version is not None:
        (root / f"cuda_bindings-{bindings_version}.dist-info").mkdir()
    return root


def stamp_with_path(monkeypatch, site: Path) -> str:
    monkeypatch.setattr(sys, "path", [str(site)])
    monkeypatch.setattr(build, "nvrtc_version", lambda: (12, 8))      # what a loaded library would say
    return build.read_nvrtc_stamp()


def test_the_stamp_is_the_wheels_versions(tmp_path, monkeypatch):
    assert (stamp_with_path(monkeypatch, fake_site(tmp_path / "a", "13.5.37", "13.4.4"))
            == "nvidia-cuda-nvrtc 13.5.37; cuda-bindings 13.4.4")
    assert (stamp_with_path(monkeypatch, fake_site(tmp_path / "b", "13.5.40", "13.4.4"))
            == "nvidia-cuda-nvrtc 13.5.40; cuda-bindings 13.4.4")


@pytest.mark.parametrize("site", [("13.5.37", None, True), (None, "13.4.4", True), ("13.5.37", "13.4.4", False)],
                         ids=["no-bindings-metadata", "no-nvrtc-wheel", "wheel-without-its-library"])
def test_without_both_wheels_the_stamp_asks_the_library(tmp_path, monkeypatch, site):
    assert stamp_with_path(monkeypatch, fake_site(tmp_path / "s", *site)) == "nvrtcVersion 12.8"


def test_the_key_changes_with_the_stamp_and_only_with_it(monkeypatch, tmp_path):
    paths = {}
    for stamp in ("nvidia-cuda-nvrtc 13.5.37; cuda-bindings 13.4.4", "nvidia-cuda-nvrtc 13.6.0; cuda-bindings 13.4.4"):
        monkeypatch.setattr(build, "nvrtc_stamp", lambda stamp=stamp: stamp)
        paths[stamp] = build.cache_path("elementwise.cu", "sm_90", cache_dir=tmp_path)
        assert build.cache_path("elementwise.cu", "sm_90", cache_dir=tmp_path) == paths[stamp]
    assert len(set(paths.values())) == 2
    assert all(p.parent == tmp_path and p.name.startswith("elementwise-sm_90-") for p in paths.values())


def test_a_cache_hit_neither_imports_nor_loads_nvrtc(tmp_path):
    if build.nvrtc_stamp().startswith("nvrtcVersion"):
        pytest.skip("no NVRTC wheel here: the stamp comes from the library itself")
    for name in build.KERNEL_SOURCES:        # what a warm cache holds (the bytes are never loaded here)
        build.cache_path(name, "sm_90", cache_dir=tmp_path).write_bytes(b"cubin of " + name.encode())
    code = ("import sys\n"
            "from kernels_ptx import build\n"
            f"got = [build.compile_cubin(n, 'sm_90', cache_dir={str(tmp_path)!r})[0] for n in build.KERNEL_SOURCES]\n"
            "assert got == [b'cubin of ' + n.encode() for n in build.KERNEL_SOURCES], got\n"
            "print(sorted(m for m in sys.modules if 'nvrtc' in m))\n"
            "print(open('/proc/self/maps').read().count('libnvrtc'))\n")   # the libraries mapped in
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True)
    modules, mapped = proc.stdout.splitlines()
    assert modules == "[]" and mapped == "0"
