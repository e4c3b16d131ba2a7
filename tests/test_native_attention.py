"""The native attention of a prompt's chunk (query tiles, an online softmax) against numpy's attention,
the host backend's reference: every chunk size around the tile, causal and windowed, each GQA group."""
from __future__ import annotations

import numpy as np
import pytest

from kestrel_stream import native
from kestrel_stream.run import host


@pytest.fixture(scope="module")
def kernels():
    return native.load()


def chunk(rng, n, start, heads, n_kv, d, kv_dtype):
    q = rng.standard_normal((n, heads, d)).astype(np.float32)
    k = rng.standard_normal((start + n + 3, n_kv, d)).astype(kv_dtype)     # rows past the chunk are not read
    v = rng.standard_normal((start + n + 3, n_kv, d)).astype(kv_dtype)
    return q, k, v


def check(kernels, q, k, v, start, window, tiled=True):
    s = start + q.shape[0]
    expect = host.attention(q, k[:s].astype(np.float32), v[:s].astype(np.float32), start, window)
    got = kernels.attention(q, k, v, start, window, tiled=tiled)
    np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-5 * np.abs(expect).max())


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("start", [0, 29])
def test_every_chunk_size_around_the_tile(kernels, kv_dtype, start):
    rng = np.random.default_rng(start)
    for n in range(1, 71):
        check(kernels, *chunk(rng, n, start, 8, 4, 64, kv_dtype), start, None)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
def test_each_group_and_head_size(kernels, group, d, kv_dtype):
    rng = np.random.default_rng(group * d)
    n_kv = 2
    for n, start in ((5, 0), (17, 40), (64, 3)):
        check(kernels, *chunk(rng, n, start, n_kv * group, n_kv, d, kv_dtype), start, None)


@pytest.mark.parametrize("window", [1, 5, 16, 33])
@pytest.mark.parametrize("start", [0, 50])
def test_a_sliding_window_as_the_reference(kernels, window, start):
    rng = np.random.default_rng(window + start)
    for n in (1, 9, 40, 70):
        check(kernels, *chunk(rng, n, start, 8, 2, 64, np.float16), start, window)


def test_strided_views_and_thread_counts_change_no_result(kernels):
    rng = np.random.default_rng(5)
    n, start, heads, n_kv, d = 37, 12, 16, 8, 128
    q, k, v = chunk(rng, n, start, heads, n_kv, d, np.float32)
    qkv = rng.standard_normal((n, heads + 10, d)).astype(np.float32)
    qkv[:, :heads] = q
    one = native.HostKernels(kernels.path, threads=1).attention(qkv[:, :heads], k, v, start, tiled=True)
    two = native.HostKernels(kernels.path, threads=2).attention(qkv[:, :heads], k, v, start, tiled=True)
    assert np.array_equal(one, two)
    out = np.zeros((n, heads * d + 8), np.float32)
    kernels.attention(q, k, v, start, tiled=True, out=out[:, :heads * d])
    assert np.array_equal(out[:, :heads * d], one) and not out[:, heads * d:].any()


def test_large_scores_do_not_overflow_the_running_sum(kernels):
    rng = np.random.default_rng(9)
    q, k, v = chunk(rng, 24, 100, 4, 2, 64, np.float32)
    q *= 30.0                                   # scores of several hundred: the running max rescales
    check(kernels, q, k, v, 100, None)


def test_the_portable_build_runs_the_chunk_kernel(tmp_path):
    """Without the x86 SIMD code and _Float16 (the fallback every ISA test can force): the same results."""
    from kestrel_stream.native.build import build_library
    portable = native.HostKernels(build_library(tmp_path, extra_flags=("-DKS_NO_X86", "-DKS_NO_FLOAT16")), threads=2)
    rng = np.random.default_rng(3)
    for kv_dtype in (np.float32, np.float16):
        for n, start, window in ((1, 0, None), (13, 7, None), (40, 20, 9)):
            check(portable, *chunk(rng, n, start, 8, 2, 64, kv_dtype), start, window)
