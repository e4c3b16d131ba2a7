"""The whole cpu step as one native call (run/host/native_program.py) against the same ops called one by
one from the host program: the same logits and caches bit for bit, for decode, prefill, several sessions
in one step and lm_head on chosen rows, on Q8_0 and on a Q4_K_M mix (a qkv of two formats); numpy's
segments stay per-op.  Routed layers: test_native_routed.py."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from bench.make_gguf import write as write_gguf
from hf_oracle import assert_logits_match
from bench.synthetic import random_q8_weights
from kestrel_stream import native
from kestrel_stream.loading.loader import load_weights
from kestrel_stream.obs import trace
from kestrel_stream.options import Options
from kestrel_stream.run.host import HostBackend
from kestrel_stream.run.host.backend import session_runs
from kestrel_stream.run.host.native_program import NativeProgram
from kestrel_stream.run.host.program import HostState
from scheduler.ops import runs_alone
from test_executors_emulated import CONFIGS
from test_quant4 import CFG

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
NATIVE = Options.from_env().with_(host_kernels="native")
HOST_ISAS_HERE = native.load().supported if shutil.which("cc") else ()


@pytest.fixture(scope="module", params=["q8_0-qwen3", "q8_0-llama", "q4_k_m-qwen3"])
def weights(request, tmp_path_factory):
    if request.param == "q4_k_m-qwen3":
        path = tmp_path_factory.mktemp("mix") / "m.gguf"
        write_gguf(CFG, None, str(path), seed=3, mix="q4_k_m")
        return load_weights(path)
    return random_q8_weights(CONFIGS[request.param.split("-")[1]], seed=4)


def step_inputs(backend, batch, logits):
    ids, positions, runs = session_runs(batch)
    cos, sin = backend.rope(positions)
    return ids, runs, cos, sin, np.asarray([hi - 1 for _, _, hi, _ in runs]) if logits == "last" else None


def per_op(backend, batch, logits):
    """The same step through HostProgram's calls one by one (what a traced step runs)."""
    program = backend.program(backend.plan(1).segments[0].ops)
    state = HostState(*step_inputs(backend, batch, logits))
    for call in program.calls:
        call(state)
    return state.read("logits")


def one_call(backend, batch, logits):
    """The step as one library call."""
    program = NativeProgram.bind(backend, backend.plan(1).segments[0].ops)
    assert program is not None
    return program.run(*step_inputs(backend, batch, logits))


def test_one_call_is_the_per_op_calls_bit_for_bit(weights):
    one, ops = HostBackend(weights, options=NATIVE), HostBackend(weights, options=NATIVE)
    assert NativeProgram.bind(one, one.plan(1).segments[0].ops) is not None
    kv_one = [one.alloc_kv(32), one.alloc_kv(24)]
    kv_ops = [ops.alloc_kv(32), ops.alloc_kv(24)]
    steps = [([[5, 3, 200]], [0], "all"),                         # a short prompt
             ([[7]], [3], "all"),                                 # a decode step
             ([[9, 8, 7], [11]], [0, 4], "last"),                 # a prompt of the second session beside a decode
             ([[1], [2]], [5, 3], "all"),                         # two decodes at different positions
             ([[4, 5, 6, 7], [8, 9, 10, 11]], [6, 4], "last"),    # 8 rows: tokens in lanes (VNNI)
             ([list(range(20, 38))], [10], "last")]               # a prompt's chunk: the tiled attention
    for tokens, starts, logits in steps:
        sessions = range(len(tokens))
        batch = [(kv_one[s], np.array(tokens[s]), starts[s]) for s in sessions]
        got = one_call(one, batch, logits)
        expect = per_op(ops, [(kv_ops[s], np.array(tokens[s]), starts[s]) for s in sessions], logits)
        assert np.array_equal(np.concatenate(got) if isinstance(got, list) else got, expect), (tokens, starts)
        for a, b in zip(kv_one, kv_ops):
            assert np.array_equal(a.k, b.k) and np.array_equal(a.v, b.v)


def test_the_engine_runs_its_steps_as_one_call(weights, monkeypatch):
    """HostBackend.forward calls the library once a step: decode steps, short prompts and a prompt's chunk."""
    backend = HostBackend(weights, options=NATIVE)
    kv, ran = backend.alloc_kv(16), []
    real = NativeProgram.run
    monkeypatch.setattr(NativeProgram, "run", lambda self, *a: ran.append(len(a[0])) or real(self, *a))
    backend.forward([(kv, np.array([1, 2, 3]), 0)])
    backend.forward([(kv, np.array([4]), 3)])
    backend.forward([(kv, np.arange(5, 12), 4)])
    assert ran == [3, 1, 7]


def test_it_counts_the_bytes_the_per_op_program_counts(weights):
    one, ops = HostBackend(weights, options=NATIVE), HostBackend(weights, options=NATIVE)
    one.forward([(one.alloc_kv(8), np.array([1, 2, 3]), 0)])
    per_op(ops, [(ops.alloc_kv(8), np.array([1, 2, 3]), 0)], "all")
    assert one.counters.cpu_weight_read_bytes == ops.counters.cpu_weight_read_bytes > 0


