"""The mixture-of-experts kernels (kernels_ptx/moe.cu) against numpy: routing with the model's top-k (ties to
the lowest expert), the grouping by expert, and the grouped expert GEMVs with the combine on awkward expert
loads -- an expert every token chose, one only one token chose, and experts none chose -- at one token (the
M=1 kernels, and moe_token_*'s two launches for 1, 2, 3 and 6 chosen experts), a few and more than a
tile's worth, in Q8_0 and the block formats, with every expert in the
pool or some left to the host (mode offload's resident part: the sum alone).  The grouped tensor-core GEMM
(moe_mma.cu) the same way, forced for every token count (1..70 and 512) and tile, on loads of 0, 1, 31 and all
tokens, and the switch between it and the GEMVs by the step's token count.

Each case runs on the emulated device (fake_moe_kernels' twins: CI) and, marked `gpu`, on a real one with the
NVRTC-built kernels.  Reference: the host's routing (run/host/arithmetic.route) of float32 logits, and per
choice float32 x @ dequant(W).T: within 1e-5 of the largest output (fp32 sums in another order); for the
GEMM, x and the act rows as it reads them, in two int8 levels per 32-block (q8_mma.cu's quantisation).
"""
from __future__ import annotations

import numpy as np
import pytest

from bench.synthetic import random_blocks
from kestrel_stream.cuda import driver, moe_kernels
from kestrel_stream.model.quant import quantize
from kestrel_stream.model.quant4 import BlockTensor
from kestrel_stream.run.device.expert_pool import part_bytes
from kestrel_stream.run.device.expert_store import expert_parts
from kestrel_stream.run.host.arithmetic import route as host_route, silu_mul
from test_block_kernels import DEVICES, Harness

E, K_CHOSEN = 6, 2
# (gate_up format, down format, H, I): Q8_0 both; llama.cpp Q4_K_M's experts (Q4_K gate/up, Q6_K down); Q4_0
SHAPES = {"q8": ("Q8_0", "Q8_0", 64, 96), "q4_k_m": ("Q4_K", "Q6_K", 256, 256), "q4_0": ("Q4_0", "Q8_0", 128, 64),
          "q8_partial_tiles": ("Q8_0", "Q8_0", 96, 160)}   # the GEMM's last row tile and K stage part-filled
TOLERANCE = 1e-5
BLOCK_MMA_TOLERANCE = 1e-4   # the GEMM's Q4_K mins meet x's fp32 sums, the reference's x in two levels throughout


@pytest.fixture(params=DEVICES)
def dev(request, monkeypatch):
    h = Harness(request.param, monkeypatch)
    yield h
    h.arena.release()


def stacked(fmt: str, rows: int, cols: int, rng):
    if fmt == "Q8_0":
        return quantize((rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32))
    return BlockTensor(fmt, random_blocks(rng, fmt, rows, cols, 1 / np.sqrt(cols)), cols)


