"""cpu mode is a mode of the one executor class (run/step_executor.py): no device backend, every step on
the host backend (run/host.py), with the numbers the host backend computes on its own; its module imports
nothing of the CUDA layer until a device mode is built."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from kestrel_stream.run.engine import Engine
from kestrel_stream.run.executor import Executor
from kestrel_stream.run.host import HostBackend
from kestrel_stream.run.compat import CpuExecutor, StepExecutor
from test_executors_emulated import CONFIGS
from bench.synthetic import random_q8_weights

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_mode_is_the_one_class_over_the_host_backend():
    weights = random_q8_weights(CONFIGS["llama"], seed=5)
    engine = Engine(weights, device="cpu", max_seq_len=64, max_batch=4)
    executor = engine.executor
    assert type(executor) is StepExecutor and isinstance(executor, Executor) and executor.name == "cpu"
    assert executor.backend is None, "cpu mode builds no device backend"
    assert not isinstance(executor.steps, Executor), "the host backend is a backend, not an executor"
    assert executor.steps.counters is executor.counters
    assert executor.plan(3).segments[0].side == "cpu" and len(executor.plan(3).segments) == 1

    reference = HostBackend(weights, options=engine.options)   # the arithmetic on its own: the executor's numbers, exactly
    prompt = np.array([5, 3, 200, 17, 42], np.int64)
    ours = executor.forward([(executor.alloc_kv(16), prompt, 0)])[0]
    theirs = reference.forward([(reference.alloc_kv(16), prompt, 0)])[0]
    assert np.array_equal(ours, theirs)
    assert executor.stats["steps"] == 1 and executor.stats["tokens"] == len(prompt)
    assert executor.stats["cpu_weight_read_bytes"] == reference.counters.cpu_weight_read_bytes > 0

    legacy = CpuExecutor(weights)               # the name cpu mode's executor had: numpy's reference arithmetic
    assert type(legacy) is StepExecutor and legacy.name == "cpu" and legacy.steps.kernels is None
    numpy_reference = HostBackend(weights)
    kv = legacy.alloc_kv(16)
    assert np.array_equal(legacy.forward([(kv, prompt, 0)])[0],
                          numpy_reference.forward([(numpy_reference.alloc_kv(16), prompt, 0)])[0])
    child = legacy.fork_kv(kv, 3, 8)
    assert child.capacity == 8 and np.array_equal(child.k[:, :3], kv.k[:, :3])
    assert legacy.forward_greedy([(kv, [7], len(prompt))]).dtype == np.int64 and legacy.kv_stats() == {}
    legacy.truncate_kv(kv, 2)
    legacy.free_kv(kv)
    legacy.close()
    engine.close()


CPU_ONLY = """\
import sys
sys.modules["cuda"] = None              # as where the CUDA wheels are not installed
import kestrel_stream as ks
import kestrel_stream.run.step_executor, kestrel_stream.run.verify
engine = ks.load(sys.argv[1], device="cpu", max_seq_len=64)
assert len(engine.generate([5, 3, 200], 4).tokens) == 4
assert len(engine.generate([5, 3, 200], 4, temperature=0.8, seed=1).tokens) == 4
bad = [m for m in ("kestrel_stream.cuda.driver", "kestrel_stream.cuda.kernels") if m in sys.modules]
assert not bad, bad
"""


def test_cpu_mode_imports_no_cuda_layer(tiny_model):
    """Building and stepping (greedy and sampled) the CPU engine loads no module of cuda.bindings' users."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", CPU_ONLY, str(tiny_model)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
