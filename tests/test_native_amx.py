"""Q8_0 matmuls on AMX tiles (host_amx.c, ISA amx) against the VNNI paths, each token alone and the twin; they
skip where the CPU has no AMX-INT8 or the kernel does not grant the tiles."""
from __future__ import annotations

import numpy as np
import pytest

from kestrel_stream import native
from kestrel_stream.model.quant import quantize
from kestrel_stream.native import twins


@pytest.fixture(scope="module")
def kernels():
    return native.load()


@pytest.mark.parametrize("threads", [1, 3])
def test_amx_tiles_give_the_lanes_kernels_bits(kernels, threads):
    """Q8_0 on AMX tiles, from one token: from 6 tokens (where the VNNI path runs tokens in lanes) the same bits
    as VNNI (the same int32 sums, the same float steps); at every step size each token's row the bits of that
    token alone (a session's numbers do not depend on the tokens beside it), the twin's numbers within the
    kernels' tolerance; rows past a multiple of 16, a glu's halves apart and token groups beyond 16 included;
    the same bits on any number of threads."""
    if "amx" not in kernels.supported:
        pytest.skip("no AMX-INT8 tiles here (or the kernel does not let this process use them)")
    rng = np.random.default_rng(70 + threads)
    amx = native.HostKernels(kernels.path, isa="amx", threads=threads)
    vnni = native.HostKernels(kernels.path, isa="avx512vnni", threads=threads)
    one = native.HostKernels(kernels.path, isa="amx", threads=1)
    for n, k in ((40, 256), (67, 1024), (256, 2048)):
        w = quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.02)
        on_amx, on_vnni, on_one = amx.prepare_q8_0(w.qs, w.scales), vnni.prepare_q8_0(w.qs, w.scales), one.prepare_q8_0(w.qs, w.scales)
        for t in (1, 2, 3, 5, 6, 9, 16, 17, 40):
            x = rng.standard_normal((t, k)).astype(np.float32)
            got = amx.matmul(x, on_amx)
            assert np.array_equal(got, one.matmul(x, on_one)), (n, k, t)
            if t >= 6:
                assert np.array_equal(got, vnni.matmul(x, on_vnni)), (n, k, t)
            for i in {0, t // 2, t - 1}:
                assert np.array_equal(got[i], amx.matmul(x[i:i + 1], on_amx)[0]), (n, k, t, i)
            expect = twins.matmul_q8_0(x, w.qs, w.scales)
            np.testing.assert_allclose(got, expect, rtol=0, atol=2e-6 * np.abs(expect).max(), err_msg=f"{n} {k} {t}")
    half = 35
    w = quantize(rng.standard_normal((2 * half, 512)).astype(np.float32) * 0.02)
    for kern in (amx, vnni):        # halves apart: the tiles' rows copied together where they are not at one stride
        apart = kern.prepare_q8_0_halves((w.qs[:half], w.scales[:half]), (w.qs[half:], w.scales[half:]))
        x = rng.standard_normal((7, 512)).astype(np.float32)
        assert np.array_equal(kern.linear(apart, glu=True)(x), kern.linear(kern.prepare_q8_0(w.qs, w.scales), glu=True)(x))
