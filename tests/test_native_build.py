"""The native library builds on every x86 CPU it meets, not only on this one: `-march=native` enables only the
building machine's extensions, so an intrinsic used under a target attribute that does not name its extension
(an AVX-512 DQ `_mm512_and_ps` in a function targeted at AVX-512 F/BW/VL/VNNI) builds here, where -march=native
has them all, and stops the whole build on an AVX2 laptop, whose CPU engine then falls back to numpy.  Built with
other CPUs' -march (after -march=native, so theirs wins), the library must compile, and one built for an AVX2 CPU
runs every path this CPU has with the numbers of the twin (the ISA is the CPU's, found at run time)."""
from __future__ import annotations

import platform
import shutil
import subprocess

import numpy as np
import pytest

from kestrel_stream import native
from kestrel_stream.native.build import NativeBuildError, build_library
from test_native_kernels import assert_formats_match_twin

pytestmark = [pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler"),
              pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64", "i686"), reason="x86 CPUs' -march")]

# an AVX2 CPU (Haswell .. Zen 3), AVX-VNNI without AVX-512 (Alder Lake), AVX-512 VNNI without AMX (Ice Lake),
# AMX (Sapphire Rapids), and x86-64's baseline (no AVX at all)
MARCHES = ("x86-64", "haswell", "znver3", "alderlake", "icelake-server", "sapphirerapids")


def compiler_knows(march: str) -> bool:
    done = subprocess.run([shutil.which("cc"), f"-march={march}", "-E", "-x", "c", "-"], input="", capture_output=True,
                          text=True)
    return done.returncode == 0


@pytest.mark.parametrize("march", MARCHES)
def test_the_library_builds_for_other_cpus(tmp_path, march):
    if not compiler_knows(march):
        pytest.skip(f"this compiler does not know -march={march}")
    try:
        path = build_library(tmp_path, extra_flags=(f"-march={march}", "-O1"))
    except NativeBuildError as e:
        pytest.fail(f"-march={march}: {str(e)[:2000]}")
    assert path.exists()


def test_a_library_built_for_an_avx2_cpu_runs_every_path_here(tmp_path):
    if not compiler_knows("haswell"):
        pytest.skip("this compiler does not know -march=haswell")
    avx2_built = native.HostKernels(build_library(tmp_path, extra_flags=("-march=haswell",)), threads=2)
    assert avx2_built.supported == native.load().supported     # found at run time, whatever the build's -march
    assert_formats_match_twin([avx2_built.with_isa(isa) for isa in avx2_built.supported], np.random.default_rng(17),
                              0, (1, 7))
