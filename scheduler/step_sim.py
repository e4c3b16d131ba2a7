"""The simulated step of an offload placement: the host memory pool's rates, each op's cost on either side,
and the host's and the copy engine's clocks over the step (offload.py places, this prices).

simulate_step walks the step's work in order: the host's clock (its kernels, one native call per host
segment, its launches, its waits) and the copy engine's (a copy starts once its slot's last reader
finished), a GPU op starting when its launch was issued, the GPU is free and its slot is loaded.  A host op overlapping copies runs at the joint rate,
a copy overlapping host ops at the joint link rate (damped passes settle which overlap).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .gate import gpu_compute_us
from .moe import expected_experts
from .ops import step_ops

ROUTED_GROUPS = ("router", "experts")    # a routed layer's MLP: on the host, or on the GPU with its experts streamed
DEVICE_ALIGN = 256
PASSES = 6                         # simulate_step's passes over the step
HOST_CALL_US = 8.0                 # Python and pool dispatch of one host call (default)
HOST_OP_US = 3.0                   # an op inside a host segment's one call: the pool's barrier after it (at most
                                   # a call's cost)
LINEAR_JOBS = 3                    # a host Linear of many tokens: quantize, tiles, tokens in lanes


def routed_jobs(config, kind: str, tokens: int) -> float:
    """Pool jobs of a routed layer's op inside its segment's one native call (host_moe.c), not calls: the
    router's logits one; the experts one while few tokens choose each expert (every chosen expert's gate|up
    and down rows one job), else each expected expert's gate|up and down as Linears of their own."""
    if kind == "router":
        return 1.0
    if tokens * config.num_experts_per_tok <= 4 * config.num_experts:
        return 1.0
    return 2.0 * LINEAR_JOBS * expected_experts(config.num_experts, config.num_experts_per_tok, tokens)


