"""CI: bench/host_experts.py's rows on the tiny MoE preset (the native kernels; no GPU)."""
from __future__ import annotations

import pytest

from bench import host_experts
from kestrel_stream import native
from kestrel_stream.loading.presets import PRESETS


def test_rows_time_the_chosen_experts_beside_a_dense_matmul():
    try:
        native.load()
    except native.NativeUnavailable:
        pytest.skip("no C compiler for the host kernels")
    cfg = PRESETS["qwen3-moe-tiny"]
    rows = host_experts.layer_rows("qwen3-moe-tiny", [1, 3], threads=1, isa=None, seconds=0.05)
    assert [r["tokens"] for r in rows] == [1, 3]
    assert rows[0]["experts_run"] == cfg.num_experts_per_tok        # one token: its k distinct experts
    assert cfg.num_experts_per_tok <= rows[1]["experts_run"] <= min(cfg.num_experts, 3 * cfg.num_experts_per_tok)
    assert all(r["us"] > 0 and r["GB_s"] > 0 and r["dense_us"] > 0 for r in rows)


def test_q4_k_experts_at_a_shape_of_whole_super_blocks():
    try:
        native.load()
    except native.NativeUnavailable:
        pytest.skip("no C compiler for the host kernels")
    from dataclasses import replace
    from kestrel_stream.loading import presets
    shape = replace(PRESETS["qwen3-moe-tiny"], hidden_size=256, moe_intermediate_size=256)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(presets.PRESETS, "q4k-experts-test", shape)
        rows = host_experts.layer_rows("q4k-experts-test", [1], threads=1, isa=None, seconds=0.05, fmt="Q4_K")
    assert rows[0]["format"] == "Q4_K" and rows[0]["experts_run"] == shape.num_experts_per_tok and rows[0]["GB_s"] > 0
