"""Routed (mixture-of-experts) layers on the native host kernels (native/host_moe.c, run/host/routed.py):
a whole step with routed layers as one library call, the per-op calls' numbers bit for bit and within the
engine's tolerance of numpy (the same greedy tokens), for tiny random Qwen3-MoE and Mixtral with experts
in Q8_0, Q4_K / Q6_K (llama.cpp's Q4_K_M) and Q4_0; several sessions in a step; experts chosen by no
token, one token and every token; routing ties; a layer split with experts "on the device" (moe_out);
every ISA the CPU has.  Mode offload on the emulated device: tests/test_moe_offload_emulated.py."""
from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest

from bench.synthetic import random_blocks, random_q8_weights
from hf_oracle import assert_logits_match
from kestrel_stream import native
from kestrel_stream.loading.presets import PRESETS
from kestrel_stream.model.quant4 import BlockTensor
from kestrel_stream.native.routed import Router
from kestrel_stream.options import Options
from kestrel_stream.run.host import HostBackend
from kestrel_stream.run.host.arithmetic import rmsnorm, route
from kestrel_stream.run.host.native_program import NativeProgram
from kestrel_stream.run.host.program import HostProgram, HostState
from kestrel_stream.run.host.routed import native_experts
from scheduler.moe import split_experts

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
NATIVE = Options.from_env().with_(host_kernels="native")
NUMPY = Options.from_env().with_(host_kernels="numpy")
HOST_ISAS_HERE = native.load().supported if shutil.which("cc") else ()
# hidden and expert widths that K-quant blocks (256 values) divide; Mixtral's head_dim 16 kept
SHAPES = {"qwen3-moe-tiny": dict(hidden_size=256, moe_intermediate_size=256),
          "mixtral-tiny": dict(hidden_size=256, moe_intermediate_size=256)}
FORMATS = {"q8_0": None, "q4_k_m": ("Q4_K", "Q6_K"), "q4_0": ("Q4_0", "Q4_0")}


def moe_weights(preset: str, formats: str, seed: int = 3):
    """Random weights of a MoE preset, its experts in `formats` (FORMATS: gate|up's, down's)."""
    weights = random_q8_weights(dataclasses.replace(PRESETS[preset], **SHAPES[preset]), seed=seed)
    if FORMATS[formats] is not None:
        rng, (gate_up, down) = np.random.default_rng(seed), FORMATS[formats]
        c = weights.config
        E, H, I = c.num_experts, c.hidden_size, c.moe_intermediate_size
        for lw in weights.layers:
            if lw.moe is not None:
                lw.moe.gate_up = BlockTensor(gate_up, random_blocks(rng, gate_up, E * 2 * I, H, 1 / np.sqrt(H)), H)
                lw.moe.down = BlockTensor(down, random_blocks(rng, down, E * H, I, 1 / np.sqrt(I)), I)
    return weights


@pytest.fixture(scope="module", params=[(p, f) for p in SHAPES for f in FORMATS], ids=lambda p: "-".join(p))
def weights(request):
    return moe_weights(*request.param)


def step_inputs(backend, batch):
    from kestrel_stream.run.host.backend import session_runs
    ids, positions, runs = session_runs(batch)
    cos, sin = backend.rope(positions)
    return ids, runs, cos, sin, None


def per_op(backend, batch):
    """The step through HostProgram's calls one by one (what a traced step runs)."""
    program = backend.program(backend.plan(1).segments[0].ops)
    state = HostState(*step_inputs(backend, batch))
    for call in program.calls:
        call(state)
    return state.read("logits")


STEPS = [([[5, 3, 200]], [0]),                        # a short prompt
         ([[7]], [3]),                                # a decode step
         ([[9, 8, 7], [11]], [0, 4]),                 # a prompt of the second session beside a decode
         ([[1], [2]], [5, 3]),                        # two decodes at different positions
         ([[4, 5, 6, 7], [8, 9, 10, 11]], [6, 4])]    # 8 rows: tokens in lanes (VNNI)


