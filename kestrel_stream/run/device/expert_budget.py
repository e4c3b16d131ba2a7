"""Mode offload's experts in the VRAM budget (budget.plan_offload_memory asks): the experts' ring's slots in
the room the layers leave, the resident experts beside it, and whether the host can hold the ring's pinned
images (every expert of each routed layer that may stream, in the pool's layout).

Pure arithmetic, no CUDA, as budget.py.
"""
from __future__ import annotations

from kestrel_stream.run.device import expert_pool
from kestrel_stream.run.device.expert_pool import ALIGN
from scheduler.window import WindowBudgetError

# host memory the experts' ring's pinned images leave beside the model's host-read weights: the process's other
# pinned buffers (state copies, the window's images), the host experts' numpy and pool temporaries, the
# tokenizer and Python, and the rest of the machine's working set that MemAvailable's estimate misses
HOST_MARGIN_BYTES = 4 << 30


class HostMemoryError(ValueError):
    """The host cannot hold the experts' ring's pinned images (KESTREL_STREAM_EXPERTS=on)."""


EXPERT_RING_SLOTS = 2     # a routed layer's experts stream while the layer before computes on the slot beside


def expert_ring_slots(c, room_bytes: int, placement, profile, max_tokens: int, stream_experts: str,
                      budget_bytes: int) -> int:
    """Slots of mode offload's experts' ring (0: none) in a room of `room_bytes` the layers leave: on, a ring
    (a budget that cannot hold it is refused); auto, a ring where it fits beside the routers, the room does
    not hold every expert resident, and the cost model streams some layer's experts in a step of `max_tokens`
    tokens (the largest the engine runs); off, none.  The ring comes before the resident experts: it is what
    prompt chunks and large batches use."""
    from kestrel_stream.cuda.moe_kernels import MAX_EXPERTS
    from scheduler import offload
    if stream_experts == "off" or c.num_experts > MAX_EXPERTS:
        return 0
    needed = expert_pool.ring_bytes(c, EXPERT_RING_SLOTS) + expert_pool.router_bytes(c) + ALIGN
    if needed > room_bytes:
        if stream_experts == "on":
            mib = 2**20
            raise WindowBudgetError(
                f"--vram-budget {budget_bytes} B ({budget_bytes / mib:.1f} MiB) is too small for mode offload's "
                f"experts' ring (KESTREL_STREAM_EXPERTS=on): {EXPERT_RING_SLOTS} slots of a routed layer's "
                f"{c.num_experts} experts and the routers take {needed / mib:.1f} MiB, the KV pool, activations "
                f"and resident layers leave {max(room_bytes, 0) / mib:.1f} MiB; raise --vram-budget by "
                f"{(needed - room_bytes) / mib:.1f} MiB or set KESTREL_STREAM_EXPERTS=auto (the experts on the "
                "host when the ring does not fit)")
        return 0
    if stream_experts == "on":
        return EXPERT_RING_SLOTS
    if resident_expert_slots(c, room_bytes) >= expert_pool.all_experts(c):
        return 0                             # every expert resident: nothing to stream
    ringed = placement.with_expert_ring(EXPERT_RING_SLOTS, expert_pool.layer_slot_bytes(c))
    largest = offload.place_for_tokens(ringed, c, profile, max_tokens)
    return EXPERT_RING_SLOTS if "experts" in largest.homes else 0


def expert_image_layers(c, placement) -> list[int]:
    """The routed layers the experts' ring keeps a pinned image of: those a step may stream (homed attention in
    a one-token step, whose homes every step size keeps; or homed experts where the homes are given)."""
    return [i for i, h in enumerate(placement.homes) if c.moe_layer(i) and h in ("attention", "experts")]


def expert_image_bytes(c, placement) -> int:
    """Pinned host bytes of the experts' ring's images: one ring slot's layout per layer that may stream."""
    return len(expert_image_layers(c, placement)) * expert_pool.layer_slot_bytes(c)


def host_reserve_bytes(placement, window_pinned_bytes: int = 0) -> int:
    """Host memory the ring's images leave free by default: the weights the host reads every step (the routed
    layers' experts and the host-homed projections, pages of the model file's mapping that MemAvailable counts
    as droppable cache), the window's pinned images of the streamed projections (`window_pinned_bytes`, taken
    after MemAvailable is read) and HOST_MARGIN_BYTES for the process and the machine."""
    return placement.routed_bytes + placement.host_bytes + window_pinned_bytes + HOST_MARGIN_BYTES


def expert_images_fit(c, placement, stream_experts: str, available_bytes: int | None, reserve: int,
                      given: bool = False) -> str:
    """"" where the experts' ring's pinned images fit the host memory `available_bytes` (MemAvailable; None:
    unknown, not checked) less `reserve` (host_reserve_bytes, or KESTREL_HOST_RESERVE's where `given`); else,
    for auto, the sentence saying the ring was left out, naming the bytes; for on, HostMemoryError naming them."""
    needed = expert_image_bytes(c, placement)
    if available_bytes is None or not needed:
        return ""
    room = max(available_bytes - reserve, 0)
    if needed <= room:
        return ""
    layers = len(expert_image_layers(c, placement))
    kept = "by KESTREL_HOST_RESERVE" if given else "for the model's host-read weights and the process"
    what = (f"its pinned host images (every expert of {layers} routed layers) take {size_text(needed)}, the host "
            f"can give {size_text(room)} (MemAvailable {size_text(available_bytes)} less {size_text(reserve)} kept "
            f"{kept})")
    if stream_experts == "on":
        raise HostMemoryError(
            f"mode offload's experts' ring (KESTREL_STREAM_EXPERTS=on): {what}; free "
            f"{size_text(needed - room)} of host memory, lower KESTREL_HOST_RESERVE (0 keeps nothing back: the "
            "model's pages may then be dropped and read again from disk) or set KESTREL_STREAM_EXPERTS=auto (the "
            "experts of every step on the host when the images do not fit)")
    return (f"experts' ring left out for host memory: {what}; prompt steps keep the experts on the host "
            f"(KESTREL_HOST_RESERVE=SIZE lowers what is kept back, 0 builds the ring wherever MemAvailable "
            f"holds its images; KESTREL_STREAM_EXPERTS=off says no ring without this line)")


def size_text(nbytes: int) -> str:
    """2.5 GB, 31.4 MB: a size for a message."""
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def resident_expert_slots(c, room_bytes: int) -> int:
    """Experts a room of `room_bytes` holds in mode offload beside the routers (none if not the routers)."""
    from kestrel_stream.cuda.moe_kernels import MAX_EXPERTS
    room = room_bytes - expert_pool.router_bytes(c) - ALIGN
    slot_bytes = expert_pool.pool_layout(c).slot_bytes
    if room <= 0 or c.num_experts > MAX_EXPERTS:
        return 0
    return max(0, min(expert_pool.all_experts(c), room // slot_bytes))