def test_a_trace_times_each_op_inside_the_one_call(weights, tmp_path, monkeypatch):
    """Traced, the step still runs as one library call (what an untraced step runs), and its ops come back
    as host slices read from the library's clock: one per op of the step program, in its order, back to
    back inside the step, named as the per-op program names them."""
    backend = HostBackend(weights, options=NATIVE)
    kv = backend.alloc_kv(8)
    plain = backend.forward([(kv, np.array([4, 5]), 0)])[0]
    ran = []
    real = NativeProgram.run
    monkeypatch.setattr(NativeProgram, "run", lambda self, *a: ran.append(len(a[0])) or real(self, *a))
    trace.start(tmp_path / "t.json")
    try:
        with trace.active.step(2):
            traced = backend.forward([(backend.alloc_kv(8), np.array([4, 5]), 0)])[0]
    finally:
        written = trace.stop()
    assert np.array_equal(plain, traced) and ran == [2]
    events = json.loads(written.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    (step,) = [e for e in events if e.get("ph") == "X" and e["name"] == "step"]
    slices = sorted((e for e in events if e.get("ph") == "X" and e.get("args", {}).get("segment") == "cpu"),
                    key=lambda e: e["ts"])
    ops = [op for op in backend.plan(1).segments[0].ops if runs_alone(op)]     # norms run inside projections
    assert [e["args"]["op"] for e in slices] == [op.name for op in ops]
    assert [e["name"] for e in slices] == [op.group or op.kind for op in ops]
    assert all(e["dur"] >= 0 for e in slices) and sum(e["dur"] for e in slices) > 0
    for before, after in zip(slices, slices[1:]):
        assert before["ts"] + before["dur"] <= after["ts"] + 1e-3
    assert step["ts"] <= slices[0]["ts"] and slices[-1]["ts"] + slices[-1]["dur"] <= step["ts"] + step["dur"] + 1e-3
    names = [e["name"] for e in slices]
    assert names.count("attention") == weights.config.num_hidden_layers and names.count("lm_head") == 1


def test_numpy_keeps_the_per_op_program():
    numpy_backend = HostBackend(random_q8_weights(CONFIGS["qwen3"], seed=1))
    assert numpy_backend.kernels is None
    assert NativeProgram.bind(numpy_backend, numpy_backend.plan(1).segments[0].ops) is None


def test_it_stays_within_the_engines_tolerance_of_numpy(weights):
    """int8 activations change the arithmetic (native/host_kernels.c): every row within the 2e-3 the GPU
    kernels are held to against numpy's float32 reference, the same argmax."""
    native_backend, numpy_backend = HostBackend(weights, options=NATIVE), HostBackend(weights)
    kv_n, kv_r = native_backend.alloc_kv(16), numpy_backend.alloc_kv(16)
    for tokens, start in (([3, 1, 4], 0), ([1], 3), ([5], 4), ([9], 5)):
        got = native_backend.forward([(kv_n, np.array(tokens), start)])[0]
        expect = numpy_backend.forward([(kv_r, np.array(tokens), start)])[0]
        assert_logits_match(got, expect)


def test_a_weight_is_prepared_once_for_every_program(weights):
    """The per-op program and the one call bind the same prepared weights (a repacked Q4_K / Q6_K weight
    is a copy: made once per backend, not once per program)."""
    backend = HostBackend(weights, options=NATIVE)
    backend.program(backend.plan(1).segments[0].ops)
    made = dict(backend._prepared)
    assert made and NativeProgram.bind(backend, backend.plan(1).segments[0].ops) is not None
    assert backend._prepared.keys() == made.keys()
    assert all(backend._prepared[key] is prepared for key, prepared in made.items())


@pytest.mark.parametrize("mix", ["q8_0", "q4_k_m"])
@pytest.mark.parametrize("isa", HOST_ISAS_HERE)
def test_every_isa_path_gives_the_per_op_numbers(isa, mix, tmp_path):
    """Forced down to each ISA the CPU has (the fallback paths), the one call is still the per-op calls."""
    if mix == "q4_k_m":
        write_gguf(CFG, None, str(tmp_path / "m.gguf"), seed=6, mix="q4_k_m")
        weights = load_weights(tmp_path / "m.gguf")
    else:
        weights = random_q8_weights(CONFIGS["qwen3"], seed=6)
    options = NATIVE.with_(host_isa=isa)
    one, ops = HostBackend(weights, options=options), HostBackend(weights, options=options)
    assert one.kernels.isa == isa
    kv_one, kv_ops = one.alloc_kv(8), ops.alloc_kv(8)
    for tokens, start in (([3, 1, 4, 1], 0), ([5], 4)):
        got = one_call(one, [(kv_one, np.array(tokens), start)], "all")
        assert np.array_equal(got, per_op(ops, [(kv_ops, np.array(tokens), start)], "all"))


@pytest.mark.parametrize("name", ["layers=1", "layers=all", "gated-split-qkv"])   # layers=all: lm_head alone
def test_a_mixed_steps_host_segments_as_one_call(name, monkeypatch):
    """layers=N and gated run their host segments over the pinned state as one call each (where the
    segment binds): the logits of the per-op calls, bit for bit, on the emulated device."""
    import fake_cuda
    from test_executors_emulated import make_split_engine, run

    fake_cuda.install(monkeypatch, mode="deferred")
    monkeypatch.setenv("KESTREL_HOST_KERNELS", "native")
    weights = random_q8_weights(CONFIGS["qwen3"], seed=3)
    calls = []
    real = NativeProgram.run_state
    monkeypatch.setattr(NativeProgram, "run_state", lambda self, state, *rest: calls.append(state.T) or real(self, state, *rest))
    engine = make_split_engine(weights, name, monkeypatch)
    one_call = run(engine, [5, 3, 200])[0]
    engine.close()
    assert calls
    monkeypatch.setattr(NativeProgram, "bind", classmethod(lambda cls, backend, ops: None))
    engine = make_split_engine(weights, name, monkeypatch)
    per_op_logits = run(engine, [5, 3, 200])[0]
    engine.close()
    assert np.array_equal(one_call, per_op_logits)
