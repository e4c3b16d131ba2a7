"""Offload placement: each layer's projections resident in VRAM, streamed through the ring, or computed on
the host where they lie, chosen by the step time a measured cost model predicts.

When the weights do not fit the VRAM budget, a batch-1 step must read every non-resident byte out of host
memory.  Two readers can do it: the host's own kernels (the bytes never leave), and the copy engine (the
bytes cross PCIe into a ring slot and a GPU kernel reads them there).  Both draw on one pool of host memory
bandwidth, whose size differs between machines, so the profile carries four rates (calibrate measures them):
host kernels alone, pinned H2D alone, and each while the other runs.  The floor of a step is then

    roofline = (non-resident bytes) / max(host alone, link alone, host joint + link joint) + resident GPU time

and a placement reaches it when the cores and the link are busy together for the whole step.

The unit of placement is a layer: resident, streamed, host (its four projection groups on the host, its
activations handed over twice: qkv up for attention, attention down for o), mlp (gate_up and down on the
host, qkv and o streamed: one hand-off each way, ktransformers' split of a layer) or attention (qkv and o
resident, the MLP on the host).
A routed layer of a mixture-of-experts model computes its router and experts on the host; its qkv and o
follow the home, so such a layer is homed attention (qkv and o resident), mlp (streamed) or host, the split
llama.cpp's --n-cpu-moe makes.  Only qkv and o of a routed layer take VRAM; its experts are priced by the
bytes a step of M tokens is expected to read.  Where the placement has an experts' ring (a few slots of one
layer's every expert, EXPERT_RING), a layer homed attention may instead be homed experts in a step: its
router and experts on the GPU, every expert of the layer copied into a ring slot first.  The copy costs the
same at any step size while the host's reading grows with the experts the step's tokens choose (almost all
of them past a few dozen tokens), so prompt chunks and large batches stream the experts and decode steps
keep them on the host; place_for_tokens counts, per step size, how many routed layers stream.
Attention always runs on the GPU over the device KV pool, so a layer can change home between steps of
different sizes without moving its cache.  The embedding table stays on the host (a step gathers M rows of
it); lm_head is resident or computed on the host.

The choice, for a weight budget (the caller has taken KV, activations and workspace out of it):
- the ring: S slots of the largest streamed item, a copy running up to S-1 items ahead of the GPU, so a
  host layer's time is covered by copies of the streamed layers after it;
- resident: as many layers as the budget holds after the ring (and lm_head when it is resident), spread
  over the step so the copy engine also runs while they compute;
- per step size (M tokens), how many of the other layers the host computes: every count is simulated
  (simulate_step) and the fastest kept.  Streamed bytes are shared by the step's tokens and host compute
  grows with them, so larger steps stream more.

The step each candidate would run is priced by step_sim.py (the pool's rates, each op's cost on either side,
the host's and the copy engine's clocks); this module names the homes, turns a placement into that step's
work, and searches.  One concern, the offload placement: what a home means and the search over homes are
read together.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .ops import step_ops
from .step_sim import (ROUTED_GROUPS, PoolRates, StepSim, Work as _Work, aligned as _aligned, op_costs,
                       simulate_step)

HOMES = ("resident", "streamed", "host", "mlp", "attention", "experts")
MLP_GROUPS = ("gate_up", "down")
HOME_LETTERS = {"resident": "R", "streamed": "S", "host": "H", "mlp": "M", "attention": "A", "experts": "E"}
LETTERS_KEY = ("R resident, S streamed, H host, M MLP on the host, A qkv and o resident with the MLP on the host, "
               "E qkv and o resident with the experts streamed to the GPU")
FIXED_HOMES = ("resident", "attention", "experts")  # homes with weights in VRAM: kept by every step size
EXPERT_RING = 1                      # the experts' ring's index in step_sim's rings (0: the layers')
# a routed layer's home as what it does: its MLP is on the host whatever the home says
ROUTED_HOME = {"resident": "attention", "streamed": "mlp", "host": "host", "mlp": "mlp", "attention": "attention"}


def group_home(home: str, group: str) -> str:
    """Where a projection group of a layer homed `home` runs: resident, streamed or host.  A layer homed
    "mlp" computes its MLP (gate_up, down: three quarters of its bytes) on the host and streams qkv and o,
    so the host takes x once per layer (after o) and gives it back once (after down); a "host" layer runs
    all four groups there, handing over twice (qkv up for attention, attention down for o); an "attention"
    layer keeps qkv and o resident and hands over as an "mlp" one does.  A routed layer's router and
    experts (ROUTED_GROUPS) are on the host in every home but "experts" (qkv and o resident, the router and
    the experts streamed through the experts' ring)."""
    if group in ROUTED_GROUPS:
        return "streamed" if home == "experts" else "host"
    if home == "experts":
        return "resident"
    if home in ("mlp", "attention"):
        return "host" if group in MLP_GROUPS else ("streamed" if home == "mlp" else "resident")
    return home


def routed_homes(config, homes) -> tuple:
    """`homes` with each routed layer's home named for what it does (ROUTED_HOME): resident -> attention,
    streamed -> mlp."""
    return tuple(ROUTED_HOME[h] if config.moe_layer(i) else h for i, h in enumerate(homes))


LAYER_GROUPS = ("qkv", "o", "gate_up", "down")
SLOT_COUNTS = (2, 3, 4, 5, 6)      # ring sizes tried
HOST_KINDS = ("host", "mlp")         # the two ways a layer computes on the host



@dataclass
class OffloadPlacement:
    """Where each layer's projections run in steps of `tokens` tokens, and what that is predicted to cost."""
    tokens: int
    homes: tuple                   # per layer: one of HOMES
    head: str                      # lm_head: resident | host
    slot_count: int
    slot_bytes: int
    layer_bytes: tuple             # per layer: {projection group: device bytes}
    head_bytes: int
    predicted: StepSim
    roofline_us: float
    budget_bytes: int
    notes: list = field(default_factory=list)
    routed_bytes: int = 0          # routers and experts, held on the host (a mixture-of-experts model)
    routed_read_bytes: int = 0     # of them, what a step of `tokens` tokens is expected to read
    expert_slot_count: int = 0     # the experts' ring: slots of one routed layer's every expert (0: none)
    expert_slot_bytes: int = 0
    expert_image_bytes: int = 0    # the ring's pinned host images: every expert of each layer that may stream

    @property
    def expert_ring_bytes(self) -> int:
        return self.expert_slot_count * self.expert_slot_bytes

    @property
    def expert_streamed_bytes(self) -> int:
        """Expert bytes a step copies into the experts' ring (every expert of each layer homed experts)."""
        return self.homes.count("experts") * self.expert_slot_bytes

    def with_expert_ring(self, slot_count: int, slot_bytes: int, image_bytes: int = 0) -> "OffloadPlacement":
        from dataclasses import replace
        return replace(self, expert_slot_count=slot_count, expert_slot_bytes=slot_bytes,
                       expert_image_bytes=image_bytes, notes=list(self.notes))

    def _bytes(self, where: str) -> int:
        return (sum(b for groups, h in zip(self.layer_bytes, self.homes) for g, b in groups.items()
                    if group_home(h, g) == where) + (self.head_bytes if self.head == where else 0))

    @property
    def resident_bytes(self) -> int:
        return self._bytes("resident")

    @property
    def streamed_bytes(self) -> int:
        return self._bytes("streamed")

    @property
    def host_bytes(self) -> int:
        return self._bytes("host")

    @property
    def ring_bytes(self) -> int:
        return self.slot_count * self.slot_bytes

    def layers(self, home: str) -> tuple:
        return tuple(i for i, h in enumerate(self.homes) if h == home)

    def with_homes(self, homes, predicted: StepSim, tokens: int, routed_read_bytes: int = 0) -> "OffloadPlacement":
        return OffloadPlacement(tokens, tuple(homes), self.head, self.slot_count, self.slot_bytes,
                                self.layer_bytes, self.head_bytes, predicted, self.roofline_us, self.budget_bytes,
                                list(self.notes), self.routed_bytes, routed_read_bytes, self.expert_slot_count,
                                self.expert_slot_bytes, self.expert_image_bytes)

    def to_dict(self) -> dict:
        p = self.predicted
        return {"tokens": self.tokens, "homes": list(self.homes), "head": self.head,
                "slot_count": self.slot_count, "slot_bytes": self.slot_bytes,
                "resident_bytes": self.resident_bytes, "streamed_bytes": self.streamed_bytes,
                "host_bytes": self.host_bytes, "ring_bytes": self.ring_bytes, "budget_bytes": self.budget_bytes,
                "routed_bytes": self.routed_bytes, "routed_read_bytes": self.routed_read_bytes,
                "expert_slot_count": self.expert_slot_count, "expert_slot_bytes": self.expert_slot_bytes,
                "expert_streamed_bytes": self.expert_streamed_bytes, "expert_image_bytes": self.expert_image_bytes,
                "predicted_us": round(p.total_us, 1), "roofline_us": round(self.roofline_us, 1),
                "copy_busy_us": round(p.copy_busy_us, 1), "host_busy_us": round(p.host_busy_us, 1),
                "gpu_busy_us": round(p.gpu_busy_us, 1), "handoffs": p.handoffs}

    def describe(self) -> str:
        mb, p = 1e6, self.predicted
        letters = "".join(HOME_LETTERS[h] for h in self.homes)
        lines = [f"offload, M={self.tokens}: layers {letters} ({LETTERS_KEY}), lm_head {self.head}; "
                 f"resident {self.resident_bytes / mb:.1f} MB + ring {self.slot_count} x "
                 f"{self.slot_bytes / mb:.1f} MB of {self.budget_bytes / mb:.1f} MB; per step: streamed "
                 f"{self.streamed_bytes / mb:.1f} MB, host {self.host_bytes / mb:.1f} MB"
                 + (f", experts on the host {self.routed_read_bytes / mb:.1f} MB (expected) of "
                    f"{self.routed_bytes / mb:.1f} MB" if self.routed_bytes else "")
                 + (f", experts streamed {self.expert_streamed_bytes / mb:.1f} MB through a ring of "
                    f"{self.expert_slot_count} x {self.expert_slot_bytes / mb:.1f} MB from "
                    f"{self.expert_image_bytes / mb:.1f} MB of pinned host images" if self.expert_slot_count
                    else ""),
                 f"  predicted {p.total_us / 1e3:.2f} ms (copy engine busy {p.copy_busy_us / 1e3:.2f}, host "
                 f"{p.host_busy_us / 1e3:.2f}, GPU {p.gpu_busy_us / 1e3:.2f}, {p.handoffs} hand-offs); roofline "
                 f"{self.roofline_us / 1e3:.2f} ms ({self.roofline_us / max(p.total_us, 1e-9):.0%} of it)"]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _layer_items(config) -> tuple[list, int, int]:
    """(per layer device bytes of each projection group, largest group, lm_head device bytes)."""
    ops = step_ops(config, 1)
    per_layer = [{} for _ in range(config.num_hidden_layers)]
    head = 0
    for op in ops:
        if op.group == "lm_head":
            head = _aligned(op.weight_bytes)
        elif op.group:
            per_layer[op.layer][op.group] = _aligned(op.weight_bytes)
    largest = max(max(groups.values()) for groups in per_layer)
    return per_layer, largest, head


def _work(costs: list, homes, head: str) -> list:
    out, item, expert_item = [], 0, 0
    for c in costs:
        if c.nbytes < 0:
            out.append(_Work("host", c.host_us, c.host_joint_us, 0))
            continue
        home = (head if c.head else group_home(homes[c.layer], c.group)) if c.placed else "resident"
        if home == "host":
            out.append(_Work("host", c.host_us, c.host_joint_us, 0))
        elif home == "streamed" and c.group in ROUTED_GROUPS:   # the router reads no slot; experts, the layer's
            ring = c.group == "experts"
            out.append(_Work("gpu", c.gpu_us, c.gpu_us, c.launches, expert_item if ring else -1,
                             c.nbytes if ring else 0, EXPERT_RING if ring else 0))
            expert_item += ring
        elif home == "streamed":
            out.append(_Work("gpu", c.gpu_us, c.gpu_us, c.launches, item, c.nbytes))
            item += 1
        else:
            out.append(_Work("gpu", c.gpu_us, c.gpu_us, c.launches))
    return out


def spread(counts: dict, length: int) -> tuple:
    """`length` homes with counts[home] of each, every home spread evenly over the positions."""
    assert sum(counts.values()) == length, (counts, length)
    placed, taken = [], {home: 0 for home in counts}
    for i in range(length):
        # the home furthest behind its even share at position i
        home = max(counts, key=lambda h: (counts[h] * (i + 1) / length - taken[h], counts[h]))
        placed.append(home)
        taken[home] += 1
    return tuple(placed)


def _homes(resident: tuple, flexible_hosts: int, kind: str = "host") -> tuple:
    """The layers not resident split into `kind` (host or mlp) and streamed layers, each spread evenly among
    them."""
    flexible = [i for i, h in enumerate(resident) if h not in FIXED_HOMES]
    order = spread({kind: flexible_hosts, "streamed": len(flexible) - flexible_hosts}, len(flexible))
    homes = list(resident)
    for layer, home in zip(flexible, order):
        homes[layer] = home
    return tuple(homes)


def _predict(costs, homes, head, slot_count, profile, rates, expert_slot_count: int = 0) -> StepSim:
    return simulate_step(_work(costs, homes, head), (slot_count, max(expert_slot_count, 1)), profile, rates)


def with_resident_experts(placement: OffloadPlacement, config, profile, share: float) -> OffloadPlacement:
    """`placement` predicted again with `share` of the experts' choices on resident experts (the device's
    part of each routed layer): the host reads the rest."""
    rates = PoolRates.of(profile)
    costs = op_costs(config, placement.tokens, 0, profile, rates, placement.expert_slot_bytes,
                     resident_expert_share=share)
    sim = _predict(costs, placement.homes, placement.head, max(placement.slot_count, 1), profile, rates,
                   placement.expert_slot_count)
    experts = sum(op.active_weight_bytes for op in step_ops(config, placement.tokens)
                  if op.kind == "experts" and placement.homes[op.layer] != "experts")
    read = int(_routed_bytes(config, placement.tokens, placement.homes)[1] - share * experts)
    return placement.with_homes(placement.homes, sim, placement.tokens, read)


def roofline_us(config, homes, head, profile, tokens: int = 1, context_len: int = 0,
                expert_layer_bytes: int = 0) -> float:
    """The floor of a step with these resident weights: the non-resident bytes at the pool's best rate (a
    layer homed experts: its every expert, `expert_layer_bytes`), plus the GPU time of the resident ops (and
    attention)."""
    per_layer, _, head_bytes = _layer_items(config)
    rates = PoolRates.of(profile)
    off = sum(b for g, h in zip(per_layer, homes) for group, b in g.items() if group_home(h, group) != "resident")
    off += (head_bytes if head != "resident" else 0) + _routed_bytes(config, tokens, homes)[1]
    off += homes.count("experts") * expert_layer_bytes
    costs = op_costs(config, tokens, context_len, profile, rates)
    gpu = sum(w.us for w in _work(costs, homes, head) if w.side == "gpu" and w.item < 0)
    return rates.best_us(off) + gpu


def _routed_bytes(config, tokens: int, homes=None) -> tuple[int, int]:
    """(bytes of every router and expert, of them the bytes the host reads in a step of `tokens` tokens:
    those it is expected to choose, in the layers whose experts are not streamed)."""
    ops = [op for op in step_ops(config, tokens) if op.kind in ROUTED_GROUPS]
    return (sum(op.weight_bytes for op in ops),
            sum(op.active_weight_bytes for op in ops if homes is None or homes[op.layer] != "experts"))


def _resident_base(layer_bytes, room: int) -> tuple:
    """As many layers "resident" as `room` holds, spread evenly over the step, the others "other".  Layers
    are alike, but where they are not (a mixture-of-experts model's dense layers hold more in VRAM than its
    routed ones) the count shrinks until the layers the spread picks fit."""
    count, used = 0, 0
    for b in sorted(layer_bytes):
        if used + b > room:
            break
        used += b
        count += 1
    L = len(layer_bytes)
    while True:
        base = spread({"resident": count, "other": L - count}, L)
        if not count or sum(b for b, h in zip(layer_bytes, base) if h == "resident") <= room:
            return base
        count -= 1


def place(config, budget_bytes: int, profile, tokens: int = 1, context_len: int = 0,
          slot_counts=SLOT_COUNTS) -> OffloadPlacement:
    """The placement predicted fastest for steps of `tokens` tokens under a weight budget (bytes).  In a
    mixture-of-experts model only qkv and o of a routed layer count against the budget: a routed layer that
    fits is homed attention."""
    per_layer, largest, head_bytes = _layer_items(config)
    layer_bytes = tuple(sum(g.values()) for g in per_layer)
    group_bytes = tuple(dict(g) for g in per_layer)
    rates = PoolRates.of(profile)
    costs = op_costs(config, tokens, context_len, profile, rates)
    best = None
    for head in ("resident", "host"):
        left = budget_bytes - (head_bytes if head == "resident" else 0)
        if left < 0:
            continue
        fits = sum(layer_bytes) <= left
        for slots in (0,) + tuple(slot_counts):     # 0: no ring, the layers not resident on the host
            if slots and (left < slots * largest or fits):
                continue                         # no room for this ring, or no need of one
            if not slots and left >= min(slot_counts) * largest and not fits:
                continue                         # a ring fits and some layer needs one
            base = _resident_base(layer_bytes, left - slots * largest)
            flexible = base.count("other")
            choices = [(k, n) for k in HOST_KINDS for n in range(1, flexible + 1)] + [("host", 0)]
            if not slots:
                choices = [("host", flexible)]
            for kind, hosts in choices:
                homes = _homes(base, hosts, kind)
                sim = _predict(costs, homes, head, max(slots, 1), profile, rates)
                if best is None or sim.total_us < best[0].total_us - 1e-6:
                    best = (sim, homes, head, slots)
    if best is None:
        raise ValueError(f"offload placement: a weight budget of {budget_bytes} B holds nothing")
    sim, homes, head, slots = best
    homes = routed_homes(config, homes)
    placement = OffloadPlacement(tokens, homes, head, slots, largest if slots else 0, group_bytes, head_bytes, sim,
                                 roofline_us(config, homes, head, profile, tokens, context_len), budget_bytes,
                                 [], *_routed_bytes(config, tokens))
    return placement


def parse_homes(text: str, layers: int) -> tuple[tuple, str | None]:
    """'HSRM...' (a letter per layer, HOME_LETTERS) with an optional ':host' or ':resident' for lm_head, as
    KESTREL_OFFLOAD_HOMES gives it -> (homes, head or None).  Errors name the input."""
    letters, _, head = text.strip().partition(":")
    by_letter = {v: k for k, v in HOME_LETTERS.items()}
    if len(letters) != layers or any(ch not in by_letter for ch in letters.upper()):
        raise ValueError(f"KESTREL_OFFLOAD_HOMES={text!r}: expected {layers} letters of "
                         f"{''.join(by_letter)} ({LETTERS_KEY}), then optionally :host or :resident for lm_head")
    if head not in ("", "host", "resident"):
        raise ValueError(f"KESTREL_OFFLOAD_HOMES={text!r}: lm_head is :host or :resident, not :{head}")
    return tuple(by_letter[ch] for ch in letters.upper()), head or None


def place_given(config, budget_bytes: int, profile, homes: tuple, head: str | None = None, tokens: int = 1,
                context_len: int = 0) -> OffloadPlacement:
    """A placement with the layers' homes given (a bench's or a test's); lm_head resident if the budget
    holds it beside the resident layers and the ring (unless `head` says), the ring as large as the rest
    allows, up to the largest of SLOT_COUNTS.  A routed layer's home is named for what it does (routed_homes)."""
    per_layer, largest, head_bytes = _layer_items(config)
    homes = routed_homes(config, homes)
    rates = PoolRates.of(profile)
    costs = op_costs(config, tokens, context_len, profile, rates)
    resident = sum(b for g, h in zip(per_layer, homes) for group, b in g.items() if group_home(h, group) == "resident")
    streams = any(group_home(h, g) == "streamed" for groups, h in zip(per_layer, homes) for g in groups)
    if head is None:
        head = "resident" if budget_bytes - resident - SLOT_COUNTS[0] * largest * streams >= head_bytes else "host"
    left = budget_bytes - resident - (head_bytes if head == "resident" else 0)
    slots = min(max(SLOT_COUNTS), left // largest) if streams else 0
    if left < 0 or (streams and slots < 2):
        raise ValueError(f"offload placement {''.join(HOME_LETTERS[h] for h in homes)} (lm_head {head}): "
                         f"{resident + (head_bytes if head == 'resident' else 0)} B resident and a ring of two "
                         f"{largest} B slots exceed the weight budget of {budget_bytes} B")
    sim = _predict(costs, homes, head, max(slots, 1), profile, rates)
    return OffloadPlacement(tokens, tuple(homes), head, slots, largest if slots else 0,
                            tuple(dict(g) for g in per_layer), head_bytes, sim,
                            roofline_us(config, homes, head, profile, tokens, context_len), budget_bytes,
                            ["homes given (KESTREL_OFFLOAD_HOMES)"], *_routed_bytes(config, tokens))


def place_for_tokens(base: OffloadPlacement, config, profile, tokens: int, context_len: int = 0) -> OffloadPlacement:
    """`base`'s resident layers, lm_head and ring kept (what is in VRAM does not change between steps); the
    other layers split between the host and the ring as predicted fastest for steps of `tokens` tokens.
    Homes given (KESTREL_OFFLOAD_HOMES) are kept for every step size."""
    if base.notes and base.notes[0].startswith("homes given"):
        return place_given(config, base.budget_bytes, profile, base.homes,
                           base.head, tokens, context_len)
    rates = PoolRates.of(profile)
    costs = op_costs(config, tokens, context_len, profile, rates, base.expert_slot_bytes)
    resident = tuple(("attention" if h == "experts" else h) if h in FIXED_HOMES else "other" for h in base.homes)
    flexible = resident.count("other")
    choices = [(k, n) for k in HOST_KINDS for n in range(1, flexible + 1)] + [("host", 0)]
    if not base.slot_count:
        choices = [("host", flexible)]
    best = None
    for kind, hosts in choices:
        homes = _homes(resident, hosts, kind)
        sim = _predict(costs, homes, base.head, max(base.slot_count, 1), profile, rates)
        if best is None or sim.total_us < best[0].total_us - 1e-6:
            best = (sim, homes)
    sim, homes = best
    homes = routed_homes(config, homes)
    if base.expert_slot_count:
        sim, homes = _stream_experts(costs, homes, base, profile, rates)
    placement = base.with_homes(homes, sim, tokens, _routed_bytes(config, tokens, homes)[1])
    placement.roofline_us = roofline_us(config, homes, base.head, profile, tokens, context_len,
                                        base.expert_slot_bytes)
    return placement


def _stream_experts(costs, homes: tuple, base: OffloadPlacement, profile, rates) -> tuple[StepSim, tuple]:
    """(the predicted step, the homes) with as many routed layers homed attention turned experts (their
    experts streamed through the experts' ring), spread evenly, as is predicted fastest: none keeps every
    expert on the host, some keep the cores and the link busy together, all suit a step that reads nearly
    every expert of every layer."""
    attention = [i for i, h in enumerate(homes) if h == "attention"]
    best = None
    for count in range(len(attention) + 1):
        order = spread({"experts": count, "attention": len(attention) - count}, len(attention))
        trial = list(homes)
        for layer, home in zip(attention, order):
            trial[layer] = home
        sim = _predict(costs, trial, base.head, max(base.slot_count, 1), profile, rates, base.expert_slot_count)
        if best is None or sim.total_us < best[0].total_us - 1e-6:
            best = (sim, tuple(trial))
    return best


def streaming_only(config, budget_bytes: int, profile, tokens: int = 1, slot_count: int = 2) -> StepSim | None:
    """The predicted step of the window alone (every non-resident layer streamed), for the comparison that
    picks between it and a placement with host work; None when the budget holds no ring."""
    per_layer, largest, head_bytes = _layer_items(config)
    layer_bytes = [sum(g.values()) for g in per_layer]
    room = budget_bytes - head_bytes - slot_count * largest
    if room < 0:
        return None
    homes = _homes(_resident_base(layer_bytes, room), 0)
    rates = PoolRates.of(profile)
    return _predict(op_costs(config, tokens, 0, profile, rates), homes, "resident", slot_count, profile, rates)
