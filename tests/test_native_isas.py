"""Which host-kernel path runs where: an ISA a CPU lacks between others is never chosen, and the 256-bit VNNI
(AVX-VNNI) kernels give the AVX-512 ones' bits.  The kernels against their twins: test_native_kernels.py."""
from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest

from bench.synthetic import random_blocks
from kestrel_stream import native

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(scope="module")
def kernels():
    return native.load()


def test_an_isa_the_cpu_lacks_between_others_is_never_chosen():
    from kestrel_stream.native.kernels import pick_isa
    ice_lake = ("scalar", "avx2", "avx512vnni")                     # AVX-512 VNNI, no AVX-VNNI
    assert pick_isa(ice_lake, "avxvnni") == "avx2"
    assert pick_isa(ice_lake, "amx") == pick_isa(ice_lake, None) == "avx512vnni"
    alder_lake = ("scalar", "avx2", "avxvnni")                      # AVX-VNNI, no AVX-512
    assert pick_isa(alder_lake, "amx") == "avxvnni" and pick_isa(alder_lake, "avx2") == "avx2"


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K"])
def test_the_256_bit_vnni_kernels_are_the_512_bit_ones_bit_for_bit(kernels, fmt):
    """The repacked K-quants on AVX-VNNI (8 rows a vector, two tokens a pass) give each row the integer sums and
    float steps of the AVX-512 kernels (16 rows, four tokens): the same bits, at every token count and a last
    group of fewer than 8 and of 8-16 rows."""
    both = {"avxvnni", "avx512vnni"}
    if not both <= set(kernels.supported):
        pytest.skip(f"this CPU has {', '.join(kernels.supported)}: not both 256- and 512-bit VNNI")
    rng = np.random.default_rng(3)
    narrow, wide = kernels.with_isa("avxvnni"), kernels.with_isa("avx512vnni")
    for n in (21, 37, 16):
        blocks = random_blocks(rng, fmt, n, 768, 0.02)
        a, b = narrow.prepare_blocks(fmt, blocks, 768), wide.prepare_blocks(fmt, blocks, 768)
        for t in (1, 2, 3, 5, 9):
            x = rng.standard_normal((t, 768)).astype(np.float32)
            assert np.array_equal(narrow.matmul(x, a), wide.matmul(x, b)), (fmt, n, t)


@pytest.mark.parametrize("amx_min_tokens", [5, 1])
def test_repacked_q4_k_on_amx_tiles_is_the_vnni_kernel_bit_for_bit(kernels, amx_min_tokens):
    """Repacked Q4_K from ks_kq_amx_min_tokens tokens on AMX tiles (up to 8 tokens in one pass on the stacked
    levels, more 16 tokens a pass): the VNNI kernel's integer sums and float steps, so the same bits at every
    token count (a partial last pass of tokens and of rows, several passes, a glu's halves) and the same numbers
    whatever tokens share a step; with the threshold at 1, every count of the stacked form."""
    if "amx" not in kernels.supported:
        pytest.skip(f"this CPU has {', '.join(kernels.supported)}: no AMX tiles")
    rng = np.random.default_rng(11)
    tiles, vnni = kernels.with_isa("amx"), kernels.with_isa("avx512vnni")
    threshold = ctypes.c_int.in_dll(kernels._lib, "ks_kq_amx_min_tokens")
    kept, threshold.value = threshold.value, amx_min_tokens
    try:
        check_q4_k_tiles(rng, tiles, vnni)
    finally:
        threshold.value = kept


def check_q4_k_tiles(rng, tiles, vnni):
    for n, k in ((37, 768), (16, 256), (130, 2048)):
        blocks = random_blocks(rng, "Q4_K", n, k, 0.02)
        a, b = tiles.prepare_blocks("Q4_K", blocks, k), vnni.prepare_blocks("Q4_K", blocks, k)
        x = rng.standard_normal((40, k)).astype(np.float32)
        x[:, ::17] *= 20                                             # outlier channels: both levels matter
        for t in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 20, 33, 34, 35, 40):      # last passes of 1-8 tokens
            got = tiles.matmul(x[:t], a)
            assert np.array_equal(got, vnni.matmul(x[:t], b)), (n, k, t)
            assert np.array_equal(got[-1], tiles.matmul(x[t - 1:t], a)[0]), (n, k, t)   # alone: the same row