class Layer:
    """A routed layer's experts (every expert's gate_up rows, then down rows, stacked) in a pool on `dev`,
    each expert in slot `slots[e]` (-1: not on the device), its router, and the step buffers."""

    def __init__(self, dev, shape: str, tokens: int, slots, seed: int = 0, chosen: int = K_CHOSEN):
        self.gate_up_fmt, self.down_fmt, self.H, self.I = SHAPES[shape]
        self.k = k = chosen
        H, I = self.H, self.I
        rng = np.random.default_rng(seed)
        self.gate_up, self.down = stacked(self.gate_up_fmt, E * 2 * I, H, rng), stacked(self.down_fmt, E * H, I, rng)
        self.slots = np.asarray(slots, np.int32)
        strides = [-(-b // 256) * 256 for b in part_bytes(self.gate_up_fmt, 2 * I, H) + part_bytes(self.down_fmt, H, I)]
        used = int(self.slots.max()) + 1
        regions = [dev.put(np.zeros(used * s, np.uint8)) for s in strides]
        self.parts = (moe_kernels.PoolPart(regions[0], regions[1], strides[0], strides[1]),
                      moe_kernels.PoolPart(regions[2], regions[3], strides[2], strides[3]))
        for e, slot in enumerate(self.slots):
            if slot < 0:
                continue
            for part, w, rows, interleave in ((self.parts[0], self.gate_up, 2 * I, True), (self.parts[1], self.down, H, False)):
                qs, meta = expert_parts(w, e * rows, (e + 1) * rows, interleave)
                driver.h2d_sync(part.qs + int(slot) * part.qs_slot, qs)
                driver.h2d_sync(part.meta + int(slot) * part.meta_slot, meta)
        self.slot_of = dev.put(self.slots)
        T = tokens
        self.route = dev.put(np.zeros((T, 2 * k), np.float32))
        self.counts = dev.put(np.zeros(E, np.uint32))
        self.groups = dev.put(np.zeros(moe_kernels.group_ints(E, T, k), np.int32))
        self.tickets = dev.put(np.zeros(moe_kernels.route_tickets(T), np.uint32))
        self.counter = dev.put(np.zeros(64, np.uint32))      # the one-token combine's GEMV epilogue
        self.act = dev.put(np.zeros((T * k, I), np.float32))
        self.expert_out = dev.put(np.zeros((T * k, H), np.float32))

    def expert(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(gate_up [2I, H] gate rows then up rows, down [H, I]) of expert e, dequantized."""
        return (self.gate_up.rows(e * 2 * self.I, (e + 1) * 2 * self.I).dequantize(),
                self.down.rows(e * self.H, (e + 1) * self.H).dequantize())


def awkward_inputs(H: int, tokens: int, rng):
    """xn, 1/rms and a router whose choices are: expert 0 for every token, expert 1 for every token but
    token 1, expert E-1 for token 1 alone (its second choice), no token for the rest."""
    xn = (0.1 * rng.standard_normal((tokens, H))).astype(np.float32)
    xn[:, :2] = 0.0
    xn[:, 0] = 1.0
    if tokens > 1:
        xn[1, 1] = 1.0
    router = np.zeros((E, H), np.float32)
    router[0, 0], router[1, 0], router[E - 1, 1] = 8.0, 4.0, 6.0
    inv_rms = (0.5 + rng.random(tokens)).astype(np.float32)
    return xn, inv_rms, router


def run_layer(dev, layer: Layer, xn, inv_rms, router, *, softmax_first=True, normalize=True, residual=True,
              token: bool = False):
    """route, gate_up, down and combine as moe_ops.py launches them (token: one token's two moe_token_*
    launches after the route); returns (route rows, combined y, xn_out, inv_rms_out, groups)."""
    T, H, I = len(xn), layer.H, layer.I
    xn_p, inv_p = dev.put(xn), dev.put(inv_rms)
    res = (0.5 * np.random.default_rng(9).standard_normal((T, H))).astype(np.float32)
    y = dev.put(res if residual else np.zeros((T, H), np.float32))
    normw = (1 + 0.1 * np.random.default_rng(8).standard_normal(H)).astype(np.float32)
    xn_out, inv_out = dev.put(np.zeros((T, H), np.float32)), dev.put(np.zeros(T, np.float32))
    shape = dict(experts=E, chosen=layer.k, tokens=T)
    table = dict(slot_of=layer.slot_of, groups=layer.groups, **shape)
    out = dict(res=y if residual else 0, y=y, normw_out=dev.put(normw) if residual else 0,
               xn_out=xn_out if residual else 0, inv_rms_out=inv_out if residual else 0, eps=1e-6)
    route = moe_kernels.route_launch(dev.kernels, xn=xn_p, inv_rms=inv_p, router=dev.put(router), route=layer.route,
                                     counts=layer.counts, slot_of=layer.slot_of, groups=layer.groups,
                                     tickets=layer.tickets, hidden=H, softmax_first=softmax_first, normalize=normalize,
                                     grouped=not token, **shape)
    assert not token or T == 1
    token_launches = moe_kernels.token_launches(
        dev.kernels, layer.gate_up_fmt, layer.parts[0], layer.down_fmt, layer.parts[1], slot_of=layer.slot_of,
        route=layer.route, x=xn_p, inv_rms=inv_p, act=layer.act, counter=layer.counter, hidden=H, intermediate=I,
        chosen=layer.k, **out) if token else []
    launches = [route, *token_launches] if token else [
        route,
        moe_kernels.experts_launch(dev.kernels, layer.gate_up_fmt, layer.parts[0], x=xn_p, ldx=H, gather=True,
                                   inv_rms=inv_p, y=layer.act, ldy=I, rows=2 * I, cols=H, silu=True, **table),
        moe_kernels.experts_launch(dev.kernels, layer.down_fmt, layer.parts[1], x=layer.act, ldx=I, gather=False,
                                   inv_rms=0, y=layer.expert_out, ldy=H, rows=H, cols=I, silu=False, **table),
        moe_kernels.combine_launch(dev.kernels, route=layer.route, groups=layer.groups, slot_of=layer.slot_of,
                                   expert_out=layer.expert_out, hidden=H, **out, **shape)]
    for launch in launches:
        dev.run(launch)
    groups = np.empty(moe_kernels.group_ints(E, T, layer.k), np.int32)
    driver.d2h_async(groups, layer.groups, groups.nbytes, dev.stream)
    dev.stream.synchronize()
    if token:
        assert not dev.get(layer.counter, (64,)).view(np.uint32).any(), "the combine's ticket and sums not reset"
    return (dev.get(layer.route, (T, 2 * layer.k)), dev.get(y, (T, H)), dev.get(xn_out, (T, H)),
            dev.get(inv_out, (T,)), groups, res if residual else np.zeros_like(res), normw)


def two_levels(x: np.ndarray, fmt: str) -> np.ndarray:
    """x [.., K] as the tensor-core GEMM of a `fmt` weight reads it: (128 hi + lo) d / 128 per 32-block (Q8_0,
    q8_mma.cu's) or group of 16 (the 4/6-bit formats, q4_mma.cu's)."""
    from fake_block_kernels import quantize_groups
    from fake_kernels import quantize_rows_q8
    rows = x.reshape(-1, x.shape[-1])
    hi, lo, d = quantize_rows_q8(rows) if fmt == "Q8_0" else quantize_groups(rows)[:3]
    q = (128 * hi.astype(np.float32) + lo) * (d[:, :, None] / np.float32(128))
    return q.reshape(x.shape).astype(np.float32)


def reference(layer: Layer, xn, inv_rms, router, res, softmax_first=True, normalize=True, int8_x=False):
    """(ids, weights, res + the routed layer's output); int8_x: x and the act rows in the GEMM's two levels."""
    ids, weights = host_route((xn @ router.T) * inv_rms[:, None], layer.k, softmax_first, normalize)
    out = res.copy()
    x = two_levels(xn, layer.gate_up_fmt) if int8_x else xn
    for t in range(len(xn)):
        for e, w in zip(ids[t], weights[t]):
            if layer.slots[e] < 0:
                continue
            gate_up, down = layer.expert(e)
            h = (gate_up @ x[t]) * inv_rms[t]
            act = silu_mul(h[:layer.I], h[layer.I:])
            out[t] += w * (down @ (two_levels(act[None], layer.down_fmt)[0] if int8_x else act))
    return ids, weights, out


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tokens,layout", [(1, None), (3, "g4"), (20, "g4"), (3, "m8"), (20, "m8")])
def test_experts_with_all_one_and_no_tokens_match_numpy(dev, shape, tokens, layout):
    """g4: 8 experts a block (here 6, one block), an expert's tokens in tiles of 4 (20: five tiles); m8: one
    expert a block in tiles of 8."""
    dev.kernels.moe_gemv = layout
    rng = np.random.default_rng(tokens)
    layer = Layer(dev, shape, tokens, slots=[3, 0, 5, 1, 2, 4])          # every expert, slots shuffled
    xn, inv_rms, router = awkward_inputs(layer.H, tokens, rng)
    route, y, xn_out, inv_out, groups, res, normw = run_layer(dev, layer, xn, inv_rms, router)
    ids, weights, want = reference(layer, xn, inv_rms, router, res)
    if tokens > 1:
        assert sorted(np.bincount(ids.reshape(-1), minlength=E)) == [0, 0, 0, 1, tokens - 1, tokens]
    np.testing.assert_array_equal(route[:, :K_CHOSEN], ids)
    np.testing.assert_allclose(route[:, K_CHOSEN:], weights, rtol=1e-5)
    assert np.abs(y - want).max() <= TOLERANCE * np.abs(want).max(), np.abs(y - want).max()
    np.testing.assert_allclose(xn_out, y * normw, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(inv_out, 1 / np.sqrt(np.mean(y * y, axis=1) + 1e-6), rtol=1e-4)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("chosen", [1, 2, 3, 6])
def test_one_token_s_experts_in_two_launches_match_numpy(dev, shape, chosen):
    """moe_token_*: every chosen expert's rows a block (128 / k threads a choice: 128, 64, 32 with a group
    idle, 16), the combine in the down's epilogue, y, xn and 1/rms as the grouped launches write them."""
    rng = np.random.default_rng(chosen)
    layer = Layer(dev, shape, 1, slots=[3, 0, 5, 1, 2, 4], chosen=chosen)
    xn, inv_rms, router = awkward_inputs(layer.H, 1, rng)
    router += 0.5 * rng.standard_normal(router.shape).astype(np.float32)   # distinct weights for each choice
    route, y, xn_out, inv_out, _, res, normw = run_layer(dev, layer, xn, inv_rms, router, token=True)
    ids, weights, want = reference(layer, xn, inv_rms, router, res)
    np.testing.assert_array_equal(route[:, :chosen], ids)
    assert np.abs(y - want).max() <= TOLERANCE * np.abs(want).max(), np.abs(y - want).max()
    np.testing.assert_allclose(xn_out, y * normw, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(inv_out, 1 / np.sqrt(np.mean(y * y, axis=1) + 1e-6), rtol=1e-4)
    act = dev.get(layer.act, (chosen, layer.I))
    for j, e in enumerate(ids[0]):                    # act row j: choice j's SiLU(gate) * up, in route order
        gate_up, _ = layer.expert(e)
        h = gate_up @ xn[0] * inv_rms[0]
        np.testing.assert_allclose(act[j], silu_mul(h[:layer.I], h[layer.I:]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chosen", [2, 3])
def test_one_token_leaves_experts_not_on_the_device_out_of_the_sum(dev, chosen):
    """Mode offload's resident part at one token: the sum alone, choices whose expert has no slot skipped."""
    rng = np.random.default_rng(6)
    layer = Layer(dev, "q4_k_m", 1, slots=[0, -1, 1, 2, 3, -1], chosen=chosen)
    xn, inv_rms, router = awkward_inputs(layer.H, 1, rng)
    router[E - 1, 0] = 7.0                            # expert E-1 (no slot) among the choices
    route, y, *_ = run_layer(dev, layer, xn, inv_rms, router, residual=False, token=True)
    ids, _, want = reference(layer, xn, inv_rms, router, np.zeros_like(y))
    assert E - 1 in ids[0] and np.abs(want).max() > 0
    assert np.abs(y - want).max() <= TOLERANCE * np.abs(want).max()


@pytest.mark.parametrize("tokens", [1, 20])
def test_experts_not_on_the_device_are_left_out_of_the_sum(dev, tokens):
    """Mode offload's resident part: experts 1 and E-1 on the host (slot -1), the sum alone (no residual)."""
    rng = np.random.default_rng(5)
    layer = Layer(dev, "q8", tokens, slots=[0, -1, 1, 2, 3, -1])
    xn, inv_rms, router = awkward_inputs(layer.H, tokens, rng)
    route, y, *_ = run_layer(dev, layer, xn, inv_rms, router, residual=False)
    _, _, want = reference(layer, xn, inv_rms, router, np.zeros_like(y))
    assert np.abs(y - want).max() <= TOLERANCE * np.abs(want).max()


def test_the_grouping_is_by_expert_and_stable(dev):
    tokens = 20
    layer = Layer(dev, "q8", tokens, slots=[0, -1, 1, 2, 3, 4])
    xn, inv_rms, router = awkward_inputs(layer.H, tokens, np.random.default_rng(1))
    route, *_, groups, _, _ = run_layer(dev, layer, xn, inv_rms, router)
    chosen = route[:, :K_CHOSEN].astype(np.int64).reshape(-1)
    offsets, active = groups[:E + 1], groups[E + 1:2 * E + 2]
    order = groups[2 * E + 2:2 * E + 2 + tokens * K_CHOSEN]
    position = groups[2 * E + 2 + tokens * K_CHOSEN:]
    np.testing.assert_array_equal(order, np.argsort(chosen, kind="stable"))
    np.testing.assert_array_equal(position[order], np.arange(tokens * K_CHOSEN))
    np.testing.assert_array_equal(offsets, np.searchsorted(np.sort(chosen), np.arange(E + 1)))
    used = [e for e in range(E) if (chosen == e).any() and e != 1]          # expert 1 has no slot
    assert list(active[:active[E]]) == used and active[E] == len(used)
    counts = np.empty(E, np.uint32)
    driver.d2h_async(counts, layer.counts, counts.nbytes, dev.stream)
    dev.stream.synchronize()
    np.testing.assert_array_equal(counts, np.bincount(chosen, minlength=E))


@pytest.mark.parametrize("softmax_first,normalize", [(True, True), (True, False), (False, True)])
def test_routing_ties_go_to_the_lowest_expert(dev, softmax_first, normalize):
    """Equal router rows tie: the lowest ids win, as the host's stable sort; the weights as the model's."""
    tokens = 4
    layer = Layer(dev, "q8", tokens, slots=list(range(E)))
    rng = np.random.default_rng(3)
    xn = rng.standard_normal((tokens, layer.H)).astype(np.float32)
    router = np.tile(rng.standard_normal(layer.H).astype(np.float32), (E, 1))
    router[3] *= 0.5                                                   # one expert below the tie
    inv_rms = np.ones(tokens, np.float32)
    route, *_ = run_layer(dev, layer, xn, inv_rms, router, softmax_first=softmax_first, normalize=normalize)
    ids, weights = host_route((xn @ router.T).astype(np.float32), K_CHOSEN, softmax_first, normalize)
    np.testing.assert_array_equal(route[:, :K_CHOSEN], ids)
    np.testing.assert_allclose(route[:, K_CHOSEN:], weights, rtol=1e-5)
    for t in range(tokens):                # expert 3's logit is half the tie's: first where the tie's is negative
        assert list(ids[t]) == ([0, 1] if xn[t] @ router[0] > 0 else [3, 0])


def loads_inputs(H: int, tokens: int, rng):
    """xn, 1/rms and a router whose choices are: expert 0 for every token; then expert 1 for token 0 alone,
    expert 2 for the next 31 tokens, experts 4 and 5 in turn for the rest; none for expert 3."""
    assert H >= E
    second = [1] + [2] * min(31, tokens - 1) + [4 + t % 2 for t in range(max(tokens - 32, 0))]
    xn = (0.1 * rng.standard_normal((tokens, H))).astype(np.float32)
    xn[:, :E] = 0.0
    xn[:, 0] = 1.0
    xn[np.arange(tokens), second] = 0.5
    router = np.zeros((E, H), np.float32)
    router[:, :E] = 8.0 * np.eye(E, dtype=np.float32)
    return xn, (0.5 + rng.random(tokens)).astype(np.float32), router


def check_grouped_gemm(dev, tokens: int, tile: str | None = None, slots=(3, 0, 5, 1, 2, 4), shape="q8") -> None:
    dev.kernels.moe_mma_min_tokens, dev.kernels.moe_mma_tile = 0, tile           # every step on the GEMM
    rng = np.random.default_rng(tokens)
    layer = Layer(dev, shape, tokens, slots=list(slots))
    xn, inv_rms, router = loads_inputs(layer.H, tokens, rng)
    residual = min(slots) >= 0
    route, y, xn_out, inv_out, groups, res, normw = run_layer(dev, layer, xn, inv_rms, router, residual=residual)
    ids, weights, want = reference(layer, xn, inv_rms, router, res, int8_x=True)
    loads = np.bincount(ids.reshape(-1), minlength=E)
    assert loads[0] == tokens and loads[3] == 0 and (tokens < 2 or loads[1] == 1), loads
    assert tokens < 32 or loads[2] == 31, loads
    np.testing.assert_array_equal(route[:, :K_CHOSEN], ids)
    tolerance = TOLERANCE if layer.gate_up_fmt == layer.down_fmt == "Q8_0" else BLOCK_MMA_TOLERANCE
    assert np.abs(y - want).max() <= tolerance * np.abs(want).max(), np.abs(y - want).max()


@pytest.mark.parametrize("tokens", [*range(1, 71), 512])
def test_grouped_gemm_with_all_one_31_and_no_tokens_matches_numpy(dev, tokens):
    check_grouped_gemm(dev, tokens)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tile", sorted(moe_kernels.MMA_TILES))
@pytest.mark.parametrize("tokens", [2, 33, 70, 512])
def test_every_grouped_gemm_tile_matches_numpy(dev, tokens, tile, shape):
    check_grouped_gemm(dev, tokens, tile, shape=shape)


@pytest.mark.parametrize("tokens", [1, 40])
def test_grouped_gemm_leaves_experts_not_on_the_device_out_of_the_sum(dev, tokens):
    check_grouped_gemm(dev, tokens, slots=(0, -1, 1, 2, 3, -1))


def test_the_step_s_token_count_picks_the_gemm_or_the_gemvs(dev):
    """One switch point: moe_kernels.mma_min_tokens (8 tokens per expert on average), or the kernel set's."""
    experts, chosen = 128, 8
    first = moe_kernels.mma_min_tokens(experts, chosen)
    assert first == 128
    part = moe_kernels.PoolPart(0, 0, 256, 256)
    def launch(fmt: str, tokens: int):
        return moe_kernels.experts_launch(
            dev.kernels, fmt, part, slot_of=0, groups=0, x=0, ldx=2048, gather=False, inv_rms=0, y=0, ldy=768,
            rows=768, cols=2048, experts=experts, chosen=chosen, tokens=tokens, silu=False)

    for tokens, fmt, kernel in ((1, "Q8_0", "moe_experts_q8_0_m1"), (first - 1, "Q8_0", "moe_experts_q8_0_g4"),
                                (first, "Q8_0", "moe_mma_q8_0_16x64"), (512, "Q8_0", "moe_mma_q8_0_32x64"),
                                (2048, "Q8_0", "moe_mma_q8_0_64x64"), (512, "Q4_K", "moe_mma_q4_k_32x64"),
                                (first - 1, "Q6_K", "moe_experts_q6_k_g4")):
        assert launch(fmt, tokens).name == kernel, (tokens, fmt)
    assert launch("Q8_0", 16).grid[:2] == (192, 128 // moe_kernels.GROUP_EXPERTS)   # 8 experts a block
    assert launch("Q8_0", 2).grid[:2] == (192, 2)                                   # 2 tokens: up to 16 experts
    dev.kernels.moe_gemv = "m8"                                                      # KESTREL_MOE_GEMV=m8: before
    assert launch("Q8_0", 16).name == "moe_experts_q8_0_m8" and launch("Q8_0", 16).grid[:2] == (192, 128)
    dev.kernels.moe_gemv = None
    dev.kernels.moe_mma_min_tokens = 16
    assert moe_kernels.uses_mma(dev.kernels, "Q8_0", experts=experts, chosen=chosen, tokens=16)
    assert not moe_kernels.uses_mma(dev.kernels, "Q8_0", experts=experts, chosen=chosen, tokens=15)
    assert moe_kernels.mma_grid("32x64", 1536, experts, chosen, 512) == (24, 2, 128)
