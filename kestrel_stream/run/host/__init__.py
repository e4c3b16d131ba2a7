"""The host backend: numpy arithmetic (arithmetic.py), the step program's op table (program.py), and the
backend that holds the host's weights, rope tables and KV caches (backend.py)."""
from kestrel_stream.run.host.arithmetic import (apply_rope, attention, model_rope_tables, rmsnorm,  # noqa: F401
                                                rope_rotation, rope_tables, rotate, silu_mul)
from kestrel_stream.run.host.backend import CpuKV, HostBackend  # noqa: F401
