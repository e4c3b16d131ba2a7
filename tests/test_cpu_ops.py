"""The CPU executor's faster forms of the reference ops give the reference's numbers bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from kestrel_stream.run.host import apply_rope, rope_rotation, rope_tables, rotate


@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 6, 64), (5, 3, 128), (2, 1, 256)])
def test_rotate_is_apply_rope_exactly(tokens, heads, head_dim):
    rng = np.random.default_rng(tokens * heads)
    x = rng.standard_normal((tokens, heads, head_dim)).astype(np.float32) * 10
    positions = rng.integers(0, 40_000, tokens)
    cos, sin = rope_tables(positions, head_dim, 1_000_000.0)
    want = apply_rope(x, cos, sin)
    got = rotate(x, *rope_rotation(cos, sin))
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got, want)                # not approximately: the CPU engine is the reference


def test_rotation_tables_index_like_the_plain_ones():
    cos, sin = rope_tables(np.arange(300), 64, 10_000.0)
    table_cos, table_sin, swap = rope_rotation(cos, sin)
    rows = np.array([299, 0, 17])
    x = np.random.default_rng(1).standard_normal((3, 2, 64)).astype(np.float32)
    assert np.array_equal(rotate(x, table_cos[rows], table_sin[rows], swap), apply_rope(x, cos[rows], sin[rows]))
