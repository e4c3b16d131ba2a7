"""Placement plan: which side runs every op of a step, cut into segments.

A Plan is the ordered list of Segments of one step; a Segment is a run of
consecutive ops on one side. A GPU segment does its launches (one per op; a
fused group is one op, a split part one per row range); what moves between
the sides and when the host waits follows from the state each op reads and
writes (transfers.py): as a rule one download and one sync where the host
needs a GPU segment's output next, or at the step's end.

The per-mode placement rules are in placement.py. Modes: cpu, gated, gpu,
layers=N, and auto (cpu without a GPU, else gpu; the residency window streams
what does not fit the budget).

In gated mode with the cost model, the gate judges each fused group alone,
paying its own round trip. Adjacent GPU groups share a segment, though (o
joins gate_up..down through the sandwich rule), so a group that loses alone
can win in place. A segment-aware pass therefore flips groups, the same in
every layer, while the whole-step prediction improves; a flipped weight's
reason says so.
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from .gate import Gate, GateDecision, gpu_segment_cost, host_time_us
from .dense import dense_ops
from .ops import PROJECTION_GROUPS, fuse_rope, model_weight_names, step_ops
from .offload import group_home
from .placement import fixed_sides, gated_sides, offload_sides
from .transfers import count_transfers


class PlanAuditError(AssertionError):
    """A plan that misses a weight of the model or places one twice."""


@dataclass(frozen=True)
class Placement:
    weight: str
    side: str      # "cpu" | "gpu"
    op: str        # op name as executed ("L3.qkv", or "L3.qkv[gpu]" for a split group)
    group: str     # fused group ("qkv", ...) or the op kind for non-projections
    flops: float
    nbytes: int
    reason: str


@dataclass
class Segment:
    side: str
    ops: list
    h2d_bytes: int = 0  # state, params and streamed weights uploaded during it (GPU segments only)
    d2h_bytes: int = 0  # state downloaded while it is the latest GPU segment
    syncs: int = 0      # host waits for it

    @property
    def launches(self) -> int:
        return sum(op.launches for op in self.ops) if self.side == "gpu" else 0


@dataclass
class Plan:
    mode: str             # resolved mode: cpu | gated | gpu | layers=N
    requested_mode: str
    tokens: int           # M, tokens in the step
    segments: list
    placements: dict      # weight name -> Placement, in step order
    notes: list = field(default_factory=list)
    expert_ring: tuple = ()   # mode offload: the experts ops whose layer's experts stream through the experts' ring

    @property
    def syncs_per_step(self) -> int:
        return sum(s.syncs for s in self.segments)

    @property
    def launches_per_step(self) -> int:
        return sum(s.launches for s in self.segments)

    @property
    def h2d_bytes_per_step(self) -> int:
        return sum(s.h2d_bytes for s in self.segments)

    @property
    def d2h_bytes_per_step(self) -> int:
        return sum(s.d2h_bytes for s in self.segments)

    def ops_on(self, side: str) -> list:
        """Ops run on one side, in step order (window_items(plan.ops_on("gpu")))."""
        return [op for seg in self.segments if seg.side == side for op in seg.ops]

    def weight_bytes_on(self, side: str) -> int:
        return sum(p.nbytes for p in self.placements.values() if p.side == side)

    def weight_read_bytes_on(self, side: str) -> int:
        """Q8 matrix bytes the ops on one side read per step (Op.read_weight_bytes)."""
        return sum(op.read_weight_bytes(self.tokens) for op in self.ops_on(side))

    def groups_on_gpu(self) -> dict:
        """{group: True if any of its weights runs on the GPU} (compare with a search)."""
        found = {g: False for g in PROJECTION_GROUPS}
        for p in self.placements.values():
            if p.group in found and p.side == "gpu":
                found[p.group] = True
        return found

    def counters(self) -> dict:
        return {"syncs_per_step": self.syncs_per_step, "launches_per_step": self.launches_per_step,
                "h2d_bytes_per_step": self.h2d_bytes_per_step,
                "d2h_bytes_per_step": self.d2h_bytes_per_step,
                "gpu_weight_bytes": self.weight_bytes_on("gpu"),
                "cpu_weight_bytes": self.weight_bytes_on("cpu"),
                "gpu_weight_read_bytes": self.weight_read_bytes_on("gpu"),
                "cpu_weight_read_bytes": self.weight_read_bytes_on("cpu")}

    def predicted_step_us(self, profile, resident_weights=None) -> float:
        """Cost-model time of the step: host ops plus one round trip per GPU segment."""
        total = 0.0
        for seg in self.segments:
            if seg.side == "cpu":
                total += sum(host_time_us(op, profile) for op in seg.ops)
                continue
            upload = 0
            if resident_weights is not None:
                upload = sum(w.nbytes for op in seg.ops for w in op.weights
                             if w.name not in resident_weights)
            total += gpu_segment_cost(seg.ops, seg.h2d_bytes, seg.d2h_bytes, profile,
                                      upload).total_us
        return total

    def to_dict(self) -> dict:
        return {
            "mode": self.mode, "requested_mode": self.requested_mode, "tokens": self.tokens,
            "counters": self.counters(), "notes": list(self.notes),
            "segments": [{"side": s.side, "ops": [op.name for op in s.ops],
                          "h2d_bytes": s.h2d_bytes, "d2h_bytes": s.d2h_bytes,
                          "syncs": s.syncs, "launches": s.launches} for s in self.segments],
            "weights": [p.__dict__.copy() for p in self.placements.values()],
        }

    def describe(self) -> str:
        """Every weight with its placement, group, FLOPs, bytes and the reason."""
        c = self.counters()
        lines = [f"plan: mode {self.mode} (asked {self.requested_mode}), M={self.tokens}, "
                 f"{len(self.segments)} segments, {c['syncs_per_step']} syncs/step, "
                 f"{c['launches_per_step']} launches/step, H2D {c['h2d_bytes_per_step']} B, "
                 f"D2H {c['d2h_bytes_per_step']} B/step",
                 f"weights: gpu {c['gpu_weight_bytes'] / 1e6:.1f} MB, "
                 f"cpu {c['cpu_weight_bytes'] / 1e6:.1f} MB"]
        lines += [f"note: {n}" for n in self.notes]
        width = max(len(p.weight) for p in self.placements.values())
        lines.append(f"{'weight':<{width}}  side  {'op':<16} {'group':<11} {'FLOPs':>9} "
                     f"{'bytes':>11}  reason")
        for p in self.placements.values():
            lines.append(f"{p.weight:<{width}}  {p.side:<4}  {p.op:<16} {p.group:<11} "
                         f"{p.flops:>9.3g} {p.nbytes:>11}  {p.reason}")
        return "\n".join(lines)


LAYER_KINDS = ("layers", "layers+head")     # layers=N and layers=N+head (placement.fixed_sides)


def parse_mode(mode: str) -> tuple:
    """'layers=12' -> ('layers', 12); 'layers=12+head' -> ('layers+head', 12); other modes -> (mode, None).
    Errors name the input."""
    text = mode.strip().lower()
    if text in ("cpu", "gated", "gpu", "auto", "offload"):
        return text, None
    if text.startswith("layers="):
        count = text.split("=", 1)[1]
        head = count.endswith("+head")
        count = count[:-len("+head")] if head else count
        if count.isdigit():
            return ("layers+head" if head else "layers"), int(count)
    raise ValueError(f"mode {mode!r}: expected cpu, gated, gpu, auto, offload, layers=N or layers=N+head")


def mode_name(kind: str, count: int | None) -> str:
    """parse_mode's inverse: the canonical spelling ('layers=12+head', 'gpu')."""
    if kind in LAYER_KINDS:
        return f"layers={count}" + ("+head" if kind == "layers+head" else "")
    return kind