def test_a_step_with_routed_layers_is_one_call_of_the_per_op_numbers(weights):
    one, ops = HostBackend(weights, options=NATIVE), HostBackend(weights, options=NATIVE)
    program = NativeProgram.bind(one, one.plan(1).segments[0].ops)
    assert program is not None and program.routed
    kv_one, kv_ops = [one.alloc_kv(32), one.alloc_kv(24)], [ops.alloc_kv(32), ops.alloc_kv(24)]
    for tokens, starts in STEPS:
        sessions = range(len(tokens))
        got = program.run(*step_inputs(one, [(kv_one[s], np.array(tokens[s]), starts[s]) for s in sessions]))
        expect = per_op(ops, [(kv_ops[s], np.array(tokens[s]), starts[s]) for s in sessions])
        assert np.array_equal(got, expect), (tokens, starts)
        for a, b in zip(kv_one, kv_ops):
            assert np.array_equal(a.k, b.k) and np.array_equal(a.v, b.v)
    assert np.array_equal(one.expert_counts, ops.expert_counts) and one.expert_counts.sum() > 0
    assert one.counters.cpu_weight_read_bytes == ops.counters.cpu_weight_read_bytes > 0


def test_the_engine_runs_moe_steps_as_one_call_within_tolerance_of_numpy(weights, monkeypatch):
    """The CPU engine's steps (a prompt of four, then greedy decode steps) go through the one call, within
    the 2e-3 the GPU kernels are held to against numpy's float32 reference, the same greedy tokens, the
    same choices counted and the same weight bytes read."""
    calls = []
    real = NativeProgram.run
    monkeypatch.setattr(NativeProgram, "run", lambda self, *a: calls.append(len(a[0])) or real(self, *a))
    native_backend, numpy_backend = HostBackend(weights, options=NATIVE), HostBackend(weights, options=NUMPY)
    kv_n, kv_r = native_backend.alloc_kv(16), numpy_backend.alloc_kv(16)
    tokens, start = [3, 1, 4, 1], 0
    for _ in range(5):
        got = native_backend.forward([(kv_n, np.array(tokens), start)])[0]
        expect = numpy_backend.forward([(kv_r, np.array(tokens), start)])[0]
        assert_logits_match(got, expect)
        start, tokens = start + len(tokens), [int(np.argmax(expect[-1]))]
    assert calls == [4, 1, 1, 1, 1]
    assert np.array_equal(native_backend.expert_counts, numpy_backend.expert_counts)
    assert native_backend.counters.cpu_weight_read_bytes == numpy_backend.counters.cpu_weight_read_bytes


def layer_op(backend, kind: str, tokens: int = 1):
    """The first routed layer's router or experts op, and that layer."""
    op = next(op for op in backend.plan(tokens).segments[0].ops if op.kind == kind)
    return op, op.layer


def run_ops(backend, ops, x, route_rows=None, moe_out=None, one_call=False):
    """ops over a state holding x (and route, moe_out): per op, or as one library call → the state."""
    t = len(x)
    empty = np.zeros((t, 1, backend.config.head_dim), np.float32)
    state = HostState(np.zeros(t, np.int64), [], empty, empty)
    state.write("x", x.copy())
    for name, value in (("route", route_rows), ("moe_out", moe_out)):
        if value is not None:
            state.write(name, value)
    if one_call:
        program = NativeProgram.bind(backend, ops)
        assert program is not None
        program.run_state(state)
    else:
        for call in HostProgram(backend, ops).calls:
            call(state)
    return state


def route_rows(ids: list, seed: int = 2) -> np.ndarray:
    """"route" rows of the chosen experts `ids` [T, k], with random weights."""
    ids = np.array(ids, np.float32)
    return np.concatenate([ids, np.random.default_rng(seed).uniform(0.1, 1.0, ids.shape).astype(np.float32)], axis=1)


