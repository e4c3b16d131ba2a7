"""The names the executors and sessions' caches had before one executor served every mode; each is the
one StepExecutor (step_executor.py) or what it hands out."""
from __future__ import annotations

from kestrel_stream.model.weights import ModelWeights
from kestrel_stream.run.device.budget import DEFAULT_MAX_SESSIONS  # noqa: F401  (the block-table rows by default)
from kestrel_stream.run.device.kv_paged import PagedKV
from kestrel_stream.run.mixed import HybridKV  # noqa: F401  (sessions' caches: host and device layers)
from kestrel_stream.run.step_executor import StepExecutor

GpuExecutor = StepExecutor          # gpu mode's executor: StepExecutor(weights) builds gpu mode
HybridExecutor = StepExecutor       # gated / layers=N: StepExecutor(weights, mode, profile, ...)
DeviceExecutor = StepExecutor       # the offloading modes' executor
GpuKV = PagedKV                     # the name sessions' caches had before the pool


def CpuExecutor(weights: ModelWeights) -> StepExecutor:        # noqa: N802  (the name cpu mode's executor had)
    """The executor in cpu mode: every step on the host backend."""
    return StepExecutor(weights, "cpu")