def _segments(placed, config, tokens: int, streamed=frozenset()) -> list:
    segments = [Segment(side, [op for op, _, _ in run]) for side, run in itertools.groupby(placed, key=lambda i: i[1])]
    count_transfers(segments, config, tokens, streamed)
    return segments


def _placements(placed) -> dict:
    out = {}
    for op, side, why in placed:
        for w in op.weights:
            reason = why[w.name].reason if isinstance(why, dict) else why
            if op.group == "lm_head" and w.name == "model.embed_tokens.weight":
                reason += " (tied: embed gathers rows of it too)"
            out[w.name] = Placement(w.name, side, op.name, op.group or op.kind, w.flops,
                                    w.nbytes, reason)
    return out


def build_plan(config, tokens: int = 1, mode: str = "auto", profile=None, *,
               minflop: float | None = None, gpu_available: bool | None = None,
               resident_weights=None, group_choice: dict | None = None,
               segment_aware: bool = True, context_len: int = 0, streamed=frozenset(),
               dense_min_tokens: int | None = None, dense_fused: bool = False, rope_fused: bool = False,
               offload=None, resident_experts: dict | None = None) -> Plan:
    """The plan of one step of M=`tokens` tokens.

    profile: DeviceProfile (None: no GPU measured). minflop: the seed's plain
    per-projection threshold (the engine passes Options.minflop, KESTREL_MINFLOP;
    the scheduler reads no environment). resident_weights: weight names already on the device
    (None: all); the others pay an upload. group_choice: {group: on_gpu}
    forcing those groups in every layer (the bench's exhaustive search).
    segment_aware: refine the cost-model gate's choice by whole-step
    prediction (skipped with a threshold, forced groups or resident_weights,
    where per-layer decisions may legitimately differ).  streamed: names of
    the ops whose weights the residency window copies every step (gpu mode).
    dense_min_tokens: gpu mode's dense GEMM path from this many tokens (dense.py; None: off); dense_fused:
    on the built-in GEMM, not cuBLAS.  rope_fused: gpu mode's one-token steps run each layer's rope as its
    attention's prologue (ops.fuse_rope).  offload: mode offload's OffloadPlacement for this step size
    (offload.place / place_for_tokens): which layers run on the host; `streamed` names the ops it streams;
    resident_experts: layer -> the experts of a routed layer mode offload keeps on the device.
    """
    if tokens < 1:
        raise ValueError(f"tokens={tokens}: a step has at least one token")
    kind, layer_count = parse_mode(mode)
    notes = []
    if kind == "auto":
        has_gpu = profile is not None if gpu_available is None else gpu_available
        kind = "gpu" if has_gpu else "cpu"
        notes.append(f"auto: {'a GPU is available' if has_gpu else 'no GPU'} -> {kind}")
    ops = step_ops(config, tokens, context_len)
    total_layers = config.num_hidden_layers
    if kind == "gated":
        forced = dict(group_choice or {})
        gate = None
        if set(forced) != set(PROJECTION_GROUPS):
            gate = Gate(profile, minflop, resident_weights)
        placed = gated_sides(ops, _decider(gate, forced))
        if gate and minflop is None and segment_aware and not forced and resident_weights is None:
            placed, refined = _refine_groups(ops, tokens, gate, placed, profile, config)
            notes += refined
        notes.append("gate: " + (f"KESTREL_MINFLOP={minflop:.3g} per projection"
                                 if minflop is not None else
                                 f"cost model, profile {getattr(profile, 'name', None)}"))
    elif kind == "offload":
        if offload is None:
            raise ValueError("mode offload: the plan needs the offload placement (scheduler.offload.place)")
        placed = offload_sides(ops, offload.homes, offload.head, resident_experts)
        streamed = frozenset(streamed) | {op.name for op in ops if op.group and op.layer is not None
                                          and group_home(offload.homes[op.layer], op.group) == "streamed"}
        notes.append(offload.describe().splitlines()[0])
        notes.append(offload.describe().splitlines()[1].strip())
        expert_ring = tuple(op.name for op in ops if op.kind == "experts" and offload.homes[op.layer] == "experts")
    else:
        if kind == "gpu" and dense_min_tokens is not None and tokens >= dense_min_tokens:
            ops = dense_ops(ops, config, tokens, dense_min_tokens, dense_fused)
            notes.append(f"dense GEMM ({'built-in' if dense_fused else 'cuBLAS'}) for the Q8_0 projections: "
                         f"{tokens} >= {dense_min_tokens} tokens")
        if kind == "gpu" and rope_fused and tokens == 1:
            ops = fuse_rope(ops, tokens)
            notes.append("one-token step: each layer's rope runs as its attention's prologue")
        placed = fixed_sides(ops, kind, layer_count, total_layers)
    resolved = mode_name(kind, layer_count)
    if kind in LAYER_KINDS:
        head = kind == "layers+head" or layer_count >= total_layers
        notes.append(f"offloaded {min(layer_count, total_layers)}/{total_layers} layers"
                     + (", the output (final_norm, lm_head) too" if head else ""))
    if config.num_experts and kind not in ("cpu", "offload", "gpu"):
        notes.append(f"mixture of experts ({config.arch}): an engine runs this model in mode cpu, gpu (every "
                     "expert in VRAM) or offload (experts on the host, the most used resident)")
    if resident_experts and kind == "offload":
        notes.append(f"resident experts: {sum(len(ids) for ids in resident_experts.values())} on the GPU")
    if config.tie_word_embeddings:
        notes.append("tied embeddings: lm_head owns model.embed_tokens.weight; "
                     "embed gathers M rows of it")
    segments = _segments(placed, config, tokens, streamed)
    if kind == "offload":           # a streamed layer's every expert crosses into its ring slot, one image a layer
        for segment in segments:
            segment.h2d_bytes += offload.expert_slot_bytes * sum(op.name in expert_ring for op in segment.ops)
        return Plan(resolved, mode, tokens, segments, _placements(placed), notes, expert_ring)
    return Plan(resolved, mode, tokens, segments, _placements(placed), notes)


