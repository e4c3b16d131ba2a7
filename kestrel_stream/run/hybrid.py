"""`HybridExecutor`: the name the gated and layers=N executor has always had, the one StepExecutor
(step_executor.py).

HybridExecutor(weights, mode, profile, max_seq_len=..., ...) builds it in a mode with host segments.
"""
from __future__ import annotations

from kestrel_stream.run.segment_steps import HybridKV  # noqa: F401  (sessions' caches: host and device layers)
from kestrel_stream.run.step_executor import StepExecutor

HybridExecutor = StepExecutor