def aligned(nbytes: int) -> int:
    """Device bytes of an image of `nbytes` in the arena (aligned start, one alignment of slack)."""
    return -(-nbytes // DEVICE_ALIGN) * DEVICE_ALIGN + DEVICE_ALIGN


@dataclass(frozen=True)
class PoolRates:
    """GB/s of the two readers of host memory, alone and together."""
    host: float
    link: float
    host_joint: float
    link_joint: float

    @classmethod
    def of(cls, profile) -> "PoolRates":
        host, link = profile.host_weight_GBps, profile.h2d_GBps
        host_joint = getattr(profile, "host_joint_GBps", None) or host
        link_joint = getattr(profile, "h2d_joint_GBps", None) or link
        return cls(host, link, min(host_joint, host), min(link_joint, link))

    def best_us(self, nbytes: float) -> float:
        """The least time to read `nbytes` out of host memory with the cores and the link."""
        if nbytes <= 0:
            return 0.0
        return nbytes / (max(self.host, self.link, self.host_joint + self.link_joint) * 1e3)


@dataclass(frozen=True)
class StepSim:
    total_us: float
    copy_busy_us: float
    host_busy_us: float
    gpu_busy_us: float
    handoffs: int


@dataclass(frozen=True)
class Work:
    """One op of a placed step, as the simulation sees it."""
    side: str          # "gpu" | "host"
    us: float          # GPU compute, or host time at the host-alone rate (its joint time: us_joint)
    us_joint: float
    launches: int
    item: int = -1     # streamed item index (GPU ops reading a ring slot), counted per ring
    nbytes: int = 0    # streamed bytes of that item
    ring: int = 0      # the ring it streams through: 0 the layers' (window), 1 the experts' (EXPERT_RING)


def _host_us(op, profile, rate_GBps: float) -> float:
    """An op's host time at a given host-memory rate (each weight at most at its format's kernel rate):
    compute- or memory-bound, whichever is slower.  The compute side: the formats' measured kernel rates at
    the step's tokens where the profile has them (_kernel_us), else the op's FLOPs at host_gflops."""
    formats = getattr(profile, "host_format_GBps", None) or {}
    read_us = (op.input_bytes + op.output_bytes) / (rate_GBps * 1e3)
    matrices = [w for w in op.weights if len(w.shape) == 2]
    for w in matrices:
        read_us += w.nbytes * op.read_fraction / (min(rate_GBps, formats.get(w.fmt, rate_GBps)) * 1e3)
    kernel_us = _kernel_us(op, matrices, profile)
    if kernel_us is None:
        return max(op.flops / (profile.host_gflops * 1e3), read_us)
    return max(kernel_us, read_us)


def kernel_GBps(curve, tokens: float) -> float:
    """A format's host kernel rate (weight bytes/s) at `tokens` tokens from its measured [[tokens, GB/s], ...]:
    seconds per byte interpolated linearly between the measured sizes; past the largest, proportional to the
    tokens (compute-bound)."""
    points = [(float(t), float(r)) for t, r in curve]
    if tokens <= points[0][0]:
        return points[0][1]
    for (t0, r0), (t1, r1) in zip(points, points[1:]):
        if tokens <= t1:
            f = (tokens - t0) / (t1 - t0)
            return 1.0 / ((1.0 - f) / r0 + f / r1)
    last_tokens, last_rate = points[-1]
    return last_rate * last_tokens / tokens


def _kernel_us(op, matrices: list, profile) -> float | None:
    """The host kernels' time over an op's matrices at the step's tokens, alone (their measured rate per
    format and token count), plus its other FLOPs at host_gflops; None where the profile lacks a format's
    curve, for a routed layer's ops (each expert sees a share of the tokens) and for ops without matrices."""
    curves = getattr(profile, "host_format_tokens_GBps", None)
    if not curves or not matrices or op.kind in ROUTED_GROUPS:
        return None
    us, other_flops = 0.0, op.flops
    for w in matrices:
        curve = curves.get(w.fmt)
        if not curve:
            return None
        tokens = w.flops / (2.0 * w.shape[0] * w.shape[1])
        us += w.nbytes * op.read_fraction / (kernel_GBps(curve, tokens) * 1e3)
        other_flops -= w.flops
    return us + max(other_flops, 0.0) / (profile.host_gflops * 1e3)


def _gpu_experts_us(op, profile) -> float:
    """An experts op's kernel time on the device (its experts there): the expert kernels' measured FLOP/s, or
    the read of the experts its tokens choose, whichever is slower."""
    rate = getattr(profile, "gpu_expert_gflops", None) or profile.gpu_gflops
    return max(op.flops / (rate * 1e3), op.active_weight_bytes / (profile.gpu_weight_GBps * 1e3))


@dataclass(frozen=True)
class OpCost:
    layer: int | None      # None: lm_head (head=True) or an op that always runs on the GPU
    group: str | None
    head: bool
    placed: bool           # a projection: its home decides its side
    gpu_us: float
    host_us: float
    host_joint_us: float
    launches: int
    nbytes: int            # device bytes of its weight (what a ring slot receives)


def op_costs(config, tokens: int, context_len: int, profile, rates: PoolRates, expert_layer_bytes: int = 0,
             resident_expert_share: float = 0.0) -> list:
    """Each op's time on either side for steps of `tokens` tokens (norms and SiLU·mul ride on projections; a
    routed layer's router and experts on the host at the bytes of the experts the step is expected to read,
    less the share of choices resident experts take on the device, or on the GPU with `expert_layer_bytes`
    (every expert of the layer) streamed into a slot of the experts' ring first: the copy is the same for any
    step size, the host's reading grows with the experts chosen)."""
    out = []
    call_us = getattr(profile, "host_call_us", None) or HOST_CALL_US
    op_us = min(HOST_OP_US, call_us)
    for op in step_ops(config, tokens, context_len):
        if op.kind in ("norm", "elementwise"):
            continue
        if op.kind == "embed":                          # always on the host: a row gather
            out.append(OpCost(None, None, False, False, 0.0, op_us, op_us, 0, -1))
            continue
        if op.kind in ROUTED_GROUPS:                    # the router and the experts a step reads
            # on the host its segment's one call is paid where the segment starts (simulate_step); the op adds
            # its jobs
            jobs_us = routed_jobs(config, op.kind, tokens) * op_us
            gpu_us = _gpu_experts_us(op, profile) if op.kind == "experts" else gpu_compute_us(op, profile)
            if op.kind == "experts":
                op = replace(op, read_fraction=op.read_fraction * (1.0 - resident_expert_share))
            out.append(OpCost(op.layer, op.kind, False, True, gpu_us,
                               _host_us(op, profile, rates.host) + jobs_us,
                               _host_us(op, profile, rates.host_joint) + jobs_us,
                               op.launches or 1, expert_layer_bytes if op.kind == "experts" else 0))
            continue
        placed = bool(op.group)
        out.append(OpCost(op.layer, op.group, op.group == "lm_head", placed, gpu_compute_us(op, profile),
                           _host_us(op, profile, rates.host) + op_us if placed else 0.0,
                           _host_us(op, profile, rates.host_joint) + op_us if placed else 0.0,
                           op.launches or 1, aligned(op.weight_bytes) if placed else 0))
    return out


def _overlap(spans: list, others: list) -> list:
    """For each (begin, end) of `spans` (in time order, disjoint), the share of it `others` (the same) cover."""
    shares, j = [], 0
    for begin, end in spans:
        while j < len(others) and others[j][1] <= begin:
            j += 1
        covered, k = 0.0, j
        while k < len(others) and others[k][0] < end:
            covered += max(0.0, min(end, others[k][1]) - max(begin, others[k][0]))
            k += 1
        shares.append(covered / (end - begin) if end > begin else 0.0)
    return shares


def simulate_step(work: list, slot_count, profile, rates: PoolRates) -> StepSim:
    """Predicted time of one step: the host's clock and the copy engine's, over the ops in order.  A host
    op's time mixes its alone and joint rates by the share of it copies overlapped in the previous pass, a
    copy's by the share host ops overlapped.  slot_count: the ring's slots, or a tuple of each ring's
    (Work.ring); the rings' copies share the link, one after another in step order, each waiting for the
    reader of its ring's slot S items before it."""
    launch_us, handoff_us = profile.gpu_launch_us, profile.round_trip_us
    call_us = getattr(profile, "host_call_us", None) or HOST_CALL_US    # a host segment is one native call
    slot_counts = (slot_count,) if isinstance(slot_count, int) else tuple(slot_count)
    streamed = [w for w in work if w.item >= 0]
    # the global index of the copy whose slot each copy takes over (its ring's item S before it), or -1
    by_ring: dict = {}
    previous = []
    for c, w in enumerate(streamed):
        seen = by_ring.setdefault(w.ring, [])
        S = slot_counts[w.ring]
        previous.append(seen[-S] if len(seen) >= S else -1)
        seen.append(c)
    position = {i: c for c, i in enumerate(i for i, w in enumerate(work) if w.item >= 0)}   # work -> copy
    host_share: dict = {}
    copy_share = [0.0] * len(streamed)
    result = None
    for passes in range(PASSES):
        t = gpu_free = copy_free = 0.0      # host clock; the GPU's last finish; the copy engine's
        copy_end, release = [0.0] * len(streamed), [0.0] * len(streamed)
        host_spans, copy_spans, host_index = [], [], []
        side, handoffs, issued = "host", 0, 0
        t = call_us if work and work[0].side == "host" else 0.0

        done = [False] * len(streamed)

        def issue_copies() -> None:
            """Every copy, in order, whose slot's earlier reader has been placed on the GPU's clock."""
            nonlocal issued, copy_free
            while issued < len(streamed) and (previous[issued] < 0 or done[previous[issued]]):
                c = issued
                start = max(copy_free, release[previous[c]] if previous[c] >= 0 else 0.0)
                share = copy_share[c]
                copy_free = start + streamed[c].nbytes * (share / rates.link_joint + (1 - share) / rates.link) / 1e3
                copy_end[c] = copy_free
                copy_spans.append((start, copy_free))
                issued += 1

        issue_copies()                           # the step's first copies go out with its start
        for index, w in enumerate(work):
            if w.side != side:
                if side == "gpu":                # the host waits for the GPU's result
                    t = max(t, gpu_free)
                t += handoff_us + (call_us if w.side == "host" else 0.0)
                handoffs += 1
                side = w.side
            if w.side == "host":
                share = host_share.get(index, 0.0)
                us = share * w.us_joint + (1 - share) * w.us
                host_spans.append((t, t + us))
                host_index.append(index)
                t += us
                continue
            t += launch_us * w.launches
            start = max(t, gpu_free)
            c = position.get(index, -1)
            if c >= 0:
                start = max(start, copy_end[c])
            gpu_free = start + w.us
            if c >= 0:
                release[c], done[c] = gpu_free, True
                issue_copies()
        total = max(t, gpu_free) + (handoff_us if side == "gpu" else 0.0)
        # damped: the shares move halfway to what this pass saw, so two passes cannot flip-flop
        seen = dict(zip(host_index, _overlap(host_spans, copy_spans)))
        host_share = {i: (host_share.get(i, 0.0) + s) / 2 if passes else s for i, s in seen.items()}
        copy_share = [(a + b) / 2 if passes else b for a, b in zip(copy_share, _overlap(copy_spans, host_spans))]
        result = StepSim(total, sum(e - b for b, e in copy_spans), sum(e - b for b, e in host_spans),
                         sum(w.us for w in work if w.side == "gpu"), handoffs)
    return result
