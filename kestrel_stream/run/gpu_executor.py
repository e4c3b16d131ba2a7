"""`GpuExecutor`: the name gpu mode's executor has always had, the one StepExecutor (step_executor.py).

GpuExecutor(weights, max_seq_len=..., ...) builds it in its default mode, gpu.
"""
from __future__ import annotations

from kestrel_stream.run.budget import DEFAULT_MAX_SESSIONS  # noqa: F401  (the block-table rows by default)
from kestrel_stream.run.kv_paged import PagedKV
from kestrel_stream.run.step_executor import StepExecutor

GpuExecutor = StepExecutor
GpuKV = PagedKV          # the name sessions' caches had before the pool