@pytest.mark.parametrize("T", [1, 3, 7])
def test_experts_chosen_by_no_token_one_token_and_every_token(weights, T):
    c = weights.config
    x = np.random.default_rng(1).standard_normal((T, c.hidden_size)).astype(np.float32)
    last = c.num_experts - 1           # expert 0: every token; `last`: token 2 alone; 1: the others; the rest: none
    assert c.num_experts_per_tok == 2
    rows = route_rows([[0, last if t == 2 else 1] for t in range(T)])
    native_backend = HostBackend(weights, options=NATIVE)
    op, _ = layer_op(native_backend, "experts", T)
    one = run_ops(native_backend, [op], x, rows, one_call=True).read("x")
    ops = run_ops(native_backend, [op], x, rows).read("x")
    reference = run_ops(HostBackend(weights, options=NUMPY), [op], x, rows).read("x")
    assert np.array_equal(one, ops)
    np.testing.assert_allclose(one - x, reference - x, rtol=0, atol=2e-3 * np.abs(reference - x).max())


@pytest.mark.parametrize("T", [1, 2, 7])
def test_few_tokens_share_experts_and_match_numpy(weights, T):
    """Decode and small batches (each token quantized once for all its experts, every expert's rows one job):
    tokens choosing the same expert in different slots, and an expert chosen by one token alone, give the
    per-op call's numbers and numpy's within tolerance."""
    c = weights.config
    x = np.random.default_rng(7).standard_normal((T, c.hidden_size)).astype(np.float32)
    last = c.num_experts - 1          # expert 1: first choice of token 0, second of the others; `last`: token 0's
    rows = route_rows([[1, last] if t == 0 else [t % 2 + 2, 1] for t in range(T)], seed=T)
    native_backend = HostBackend(weights, options=NATIVE)
    op, _ = layer_op(native_backend, "experts", T)
    one = run_ops(native_backend, [op], x, rows, one_call=True).read("x")
    reference = run_ops(HostBackend(weights, options=NUMPY), [op], x, rows).read("x")
    assert np.array_equal(one, run_ops(native_backend, [op], x, rows).read("x"))
    np.testing.assert_allclose(one - x, reference - x, rtol=0, atol=2e-3 * np.abs(reference - x).max())


@pytest.mark.parametrize("isa", HOST_ISAS_HERE)
@pytest.mark.parametrize("T", [1, 2, 3, 6, 7])
def test_the_experts_op_is_its_experts_linears_bit_for_bit(weights, T, isa):
    """The experts' projections as one job of the pool (few tokens) or each on its own (tokens enough for
    the lanes kernel) give each expert's bound Linears' numbers, summed in ascending expert order, on
    every ISA path."""
    c = weights.config
    backend = HostBackend(weights, options=NATIVE.with_(host_isa=isa))
    op, _ = layer_op(backend, "experts", T)
    bound = native_experts(backend, op)
    x = np.random.default_rng(4).standard_normal((T, c.hidden_size)).astype(np.float32)
    rows = route_rows([[0, c.num_experts - 1 if t == 2 else 1] if t % 2 == 0 else [1, 3] for t in range(T)])
    got = x.copy()
    assert bound(got, rows) == len(np.unique(rows[:, :2]))
    xn, ids, out = backend.kernels.rmsnorm(x, backend.norm(op.prologue), c.rms_norm_eps), rows[:, :2], np.zeros_like(x)
    for e in np.unique(ids).astype(int):
        tokens, slot = np.nonzero(ids == e)
        gate_up, down = bound.linears[e]
        out[tokens] += rows[tokens, 2 + slot, None] * down(gate_up(xn[tokens]))
    assert np.array_equal(got, x + out)


