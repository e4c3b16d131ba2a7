"""On the device: head dims 96, 128 and 256 through a whole model in gpu, window, gated and layers=N against
the CPU engine — test_head_dims_emulated.py's checks on the real kernels (skipped without a GPU)."""
from __future__ import annotations

import pytest

from hf_oracle import assert_logits_match
from test_archs_emulated import engine_for, run
from test_head_dims_emulated import model   # noqa: F401  (a fixture)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["gpu", "window", "gated", "layers=1", "layers=2"])
def test_every_gpu_path_matches_the_cpu_engine_on_the_device(model, mode):  # noqa: F811
    _, weights, reference = model
    engine = engine_for(weights, mode)
    ours = run(engine)
    assert_logits_match(ours, reference)
    engine.close()
