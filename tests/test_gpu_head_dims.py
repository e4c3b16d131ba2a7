"""On the device: head dims 96, 128 and 256 through a whole model in gpu, window, gated and layers=N against
the CPU engine — test_head_dims_emulated.py's checks on the real kernels (skipped without a GPU)."""
from __future__ import annotations

import numpy as np
import pytest

from hf_oracle import relative_error
from test_archs_emulated import engine_for, run
from test_head_dims_emulated import model   # noqa: F401  (a fixture)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["gpu", "window", "gated", "layers=1", "layers=2"])
def test_every_gpu_path_matches_the_cpu_engine_on_the_device(model, mode):  # noqa: F811
    _, weights, reference = model
    engine = engine_for(weights, mode)
    ours = run(engine)
    for position in range(len(ours)):
        assert relative_error(ours[position], reference[position]) < 2e-3, f"position {position}"
    np.testing.assert_array_equal(ours.argmax(axis=1), reference.argmax(axis=1))
    engine.close()
