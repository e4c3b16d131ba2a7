"""On the device: Llama 3.x (rope scaling, head_dim 32), Mistral (sliding window, head_dim 80), Qwen2
(q/k/v bias, YaRN) and Qwen3 in gpu, window, gated and layers=N against the CPU engine and against
transformers (skipped where transformers is not installed) — the same checks as test_archs_emulated.py,
on the real kernels (skipped without a GPU)."""
from __future__ import annotations

import pytest

from hf_oracle import assert_logits_match
from test_archs_emulated import engine_for, model, run, transformers_logits   # noqa: F401  (model: a fixture)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["gpu", "window", "gated", "layers=1", "layers=2"])
def test_every_gpu_path_matches_the_cpu_engine_on_the_device(model, mode):  # noqa: F811
    weights, reference = model
    engine = engine_for(weights, mode)
    ours = run(engine)
    assert_logits_match(ours, reference)
    engine.close()


@pytest.mark.parametrize("mode", ["gpu", "window", "gated", "layers=1", "layers=2"])
def test_every_gpu_path_matches_transformers_on_the_device(model, mode):  # noqa: F811
    weights, reference = model
    expected = transformers_logits(weights, reference)
    engine = engine_for(weights, mode)
    ours = run(engine)
    assert_logits_match(ours, expected)
    engine.close()
