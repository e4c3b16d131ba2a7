"""CI (no GPU): bench/moe_experts.py's sweep and summary on the emulated device, at a tiny model's shape."""
from __future__ import annotations

import numpy as np

import fake_cuda
from bench import moe_experts
from kestrel_stream.cuda import moe_kernels
from kestrel_stream.loading.presets import PRESETS


def test_sweep_times_the_gemvs_and_every_gemm_tile_beside_the_default(monkeypatch):
    fake_cuda.install(monkeypatch)
    from kestrel_stream.cuda import driver, kernels
    config = PRESETS["qwen3-moe-tiny"]                     # 8 experts, 2 a token: the GEMM from 32 tokens
    kernel_set = kernels.KernelSet(driver.Device(0))
    rows = moe_experts.run(kernel_set, driver.Arena(64 << 20), driver.Stream(), config, [4, 40], 2.0,
                           np.random.default_rng(0), repeats=2)
    by = {(r["tokens"], r["variant"]): r for r in rows}
    assert len(rows) == 2 * (len(moe_kernels.MMA_TILES) + 3)
    assert by[4, "default"]["kernels"] == "moe_experts_q8_0_g4_silu moe_experts_q8_0_g4"
    assert by[4, "gemv m8"]["kernels"] == "moe_experts_q8_0_m8_silu moe_experts_q8_0_m8"
    assert by[40, "default"]["kernels"] == "moe_mma_q8_0_16x64_silu moe_mma_q8_0_16x64"
    assert by[40, "gemv g4"]["kernels"].startswith("moe_experts_q8_0_g4") and by[4, "gemm 64x64"]["kernels"].startswith("moe_mma")
    assert all(r["active_experts"] <= config.num_experts and r["most_tokens"] <= r["tokens"] for r in rows)
    table = moe_experts.summary(rows)
    assert [t["tokens"] for t in table] == [4, 40] and all(t["best_us"] <= t["default_us"] for t in table)
    assert kernel_set.moe_mma_min_tokens is None and kernel_set.moe_mma_tile is None and kernel_set.moe_gemv is None
