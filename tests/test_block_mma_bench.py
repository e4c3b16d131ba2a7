"""CI (no GPU): bench/block_mma.py's sweep and summary on the emulated device, at small shapes."""
from __future__ import annotations

import numpy as np

import fake_cuda
from bench import block_mma


def test_sweep_times_every_tile_and_split_beside_the_default(monkeypatch):
    fake_cuda.install(monkeypatch)
    from kestrel_stream.cuda import driver, gemv_variants, kernels
    models = {"toy": {"qkv": (96, 512), "o": (64, 512), "gate_up": (128, 512), "down": (64, 1024),
                      "lm_head": (200, 512), "qkv_v": 32}}
    arena = driver.Arena(256 << 20)
    rows = block_mma.run(kernels.KernelSet(driver.Device(0)), arena, driver.Stream(), models, ["Q4_K", "Q4_K+Q6_K"],
                         [4, 11, 70], [1, 2, 4], np.random.default_rng(0), repeats=2)
    down_11 = {r["variant"]: r for r in rows if r["projection"] == "down" and r["tokens"] == 11 and r["format"] == "Q4_K"}
    assert set(down_11) == {"default", *gemv_variants.HMMA_BLOCK_VARIANTS["Q4_K"], "mma16s1", "mma16s2", "mma16s4",
                            "mma16", "mmas1", "mma"}
    assert {"hk8", "hk4", "hk4r2", "hk2r2", "hk4p", "hk2p"} <= set(down_11)
    assert down_11["hk2p"]["kernel"] == "q4k_hmma_t16_k2p"
    assert down_11["default"]["kernel"] == "q4k_hmma_t16_k4" and down_11["mma16s4"]["grid"] == "1x1x4"
    assert down_11["hk4r2"]["kernel"] == "q4k_hmma_t16_k4r2" and down_11["mma16"]["kernel"] == "q4_k_mma16"
    qkv = {(r["format"], r["variant"]) for r in rows if r["projection"] == "qkv" and r["tokens"] == 11}
    assert ("Q4_K+Q6_K", "default") in qkv and not any(v.startswith("hk") for f, v in qkv if f == "Q4_K+Q6_K")
    assert {r["kernel"] for r in rows if r["tokens"] == 4 and r["variant"] == "default"} >= {"q4_k_gemv_m4_g64r4u1"}
    assert not any(r["variant"].startswith("mma16") for r in rows if r["tokens"] == 70)
    table = block_mma.summary(rows)
    assert len(table) == len({(r["format"], r["projection"], r["tokens"]) for r in rows})
    assert all(t["best_us"] <= t["default_us"] for t in table)
