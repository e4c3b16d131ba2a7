"""`DeviceExecutor`: the name the offloading modes' executor had, the one StepExecutor (step_executor.py)."""
from __future__ import annotations

from kestrel_stream.run.step_executor import DeviceExecutor, StepExecutor  # noqa: F401