@pytest.mark.parametrize("T, count", [(1, 1), (4, 1), (4, 2), (6, 2)])
def test_an_armed_link_share_gives_the_device_the_most_used_experts(weights, T, count):
    """ks_experts with its link share armed (host_moe.c's share_link, as inside a step graph): the experts it
    gives the device are the most used of its own (one token: its last `count` choices; T tokens: count / k
    of them, rounded), their grouping in moe.cu's layout (tokens ascending within each) and the step's route
    rows written, `ready` raised;
    it computes the others, waits for `done` and adds each token's sum from `out` -- here a thread plays the
    device with the experts' bound Linears -- and the whole is the op's without a share."""
    import threading
    from kestrel_stream.native.routed import LinkSpec
    c = weights.config
    E, k, H = c.num_experts, c.num_experts_per_tok, c.hidden_size
    backend = HostBackend(weights, options=NATIVE)
    op, _ = layer_op(backend, "experts", T)
    bound = native_experts(backend, op)
    x = np.random.default_rng(6).standard_normal((T, H)).astype(np.float32)
    rows = route_rows([[1, 3] if t % 3 == 0 else [3, t % E] if t % 3 == 1 else [0, 1] for t in range(T)], seed=T)
    whole = x.copy()
    bound(whole, rows)
    ids = rows[:, :k].astype(int)
    groups, table = np.zeros(2 * (E + 1) + 2 * T * k + T * E, np.int32), np.zeros(E, np.int32)
    out, words, scratch = np.zeros((T, H), np.float32), np.zeros(2, np.uint32), np.zeros(2 * E, np.int32)
    route = np.full((16, 2 * k), np.nan, np.float32)
    spec = LinkSpec(count=count, armed=1, item=1, groups=groups.ctypes.data, table=table.ctypes.data,
                    out=out.ctypes.data, ready=words.ctypes.data, done=words.ctypes.data + 4, max_tokens=16,
                    scratch=scratch.ctypes.data, route=route.ctypes.data)

    def device() -> None:                 # reads the grouping the host wrote, computes those experts' sums
        while words[0] < 1:
            pass
        xn = backend.kernels.rmsnorm(x, backend.norm(op.prologue), c.rms_norm_eps)
        for e in np.nonzero(table >= 0)[0]:
            tokens, slot = np.nonzero(ids == e)
            gate_up, down = bound.linears[e]
            out[tokens] += rows[tokens, k + slot, None] * down(gate_up(xn[tokens]))
        words[1] = 1

    helper = threading.Thread(target=device)
    helper.start()
    bound.share_link(spec)
    got = x.copy()
    try:
        bound(got, rows)
    finally:
        bound.share_link(None)
        helper.join()
    assert np.array_equal(route[:T], rows[:, :2 * k]) and np.isnan(route[T:]).all()   # the rows the device combines by
    uses = np.bincount(ids.reshape(-1), minlength=E)
    given = np.nonzero(table >= 0)[0]
    want = min(count, k) if T == 1 else (count * np.count_nonzero(uses) + k // 2) // k
    assert spec.shared == len(given) == want
    assert uses[given].min() >= uses[np.setdiff1d(np.nonzero(uses)[0], given)].max(initial=0)   # the most used
    if T == 1:
        assert sorted(given) == sorted(ids[0, k - count:])                # one token: its last choices
    offsets, active, sorted_ = groups[:E + 1], groups[E + 1:2 * E + 2], groups[2 * E + 2:2 * E + 2 + T * k]
    position = groups[2 * E + 2 + T * k:2 * E + 2 + 2 * T * k]
    assert list(active[:active[E]]) == list(given)
    for e in given:
        choices = sorted_[offsets[e]:offsets[e + 1]]
        assert list(choices) == [a for a in range(T * k) if ids[a // k, a % k] == e]   # tokens ascending
        assert all(position[a] == p for p, a in enumerate(choices, offsets[e]))
    np.testing.assert_allclose(got, whole, rtol=0, atol=1e-5 * np.abs(whole).max())


def test_router_choices_and_ties_are_routes(weights):
    """The native router's choices are arithmetic.route's (ties to the lowest id: a router of equal rows,
    and one of zeros), its weights within float32 rounding, and it counts each choice."""
    c = weights.config
    backend = HostBackend(weights, options=NATIVE)
    op, layer = layer_op(backend, "router")
    norm, k = backend.norm(op.prologue), c.num_experts_per_tok
    x = np.random.default_rng(5).standard_normal((9, c.hidden_size)).astype(np.float32)
    router = np.array(weights.layers[layer].moe.router, np.float32)
    tied = router.copy()
    tied[1:4] = tied[0]                          # experts 0-3 score the same for every token
    for weights_e in (router, tied, np.zeros_like(router)):
        logits = rmsnorm(x, norm, c.rms_norm_eps) @ weights_e.T
        logits[:, 1:4] = logits[:, :1] if weights_e is tied else logits[:, 1:4]     # ties as the C dots make them
        for softmax_first, normalize in ((True, True), (True, False), (False, True)):
            counts = np.zeros(c.num_experts, np.int64)
            got = Router(backend.kernels, weights_e, norm, c.rms_norm_eps, k, softmax_first, normalize, counts)(x)
            ids, w = route(logits, k, softmax_first, normalize)
            np.testing.assert_array_equal(got[:, :k], ids)
            np.testing.assert_allclose(got[:, k:], w, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(counts, np.bincount(ids.reshape(-1), minlength=c.num_experts))
    zero = Router(backend.kernels, np.zeros_like(router), norm, c.rms_norm_eps, k, True, True, None)(x)
    np.testing.assert_array_equal(zero[:, :k], np.tile(np.arange(k), (9, 1)))


@pytest.mark.parametrize("T", [1, 4])
def test_a_split_layers_host_part_adds_the_device_parts_sum(weights, T):
    """The experts op split as mode offload splits it (some experts "on the device"): the host part as one
    call is its per-op call bit for bit and numpy's host part within tolerance; the device part's sum
    (moe_out) and the host part's together are the whole layer's experts."""
    c = weights.config
    native_backend, numpy_backend = HostBackend(weights, options=NATIVE), HostBackend(weights, options=NUMPY)
    whole, _ = layer_op(native_backend, "experts", T)
    device, host = split_experts(whole, [0, 2])
    x = np.random.default_rng(3).standard_normal((T, c.hidden_size)).astype(np.float32)
    last = c.num_experts - 1           # experts 0 and 2 on the device; a token on both sides, one on the device's alone
    rows = route_rows([[0, 3], [1, 3], [3, 1], [2, 0]][:T] if T > 1 else [[0, last]])
    device_sum = run_ops(numpy_backend, [dataclasses.replace(device, writes=("x",))], x, rows).read("x") - x
    one = run_ops(native_backend, [host], x, rows, device_sum, one_call=True).read("x")
    assert np.array_equal(one, run_ops(native_backend, [host], x, rows, device_sum).read("x"))
    reference = run_ops(numpy_backend, [host], x, rows, device_sum).read("x")
    np.testing.assert_allclose(one, reference, rtol=0, atol=2e-3 * np.abs(reference).max())
    np.testing.assert_allclose(one, run_ops(numpy_backend, [whole], x, rows).read("x"), rtol=0,
                               atol=2e-3 * np.abs(reference).max())


@pytest.mark.parametrize("formats", sorted(FORMATS))
@pytest.mark.parametrize("isa", HOST_ISAS_HERE)
def test_every_isa_path_gives_the_per_op_numbers(isa, formats):
    """Forced down to each ISA the CPU has (the fallback paths), the one call is the per-op calls and
    within tolerance of numpy."""
    weights = moe_weights("qwen3-moe-tiny", formats, seed=6)
    options = NATIVE.with_(host_isa=isa)
    one, ops = HostBackend(weights, options=options), HostBackend(weights, options=options)
    numpy_backend = HostBackend(weights, options=NUMPY)
    assert one.kernels.isa == isa
    program = NativeProgram.bind(one, one.plan(1).segments[0].ops)
    kv_one, kv_ops, kv_r = one.alloc_kv(8), ops.alloc_kv(8), numpy_backend.alloc_kv(8)
    for tokens, start in (([3, 1, 4, 1], 0), ([5], 4)):
        got = program.run(*step_inputs(one, [(kv_one, np.array(tokens), start)]))
        assert np.array_equal(got, per_op(ops, [(kv_ops, np.array(tokens), start)]))
        assert_logits_match(got, numpy_backend.forward([(kv_r, np.array(tokens), start)])[0])
