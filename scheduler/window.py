"""VRAM residency window: a fixed resident set plus a ring of streaming slots.

Decode visits the layers cyclically, so an LRU cache smaller than the model
evicts exactly the weight needed next and misses on every access. Instead a
fixed set stays resident and everything else streams through a ring of
`slot_count` slots, each copy issued `prefetch_distance` streamed items ahead
of its use: every streamed item is copied exactly once per step and nothing
resident is ever evicted.

Which items stay resident: the choice that minimises bytes streamed per step.
Each candidate slot size (the largest streamed item must fit a slot) forces
the items larger than it to be resident, then fills the rest of the budget by
bytes saved per step per resident byte. Explicit decisions:
- lm_head is an ordinary item; being the largest, it is usually forced
  resident, because streaming it would make every slot that large. Its
  reason says which way it went.
- embed (an untied table) is never streamed: a step gathers only M rows of
  it. It is resident if the budget has room after everything else, otherwise
  it runs on the host. A tied table belongs to lm_head.
- items under `small_item_bytes` (norm vectors) are always resident: a copy
  of a few KB costs a slot and a sync edge for nothing.
Budget: weights only; the caller subtracts KV cache, activations and
workspace first.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class WindowBudgetError(ValueError):
    """The weight budget cannot hold one streaming slot plus what must stay resident."""


@dataclass(frozen=True)
class WindowItem:
    name: str                 # streaming unit: one op's weights ("L3.gate_up", "lm_head")
    nbytes: int
    saved_bytes_per_step: int  # PCIe bytes per step that residency saves
    streamable: bool = True   # False: resident or run on the host (embed)


def window_items(ops) -> list:
    """Items of the ops that run on the GPU (in step order), one per op owning weights."""
    items = []
    for op in ops:
        if not op.weights:
            continue
        if op.kind == "embed":  # gathers M rows: residency saves only those rows' bytes
            items.append(WindowItem(op.name, op.weight_bytes, op.output_bytes, False))
        else:
            items.append(WindowItem(op.name, op.weight_bytes, op.weight_bytes))
    return items


@dataclass
class WindowPlan:
    budget_bytes: int
    slot_count: int
    slot_bytes: int             # 0 when nothing streams
    prefetch_distance: int      # streamed items between a copy's issue and its use
    resident: tuple             # item names, step order
    streamed: tuple             # item names, step order (the cyclic access of the ring)
    on_host: tuple              # non-streamable items left to the host
    resident_bytes: int
    streamed_bytes_per_step: int
    reasons: dict = field(default_factory=dict)

    @property
    def ring_bytes(self) -> int:
        return self.slot_count * self.slot_bytes if self.streamed else 0

    @property
    def used_bytes(self) -> int:
        return self.resident_bytes + self.ring_bytes

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()} | {
            "ring_bytes": self.ring_bytes, "used_bytes": self.used_bytes}

    def describe(self) -> str:
        lines = [f"window: budget {self.budget_bytes / 1e6:.1f} MB, resident "
                 f"{self.resident_bytes / 1e6:.1f} MB ({len(self.resident)} items), ring "
                 f"{self.slot_count} x {self.slot_bytes / 1e6:.1f} MB, streamed "
                 f"{self.streamed_bytes_per_step / 1e6:.1f} MB/step ({len(self.streamed)} items), "
                 f"prefetch distance {self.prefetch_distance}"]
        lines += [f"  {name}: {why}" for name, why in self.reasons.items()
                  if name in ("lm_head", "embed") or name in self.on_host]
        return "\n".join(lines)


def _choose(items, budget_bytes, slot_bytes, slot_count, always):
    """(resident names or None if it does not fit, (need, slot_bytes, forced items))."""
    forced = [i for i in items if i.name in always or (i.streamable and i.nbytes > slot_bytes)]
    need = sum(i.nbytes for i in forced) + slot_count * slot_bytes
    if need > budget_bytes:
        return None, (need, slot_bytes, forced)
    room = budget_bytes - need
    resident = {i.name for i in forced}
    optional = [i for i in items if i.name not in resident]
    optional.sort(key=lambda i: (-i.saved_bytes_per_step / max(i.nbytes, 1), -i.nbytes))
    for item in optional:  # first fit, densest saving first
        if item.nbytes <= room:
            resident.add(item.name)
            room -= item.nbytes
    return resident, (need, slot_bytes, forced)


def plan_window(items, budget_bytes: int, slot_count: int = 2, prefetch_distance: int = 1,
                small_item_bytes: int = 64 * 1024, pinned: dict | None = None) -> WindowPlan:
    """Choose the resident set and ring for `items` (step order) under a weight budget.

    pinned: {item name: why} kept resident whatever the budget (an executor's constraint,
    e.g. the table its embed kernel gathers from); the reason appears in the plan.
    """
    pinned = {name: why for name, why in (pinned or {}).items() if any(i.name == name for i in items)}
    if slot_count < 1:
        raise ValueError(f"slot_count={slot_count}: the ring needs at least one slot")
    if not 0 <= prefetch_distance < slot_count:
        raise ValueError(f"prefetch_distance={prefetch_distance} with slot_count={slot_count}: "
                         "a copy may run at most slot_count-1 items ahead, or it would "
                         "overwrite a slot still being read")
    always = {i.name for i in items if i.nbytes <= small_item_bytes} | set(pinned)
    candidates = sorted({i.nbytes for i in items if i.streamable and i.name not in always})
    best, smallest = None, None
    for slot_bytes in [0] + candidates:  # 0: nothing streams, no ring
        resident, need = _choose(items, budget_bytes, slot_bytes, slot_count if slot_bytes else 0,
                                 always)
        smallest = need if smallest is None or need[0] < smallest[0] else smallest
        if resident is None:
            continue
        streamed = [i for i in items if i.streamable and i.name not in resident]
        cost = sum(i.saved_bytes_per_step for i in streamed)
        if best is None or cost < best[0]:
            best = (cost, resident, streamed)
    if best is None:
        need_bytes, slot_bytes, forced = smallest
        largest = sorted(forced, key=lambda i: -i.nbytes)[:3]
        raise WindowBudgetError(
            f"weight budget {budget_bytes} B ({budget_bytes / 2**20:.1f} MiB) is too small: "
            f"the smallest window needs {need_bytes} B ({need_bytes / 2**20:.1f} MiB) = "
            f"{slot_count} slot(s) x {slot_bytes} B + {need_bytes - slot_count * slot_bytes} B "
            f"that must stay resident ({len(forced)} items, largest: "
            f"{', '.join(f'{i.name} {i.nbytes} B' for i in largest)}); "
            "raise --vram-budget or use fewer streaming slots")
    cost, resident, streamed = best
    slot_bytes = max((i.nbytes for i in streamed), default=0)
    reasons = {}
    for i in items:
        if i.name in resident:
            reasons[i.name] = (f"resident: {pinned[i.name]}" if i.name in pinned else
                               "resident: too small to stream" if i.name in always else
                               f"resident: saves {i.saved_bytes_per_step} B/step")
        elif i.streamable:
            reasons[i.name] = f"streamed through the ring: {i.nbytes} B/step"
        else:
            reasons[i.name] = ("on the host: the budget has no room and streaming a table "
                               f"of {i.nbytes} B to gather {i.saved_bytes_per_step} B wastes PCIe")
    return WindowPlan(
        budget_bytes=budget_bytes, slot_count=slot_count, slot_bytes=slot_bytes,
        prefetch_distance=prefetch_distance,
        resident=tuple(i.name for i in items if i.name in resident),
        streamed=tuple(i.name for i in streamed),
        on_host=tuple(i.name for i in items if not i.streamable and i.name not in resident),
        resident_bytes=sum(i.nbytes for i in items if i.name in resident),
        streamed_bytes_per_step=cost, reasons=reasons)
