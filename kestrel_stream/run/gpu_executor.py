"""`GpuExecutor`: the name gpu mode's executor has always had, the one DeviceExecutor (device_executor.py).

GpuExecutor(weights, max_seq_len=..., ...) builds it in its default mode, gpu.
"""
from __future__ import annotations

from kestrel_stream.run.budget import DEFAULT_MAX_SESSIONS  # noqa: F401  (the block-table rows by default)
from kestrel_stream.run.device_executor import DeviceExecutor
from kestrel_stream.run.graph_steps import GpuKV  # noqa: F401  (sessions' caches: kv_paged.PagedKV)

GpuExecutor = DeviceExecutor
