"""CI (no GPU): which split-key attention kernel and how many key splits a step's launch gets."""
import pytest

from kestrel_stream.cuda.flash_attention import partial_floats, split_count
from kestrel_stream.cuda.kernels import SMALL_GROUP_ATTENTION, paged_attention_launch


class Recorder:
    def launch(self, name, grid, block, signature, args, shared_bytes=0):
        assert len(signature) == len(args)
        return name, grid


def launch(n_heads, n_kv, head_dim, kv_dtype, tokens=32):
    return paged_attention_launch(Recorder(), 1, 2, 3, 4, 5, 6, 7, tokens, 0, 28, n_heads, n_kv, head_dim,
                                  split_count(tokens, n_kv, 16), 4, kv_dtype)


@pytest.mark.parametrize("n_heads,n_kv", [(16, 8), (8, 8)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_small_groups_on_f16_get_the_two_head_kernel(n_heads, n_kv, head_dim):
    name, grid = launch(n_heads, n_kv, head_dim, "f16")
    assert name == f"attention_paged_d{head_dim}_f16_g2" and grid == (n_kv, 32, 4)


@pytest.mark.parametrize("n_heads,n_kv,head_dim,kv_dtype", [(32, 8, 128, "f16"), (16, 8, 128, "f32"),
                                                            (16, 8, 80, "f16"), (24, 8, 64, "f16")])
def test_other_shapes_get_the_general_kernel(n_heads, n_kv, head_dim, kv_dtype):
    name, _ = launch(n_heads, n_kv, head_dim, kv_dtype)
    assert name == f"attention_paged_d{head_dim}_{kv_dtype}"
    assert (head_dim, kv_dtype) not in SMALL_GROUP_ATTENTION or n_heads > 2 * n_kv


def test_every_small_group_entry_is_defined_in_the_source():
    import re

    from kernels_ptx import build
    source = (build.source_dir() / "attention.cu").read_text()
    defined = {(int(d), dtype) for d, dtype in re.findall(r"^DEFINE_PAGED_ATTENTION_G\((\d+), (\w+), \w+, 2, _g2\)",
                                                          source, re.M)}
    assert defined == SMALL_GROUP_ATTENTION


@pytest.mark.parametrize("n_kv", [2, 8])
@pytest.mark.parametrize("max_tokens", [1, 8, 64, 512])
def test_the_partials_hold_every_step_up_to_the_largest(n_kv, max_tokens):
    """Each step of 1..max_tokens rows fits the partials (its rows x splits x q heads x (head_dim + 2)), and
    the buffer is no larger than the step with the most (row, split) pairs needs -- a decode step of 8
    rows at 16 splits, not max_tokens x 16."""
    n_heads, head_dim = 4 * n_kv, 128
    size = partial_floats(max_tokens, n_heads, n_kv, head_dim, 16)
    needs = [t * split_count(t, n_kv, 16) * n_heads * (head_dim + 2) for t in range(1, max_tokens + 1)]
    assert max(needs) == size
    if max_tokens == 512:
        assert size < max_tokens * 16 * n_heads * (head_dim + 2) / 8