def _decider(gate, forced: dict, why: dict | None = None):
    """decide(op) for gated_sides: forced groups first, else the gate."""
    def decide(op):
        if op.group in forced:
            side = "gpu" if forced[op.group] else "cpu"
            reason = (why or {}).get(op.group) or f"group choice: {op.group} forced {side}"
            return {w.name: GateDecision(forced[op.group], reason) for w in op.weights}
        return gate.decide(op)
    return decide


def _predict(placed, tokens, profile, config) -> float:
    return Plan("gated", "gated", tokens, _segments(placed, config, tokens), {}).predicted_step_us(profile)


def _refine_groups(ops, tokens, gate, placed, profile, config):
    """Flip one group at a time (every layer) while the whole-step prediction improves."""
    gate_choice = Plan("gated", "gated", tokens, [], _placements(placed)).groups_on_gpu()
    choice, best_us = dict(gate_choice), _predict(placed, tokens, profile, config)
    why, notes = {}, []

    def differing(trial):  # only groups that differ from the gate's own verdict are forced
        return {g: on for g, on in trial.items() if on != gate_choice[g]}

    while True:
        trials = []
        for group in PROJECTION_GROUPS:
            trial = dict(choice, **{group: not choice[group]})
            trial_placed = gated_sides(ops, _decider(gate, differing(trial)))
            trials.append((_predict(trial_placed, tokens, profile, config), group, trial))
        trial_us, group, trial = min(trials)
        if trial_us >= best_us:
            return placed, notes
        verdict = "gpu" if trial[group] else "cpu"
        group_op = next(op for op in ops if op.group == group)
        gate_reason = next(iter(gate.decide(group_op).values())).reason
        why[group] = (f"{gate_reason}; in place -> {verdict}: step {best_us:.0f} -> "
                      f"{trial_us:.0f} us (shares neighbouring segments' round trips)")
        notes.append(f"segment-aware: {group} -> {verdict}, predicted step {best_us:.0f} -> "
                     f"{trial_us:.0f} us")
        choice, best_us = trial, trial_us
        placed = gated_sides(ops, _decider(gate, differing(choice), why))


def audit_plan(plan: Plan, config) -> None:
    """Raise PlanAuditError unless every weight of the model is placed exactly once."""
    counts = Counter(w.name for seg in plan.segments for op in seg.ops for w in op.weights)
    expected = model_weight_names(config)
    missing = sorted(expected - set(counts))
    unknown = sorted(set(counts) - expected)
    twice = sorted(name for name, n in counts.items() if n > 1)
    if missing or unknown or twice or set(plan.placements) != expected:
        raise PlanAuditError(f"plan {plan.mode}: missing {missing[:5]} ({len(missing)}), "
                             f"unknown {unknown[:5]}, placed twice {twice[:5]}")
