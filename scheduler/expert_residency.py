"""Which experts of a mixture-of-experts model stay resident on the device: the pool's slots given to the
experts a step is most likely to read, by routing frequency.

Counts are each routed layer's selections per expert (the router counts every choice it makes, on the host
and on the device), gathered while steps run or from a calibration prompt.  Every routed layer sees each
token k times, so an expert's share of its layer's selections is the share of that layer's expert reads it
would save by being resident, and the expected resident share of a choice is the mean over routed layers
of the resident experts' shares (the hit rate the steps will see if routing keeps its frequencies).

The expert pool holds `slots` experts of any layers (a slot is as large as the largest expert), so every
resident expert costs one slot and the choice that maximizes the expected share takes the `slots` largest
shares over all layers (ties: the lower layer, then the lower id).  The uniform choice, blind to the
counts, gives every layer the same number of slots (the first layers one more where they do not divide)
and spreads them evenly over the expert ids: what any choice expects under uniform routing.

Pure Python (counts: any [layers][experts] sequence of numbers, numpy arrays too); scheduler/ imports no
CUDA and no numpy.
"""
from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("frequency", "uniform")


@dataclass(frozen=True)
class ResidentExperts:
    """The resident experts per routed layer (layer -> ascending expert ids) and why."""
    experts: dict
    policy: str
    slots: int                  # the pool's slots (some may be free)
    expected_share: float       # of the expert reads, under the counts it was chosen from

    @property
    def used_slots(self) -> int:
        return sum(len(ids) for ids in self.experts.values())

    def ids(self, layer: int) -> tuple:
        return self.experts.get(layer, ())

    def slot_table(self) -> dict:
        """(layer, expert) -> its slot in the pool: slots taken in layer order, then expert order."""
        table, slot = {}, 0
        for layer in sorted(self.experts):
            for e in self.experts[layer]:
                table[layer, e] = slot
                slot += 1
        return table

    def describe(self, num_experts: int) -> str:
        per_layer = " ".join(f"{layer}:{len(ids)}" for layer, ids in sorted(self.experts.items()) if ids)
        return (f"resident experts ({self.policy}): {self.used_slots} of {self.slots} slots, "
                f"{num_experts} experts a layer; expected resident share {self.expected_share:.1%}"
                + (f"; per layer {per_layer}" if per_layer else ""))


def layer_shares(counts, layers) -> dict:
    """layer -> [share of each expert in the layer's selections]; uniform where a layer has counted none."""
    shares = {}
    for n, layer in enumerate(layers):
        row = [float(c) for c in counts[n]]
        total = sum(row)
        shares[layer] = [c / total for c in row] if total > 0 else [1.0 / len(row)] * len(row)
    return shares


def expected_share(counts, layers, experts: dict) -> float:
    """The mean over routed layers of the resident experts' shares of the layer's selections."""
    if not layers:
        return 0.0
    shares = layer_shares(counts, layers)
    return sum(sum(shares[layer][e] for e in experts.get(layer, ())) for layer in layers) / len(layers)


def hit_rate(counts, layers, experts: dict) -> float:
    """Of all selections counted, the share that found their expert resident (pooled over layers)."""
    total = sum(float(c) for row in counts for c in row)
    hits = sum(float(counts[n][e]) for n, layer in enumerate(layers) for e in experts.get(layer, ()))
    return hits / total if total else 0.0


def choose(counts, layers, num_experts: int, slots: int, policy: str = "frequency") -> ResidentExperts:
    """The resident set of `slots` experts over the routed `layers` (counts[n]: layer layers[n]'s selections
    per expert), by `policy` (POLICIES)."""
    if policy not in POLICIES:
        raise ValueError(f"resident experts policy {policy!r}: one of {', '.join(POLICIES)}")
    slots = max(0, min(slots, num_experts * len(layers)))
    if policy == "uniform":
        experts = _uniform(layers, num_experts, slots)
    else:
        shares = layer_shares(counts, layers)
        ranked = sorted(((-shares[layer][e], n, e) for n, layer in enumerate(layers) for e in range(num_experts)))
        if all(float(c) == 0 for row in counts for c in row):
            experts = _uniform(layers, num_experts, slots)      # nothing counted yet: nothing to prefer
        else:
            experts = {layer: [] for layer in layers}
            for _, n, e in ranked[:slots]:
                experts[layers[n]].append(e)
    experts = {layer: tuple(sorted(ids)) for layer, ids in experts.items()}
    return ResidentExperts(experts, policy, slots, expected_share(counts, layers, experts))


def _uniform(layers, num_experts: int, slots: int) -> dict:
    experts = {}
    for n, layer in enumerate(layers):
        count = slots // len(layers) + (1 if n < slots % len(layers) else 0) if layers else 0
        experts[layer] = [i * num_experts // count for i in range(count)] if count else []
    return experts
