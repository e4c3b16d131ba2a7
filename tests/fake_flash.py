"""numpy twin of kernels_ptx/flash_attention.cu over the emulated device memory of fake_cuda.

It checks the launch geometry and the 16-byte alignment of the K/V rows the kernel loads by
cp.async, and writes what the kernel writes: per query row, softmax over keys first..pos of its
session (keys and values from the paged f16 pool) with the kernel's roundings: q * scale and the
probabilities rounded to f16 for the tensor cores, scores, sums and the output in float32.
"""
from __future__ import annotations

import numpy as np

from fake_cuda import dev
from fake_kernels import f32, paged_rows, tree_sees
from kestrel_stream.cuda import flash_attention as fa


def flash_attention_paged(launch, q, tables, table_row, pos, out, ntok, layer, n_layers, n_heads, n_kv,
                          window, softmax_scale, block_shift, tree=0) -> None:
    D = int(launch.name.split("_d")[1].split("_")[0])
    group = n_heads // n_kv
    assert D in fa.FLASH_HEAD_DIMS and n_heads % n_kv == 0 and fa.flash_supported(D, "f16", group)
    assert launch.grid == (n_kv, -(-ntok // fa.tile_tokens(group)), 1), (launch.grid, ntok, group)
    assert launch.block == (fa.FLASH_THREADS, 1, 1)
    bs = 1 << block_shift
    for t in range(ntok):
        p = int(dev(pos + 4 * t, 4, np.int32)[0])
        first = max(p - window + 1, 0) if window > 0 else 0
        block = paged_rows(tables, table_row, t, block_shift, np.float16, n_layers, n_kv, D)
        blocks = [block(b) for b in range(0, p + 1, bs)]
        assert all(b.ctypes.data % 16 == 0 for b in blocks), "cp.async reads 16-byte aligned K/V rows"
        cache = np.concatenate([b[:, layer] for b in blocks])[first:p + 1].astype(np.float32)
        keys, values = cache[:, 0], cache[:, 1]                                   # [n_keys, n_kv, D]
        qt = f32(q + 4 * t * n_heads * D, n_heads * D).reshape(n_kv, group, D)
        qt = (qt * np.float32(softmax_scale)).astype(np.float16).astype(np.float32)
        scores = np.einsum("hgd,phd->hgp", qt, keys)
        scores = np.where(tree_sees(tree, t, p, np.arange(first, p + 1)), scores, np.float32(-np.inf))
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        rounded = probs.astype(np.float16).astype(np.float32)
        attended = np.einsum("hgp,phd->hgd", rounded, values) / probs.sum(axis=-1, keepdims=True)
        f32(out + 4 * t * n_heads * D, n_heads * D)[:] = attended.reshape(-1)
