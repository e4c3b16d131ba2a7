"""The VRAM budget (parsed by options.parse_vram_budget) split over the `gpu` mode's device arena; the
arena and KV pool of the mixed modes (plan_mixed_memory).

Pure arithmetic, no CUDA: the arena holds the KV caches, the activations and
workspace of one step, and the weights; the weights get what the rest leaves,
and when they do not all fit, scheduler.window picks the resident set and the
streaming ring.  `plan_arena` returns the arena's capacity, never above the
budget, or raises WindowBudgetError naming every number.

One concern, the split of one budget: every mode's parts (KV pool, activations, weights, mode offload's ring
and resident experts) are sized against each other here, so a part that grows is taken from the others in
one place.  How many experts' ring slots and resident experts a room holds, and whether the host holds the
ring's pinned images, are expert_budget.py's answers, asked here.
"""
from __future__ import annotations

from dataclasses import dataclass

from kestrel_stream.cuda import mma_variants
from kestrel_stream.cuda.flash_attention import partial_floats
from kestrel_stream.options import parse_vram_budget  # noqa: F401  (importable from here too)
from kestrel_stream.run.device import expert_pool
from kestrel_stream.run.device.expert_budget import (expert_image_bytes, expert_images_fit, expert_ring_slots,
                                                     host_reserve_bytes, resident_expert_slots)
from scheduler import expert_residency
from scheduler.offload import group_home
from scheduler.ops import image_bytes, step_ops  # noqa: F401  (image_bytes: window.py and the tests import it here)
from scheduler.window import WindowBudgetError, WindowPlan, plan_window, window_items

ALIGN = 256                      # the arena's sub-allocation alignment (driver.Arena.ALIGN)
DEFAULT_MARGIN_BYTES = 512 << 20  # left free for the driver, modules and graphs when no budget is given
def resolve_budget(budget: int | float | None, free_bytes: int, full_bytes: int) -> int | None:
    """Bytes for a parsed budget; a fraction applies to the VRAM free now.

    No budget: None (no limit) while everything (`full_bytes`) fits the free VRAM less a
    margin, else that much, so a model larger than the GPU streams instead of failing.
    """
    if isinstance(budget, float):
        return int(budget * free_bytes)
    if budget is None and full_bytes > free_bytes - DEFAULT_MARGIN_BYTES:
        return max(free_bytes - DEFAULT_MARGIN_BYTES, 0)
    return budget


@dataclass(frozen=True)
class ArenaNeeds:
    """What the arena holds besides the Q8 weights (as GpuExecutor allocates it)."""
    kv_bytes: int             # sessions x max_seq_len positions
    activation_bytes: int     # static step buffers, norm vectors, rope table, params block
    slack_bytes: int          # per-allocation alignment
    sessions: int
    max_seq_len: int
    expert_bytes: int = 0     # a mixture-of-experts model's routers and device experts (expert_pool.py)

    @property
    def total(self) -> int:
        return self.kv_bytes + self.activation_bytes + self.slack_bytes + self.expert_bytes


ARGMAX_SPLITS = 64           # argmax_split's blocks per row (step_io.py)
CHAIN_STEPS_PER_SYNC = 256   # greedy_chain.MAX_STEPS_PER_SYNC
SAMPLE_CANDIDATE_WORDS = 64 * (2 * 64 + 4)   # per logits row: sampler.py's most splits x (2 x SAMPLE_CAP + 4)
DEFAULT_MAX_SESSIONS = 256  # block-table rows (8 bytes per block of max_seq_len each): cheap, unlike KV
PREFILL_CHUNK_TOKENS = 512   # tokens per prefill step in gpu mode (tensor-core GEMM tiles of 64 tokens)
# an executor's (max_seq_len, max_batch, prefill_chunk) when not given: gpu mode's (True), the mixed modes'
EXECUTOR_DEFAULTS = {True: (4096, 8, PREFILL_CHUNK_TOKENS), False: (2048, 32, 64)}


def step_rows(max_batch: int, prefill_chunk: int = PREFILL_CHUNK_TOKENS) -> tuple[int, int]:
    """(max_tokens, logits_rows) of a GpuExecutor: tokens per step, and the rows of logits it buffers
    (every row of a decode batch or of a 64-token chunk; prefills wanting their last row only run
    chunks of max_tokens)."""
    max_tokens = max(max_batch, prefill_chunk)
    return max_tokens, min(max_tokens, max(max_batch, 64))


def arena_needs(c, max_tokens: int, sessions: int, max_seq_len: int, attention_splits: int,
                logits_rows: int | None = None, kv_bytes_per_position: int | None = None,
                table_bytes: int = 0, scratch_bytes: int = 0) -> ArenaNeeds:
    """KV caches + activations + workspace of an executor for `max_tokens` tokens per step, with
    logits for `logits_rows` of them (default all) (float32 KV for `sessions` x `max_seq_len` positions
    unless kv_bytes_per_position says otherwise; table_bytes: gpu mode's block tables, with the
    activations; scratch_bytes: the library GEMM path's, scheduler/dense.py)."""
    T, H, V = max_tokens, c.hidden_size, c.vocab_size
    qkv_width = c.q_size + 2 * c.kv_size
    partials = partial_floats(T, c.num_attention_heads, c.num_key_value_heads, c.head_dim, attention_splits)
    activation_floats = (T * (2 * H + qkv_width + 2 * c.q_size + c.intermediate_size + 1 +
                              c.num_key_value_heads) + partials + V * (logits_rows or T)
                         + T * (2 * ARGMAX_SPLITS + 2 + CHAIN_STEPS_PER_SYNC)    # argmax, greedy chain history
                         + (logits_rows or T) * SAMPLE_CANDIDATE_WORDS)          # sampling candidates
    norm_floats = H * (2 * c.num_hidden_layers + 1) + 2 * c.head_dim * c.num_hidden_layers + c.head_dim
    if c.qkv_bias:
        norm_floats += qkv_width * c.num_hidden_layers
    split_floats, split_tickets = mma_variants.scratch_bound(T)      # split-K partials, tickets
    activation_floats += max(split_floats, 4) + max(split_tickets, 1) + expert_pool.buffer_floats(c, T)
    if kv_bytes_per_position is None:
        kv_bytes_per_position = c.num_hidden_layers * 2 * c.kv_size * 4
    return ArenaNeeds(kv_bytes=sessions * max_seq_len * kv_bytes_per_position,
                      activation_bytes=4 * (activation_floats + norm_floats) + 16 * T + table_bytes + scratch_bytes,
                      slack_bytes=ALIGN * (12 * c.num_hidden_layers + 64),
                      sessions=sessions, max_seq_len=max_seq_len)


def weight_items(config) -> list:
    """The window items of `gpu` mode: one per Q8 weight a launch reads (norm vectors live with activations)."""
    ops = [op for op in step_ops(config, 1) if op.is_projection or op.kind == "embed"]
    return window_items(ops)




def embedding_owner(config) -> str:
    """The item the embed kernel gathers rows from: it must stay resident in `gpu` mode."""
    return "lm_head" if config.tie_word_embeddings else "embed"


def budget_for_weight_fraction(config, needs: ArenaNeeds, fraction: float, slot_count: int = 2) -> int:
    """A budget leaving `fraction` of the weight bytes for weights (1.0: all resident), after KV and activations."""
    items = weight_items(config)
    return (needs.total + 2 * ALIGN * (len(items) + slot_count)
            + int(fraction * sum(i.nbytes for i in items)))


def plan_arena(config, needs: ArenaNeeds, budget_bytes: int | None, slot_count: int = 2,
               prefetch_distance: int = 1, small_item_bytes: int = 64 * 1024) -> tuple[int, WindowPlan | None]:
    """(arena capacity, window plan or None when every weight stays resident) under `budget_bytes`."""
    items = weight_items(config)
    all_weights = sum(i.nbytes for i in items)
    everything = all_weights + needs.total + 2 * ALIGN * len(items)
    if budget_bytes is None or everything <= budget_bytes:
        return everything, None
    # every allocation rounds up by < ALIGN, twice per image (qs, then the total): reserve it first
    alignment = 2 * ALIGN * (len(items) + slot_count)
    weight_budget = budget_bytes - needs.total - alignment
    mib = 2**20
    head = (f"--vram-budget {budget_bytes} B ({budget_bytes / mib:.1f} MiB) is too small for gpu mode: "
            f"KV caches {needs.kv_bytes / mib:.1f} MiB ({needs.sessions} sessions x {needs.max_seq_len} "
            f"positions), activations and workspace {(needs.activation_bytes + needs.slack_bytes + alignment) / mib:.1f}"
            f" MiB, then weights")
    if weight_budget <= 0:
        raise WindowBudgetError(f"{head}: nothing left (weights need {all_weights / mib:.1f} MiB); raise "
                                f"--vram-budget or lower --max-seq-len / sessions")
    try:
        window = plan_window(items, weight_budget, slot_count=slot_count, prefetch_distance=prefetch_distance,
                             small_item_bytes=small_item_bytes,
                             pinned={embedding_owner(config): "the embed kernel gathers token rows from it"})
    except WindowBudgetError as e:
        raise WindowBudgetError(f"{head} get {weight_budget / mib:.1f} MiB: {e}") from None
    capacity = (needs.total + window.resident_bytes + 2 * ALIGN * len(window.resident)
                + window.slot_count * (window.slot_bytes + 2 * ALIGN) * bool(window.streamed))
    assert capacity <= budget_bytes, (capacity, budget_bytes)
    return capacity, window


@dataclass(frozen=True)
class GpuMemoryPlan:
    """gpu mode's device memory: the arena (weights, activations, block tables) and the KV pool beside it."""
    arena_bytes: int
    window: WindowPlan | None
    kv: "KVPoolPlan"
    needs: ArenaNeeds             # kv_bytes: the least the pool must get (see plan_gpu_memory)
    budget_bytes: int | None
    placement: object = None      # mode offload's scheduler.offload.OffloadPlacement (steps of one token)
    experts: object = None        # a mixture-of-experts model's experts on the device: a ResidentExperts
    expert_slots: int = 0         # the expert pool's slots (expert_pool.py), its routers beside it
    expert_ring_slots: int = 0    # mode offload's experts' ring: slots of one routed layer's every expert
    expert_ring_left_out: str = ""  # why auto built no ring the cost model wanted (host memory), else ""

    def describe(self) -> str:
        mib = 2**20
        head = (f"arena {self.arena_bytes / mib:.1f} MiB (weights, activations, KV tables); "
                f"{self.kv.describe()}")
        return head if self.window is None else head + "\n" + self.window.describe()


def plan_gpu_memory(c, *, budget_bytes: int | None, free_bytes: int, max_tokens: int, max_sessions: int,
                    max_seq_len: int, attention_splits: int, max_batch: int = 1, kv_dtype: str = "f16",
                    block_size: int = 16, logits_rows: int | None = None,
                    kv_pool_bytes: int | None = None, slot_count: int = 2, prefetch_distance: int = 1,
                    small_item_bytes: int = 64 * 1024, scratch_bytes: int = 0) -> GpuMemoryPlan:
    """Split a VRAM budget (None: free VRAM less a margin) over the arena and the KV pool.

    Weights first: the pool gets what resident weights, activations and tables leave, at least one
    session of max_seq_len, a block for each other session of a full batch and the scratch block
    (weights stream to make room).  With kv_pool_bytes the other way round:
    the pool is that size and the weights get the rest.  scratch_bytes: the library GEMM path's
    (scheduler/dense.py), with the activations."""
    from scheduler.kv_pool import kv_bytes_per_position, plan_kv_pool
    per_position = kv_bytes_per_position(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, kv_dtype)
    block_bytes = block_size * per_position
    min_positions = (-(-max_seq_len // block_size) + max_batch) * block_size
    table_bytes = (max_sessions + 1) * -(-max_seq_len // block_size) * 8 + ALIGN
    reserved = kv_pool_bytes if kv_pool_bytes is not None else min_positions * per_position
    needs = arena_needs(c, max_tokens, 1, 1, attention_splits, logits_rows=logits_rows,
                        kv_bytes_per_position=reserved, table_bytes=table_bytes, scratch_bytes=scratch_bytes)
    slots = expert_pool.all_experts(c)             # gpu mode: every expert on the device, with the routers
    expert_bytes = expert_pool.router_bytes(c) + expert_pool.pool_layout(c).pool_bytes(slots) if c.is_moe else 0
    needs = ArenaNeeds(needs.kv_bytes, needs.activation_bytes, needs.slack_bytes, sessions=1,
                       max_seq_len=reserved // per_position, expert_bytes=expert_bytes)
    full = sum(i.nbytes for i in weight_items(c)) + needs.total
    budget = resolve_budget(budget_bytes, free_bytes, full)
    capacity, window = plan_arena(c, needs, budget, slot_count, prefetch_distance, small_item_bytes)
    arena_bytes = capacity - needs.kv_bytes
    left = (budget if budget is not None else max(free_bytes - DEFAULT_MARGIN_BYTES, 0)) - arena_bytes
    kv = plan_kv_pool(block_bytes, block_size, left_bytes=left, min_positions=min_positions,
                      default_positions=min_positions, fixed_bytes=kv_pool_bytes)
    experts = every_expert(c) if c.is_moe else None
    return GpuMemoryPlan(arena_bytes, window, kv, needs, budget, experts=experts, expert_slots=slots if c.is_moe else 0)


def holds_every_expert(c, *, budget_bytes, free_bytes: int, max_tokens: int, max_seq_len: int, max_batch: int,
                       kv_dtype: str) -> bool:
    """A mixture-of-experts model in gpu mode: whether every weight, every expert with them, stays resident
    under the budget (gpu mode streams no expert; where they do not fit, mode offload keeps the most used)."""
    from kestrel_stream.cuda.moe_kernels import MAX_EXPERTS
    if c.num_experts > MAX_EXPERTS:
        return False                          # past the device router's experts: the host's
    try:
        memory = plan_gpu_memory(c, budget_bytes=budget_bytes, free_bytes=free_bytes, max_tokens=max_tokens,
                                 max_sessions=DEFAULT_MAX_SESSIONS, max_seq_len=max_seq_len, attention_splits=16,
                                 max_batch=max_batch, kv_dtype=kv_dtype)
    except WindowBudgetError:
        return False
    return memory.window is None or not memory.window.streamed


def every_expert(c) -> expert_residency.ResidentExperts:
    """Every expert of every routed layer resident (gpu mode)."""
    layers = expert_pool.routed_layers(c)
    return expert_residency.ResidentExperts({layer: tuple(range(c.num_experts)) for layer in layers}, "all",
                                            len(layers) * c.num_experts, 1.0)


def gpu_mode_needs(c, max_batch: int, max_seq_len: int, prefill_chunk: int = PREFILL_CHUNK_TOKENS,
                   max_sessions: int = 256, attention_splits: int = 16, kv_dtype: str = "f16",
                   dense: bool | None = None) -> ArenaNeeds:
    """What GpuExecutor's arena and its least KV pool take besides the weights (for
    budget_for_weight_fraction): plan_gpu_memory's needs with no budget.  max_sessions: its
    block-table rows (DEFAULT_MAX_SESSIONS).  dense: whether the dense GEMM path's
    scratch is in the arena (None: where steps reach the path's threshold, as the executor decides with
    default options; cuBLAS's weight scratch and workspace where it loads)."""
    from scheduler.dense import DENSE_MIN_TOKENS, default_min_tokens, scratch_shape
    max_tokens, logits_rows = step_rows(max_batch, prefill_chunk)
    from kestrel_stream.cuda import cublas
    library = cublas.available()
    if dense is None:
        dense = max_tokens >= (default_min_tokens(c) if library else DENSE_MIN_TOKENS)
    scratch = scratch_shape(c).nbytes(max_tokens, fused=not library) if dense else 0
    return plan_gpu_memory(c, budget_bytes=None, free_bytes=1 << 50, max_tokens=max_tokens,
                           max_sessions=max_sessions, max_seq_len=max_seq_len, attention_splits=attention_splits,
                           max_batch=max_batch, kv_dtype=kv_dtype, logits_rows=logits_rows,
                           scratch_bytes=scratch).needs


def plan_mixed_memory(c, *, resident: set, max_tokens: int, kv_layers: int, max_sessions: int, sessions: int,
                      max_seq_len: int, attention_splits: int, block_size: int = 16) -> GpuMemoryPlan:
    """gated and layers=N's device memory: the arena holds the weights named in `resident` (window items:
    what the mode's plans run on the GPU; all of them stay resident, none stream: the plan, not a budget,
    decides what the GPU reads) and one step's state; the KV pool beside it holds float32 keys and values
    of the first `kv_layers` layers (none: attention runs on the host), `max_sessions` block-table rows,
    and at most `sessions` x `max_seq_len` positions, committed as sessions grow."""
    from scheduler.kv_pool import kv_bytes_per_position, plan_kv_pool
    items = weight_items(c)
    kept = [i for i in items if i.name in resident]
    window = WindowPlan(
        budget_bytes=0, slot_count=0, slot_bytes=0, prefetch_distance=0, resident=tuple(i.name for i in kept),
        streamed=(), on_host=tuple(i.name for i in items if i.name not in resident),
        resident_bytes=sum(i.nbytes for i in kept), streamed_bytes_per_step=0,
        reasons={i.name: "resident: a plan of the mode runs it on the GPU" if i.name in resident else
                 "on the host: the mode's plans run it there" for i in items})
    width = -(-max_seq_len // block_size)
    table_bytes = (max_sessions + 1) * width * 8 + ALIGN if kv_layers else 0
    needs = arena_needs(c, max_tokens, 0, max_seq_len, attention_splits, kv_bytes_per_position=0,
                        table_bytes=table_bytes)
    arena_bytes = needs.total + window.resident_bytes + 2 * ALIGN * len(kept)
    kv = None
    if kv_layers:
        block_bytes = block_size * kv_bytes_per_position(kv_layers, c.num_key_value_heads, c.head_dim, "f32")
        kv = plan_kv_pool(block_bytes, block_size, left_bytes=None, min_positions=width * block_size,
                          default_positions=width * block_size, fixed_bytes=max(sessions, 1) * width * block_bytes)
    return GpuMemoryPlan(arena_bytes, window, kv, needs, None)


def offload_window(c, placement) -> WindowPlan:
    """The window of an offload placement: the resident projections (of resident layers, qkv and o of
    attention layers) and lm_head when resident, every other layer projection as a streamed item (a step's
    plan streams some of them; on the host where the placement has no ring), embed (and a host lm_head) left
    on the host.  A routed layer's router and
    experts are no window items: the host's, or the expert store's for those resident (expert_store.py)."""
    items = {i.name: i for i in weight_items(c)}
    resident, streamed, on_host, reasons = [], [], [], {}
    for name, item in items.items():
        layer = int(name[1:].split(".")[0]) if name.startswith("L") else None
        home = (group_home(placement.homes[layer], name.split(".")[1]) if layer is not None
                else placement.head if name == "lm_head" else "host")
        if home == "resident":
            resident.append(name)
            reasons[name] = "resident: the offload placement keeps it"
        elif layer is not None and placement.slot_count:
            streamed.append(name)
            reasons[name] = ("streamed through the ring or computed on the host, by step size (the placement "
                             f"of a one-token step: {home})")
        else:
            on_host.append(name)
            reasons[name] = ("on the host: a step gathers M rows of the table" if name == "embed" else
                             "on the host: the offload placement computes it there (no ring: in steps of "
                             "every size)" if layer is not None else
                             "on the host: the offload placement computes it there")
    return WindowPlan(
        budget_bytes=placement.budget_bytes, slot_count=placement.slot_count, slot_bytes=placement.slot_bytes,
        prefetch_distance=max(placement.slot_count - 1, 0), resident=tuple(resident), streamed=tuple(streamed),
        on_host=tuple(on_host), resident_bytes=sum(items[n].nbytes for n in resident),
        streamed_bytes_per_step=placement.streamed_bytes, reasons=reasons)


def plan_offload_memory(c, *, budget_bytes: int | float | None, free_bytes: int, profile, max_tokens: int,
                        max_sessions: int, max_seq_len: int, attention_splits: int, max_batch: int = 1,
                        kv_dtype: str = "f16", block_size: int = 16, homes: str | None = None,
                        routing_counts=None, expert_policy: str = "frequency",
                        stream_experts: str = "auto", host_available_bytes: int | None = None,
                        host_reserve: int | None = None) -> GpuMemoryPlan:
    """Mode offload's device memory under one budget: the KV pool for every layer (attention runs on the GPU)
    holds at least one session of max_seq_len plus a block for each other session of a full batch; the
    step's activations; then the weights: the offload placement (scheduler/offload.py) of what is left,
    resident layers and a ring (homes: the layers' homes given, KESTREL_OFFLOAD_HOMES's form); a mixture-of-
    experts model's routers and experts in the room the layers leave, as many as fit, chosen by
    expert_policy (scheduler/expert_residency.py's, or "none") from routing_counts ([routed layers][experts];
    None: none counted yet), after the experts' ring where stream_experts asks for one (expert_ring_slots) and
    the host holds its pinned images (expert_images_fit: host_available_bytes, MemAvailable now or None where
    unknown; host_reserve, what they leave free, None: host_reserve_bytes).  What the weights leave goes to
    the pool."""
    from scheduler import offload
    from scheduler.kv_pool import kv_bytes_per_position, plan_kv_pool
    per_position = kv_bytes_per_position(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, kv_dtype)
    block_bytes = block_size * per_position
    min_positions = (-(-max_seq_len // block_size) + max_batch) * block_size
    table_bytes = (max_sessions + 1) * -(-max_seq_len // block_size) * 8 + ALIGN
    needs = arena_needs(c, max_tokens, 1, 1, attention_splits, logits_rows=max_tokens,
                        kv_bytes_per_position=min_positions * per_position, table_bytes=table_bytes)
    needs = ArenaNeeds(needs.kv_bytes, needs.activation_bytes, needs.slack_bytes, sessions=1,
                       max_seq_len=min_positions)
    items = weight_items(c)
    full = sum(i.nbytes for i in items) + needs.total
    budget = resolve_budget(budget_bytes, free_bytes, full)
    if budget is None:
        budget = max(free_bytes - DEFAULT_MARGIN_BYTES, 0)
    alignment = 2 * ALIGN * (len(items) + 8)
    weight_budget = budget - needs.total - alignment
    mib = 2**20
    if weight_budget <= 0:
        raise WindowBudgetError(
            f"--vram-budget {budget} B ({budget / mib:.1f} MiB) is too small for mode offload: the KV pool's "
            f"least ({needs.kv_bytes / mib:.1f} MiB: {min_positions} positions of every layer, {kv_dtype}) and "
            f"the step's activations ({(needs.activation_bytes + needs.slack_bytes) / mib:.1f} MiB) leave "
            "nothing for weights; raise --vram-budget or lower --max-seq-len")
    if homes:
        given, head = offload.parse_homes(homes, c.num_hidden_layers)
        placement = offload.place_given(c, weight_budget, profile, given, head)
    else:
        placement = offload.place(c, weight_budget, profile, tokens=1)
    window = offload_window(c, placement)
    arena_bytes = (needs.total - needs.kv_bytes + window.resident_bytes + placement.ring_bytes
                   + 2 * ALIGN * (len(window.resident) + placement.slot_count))
    experts, slots, ring_slots, left_out = None, 0, 0, ""
    if c.is_moe:     # what the layers leave: the experts' ring, the routers and as many experts as fit
        room = weight_budget - placement.resident_bytes - placement.ring_bytes
        ring_slots = expert_ring_slots(c, room, placement, profile, max_tokens, stream_experts, budget)
        if ring_slots:
            streamed = set(window.streamed)       # pinned by the window after this plan, before the images
            reserve = host_reserve if host_reserve is not None else host_reserve_bytes(
                placement, sum(i.nbytes for i in items if i.name in streamed))
            left_out = expert_images_fit(c, placement, stream_experts, host_available_bytes, reserve,
                                         given=host_reserve is not None)
            ring_slots = 0 if left_out else ring_slots
        if ring_slots:
            placement = placement.with_expert_ring(ring_slots, expert_pool.layer_slot_bytes(c),
                                                   expert_image_bytes(c, placement))
            room -= expert_pool.ring_bytes(c, ring_slots)
        slots = resident_expert_slots(c, room) if expert_policy != "none" else 0
        if slots:
            layers = expert_pool.routed_layers(c)
            counts = routing_counts if routing_counts is not None else [[0] * c.num_experts for _ in layers]
            experts = expert_residency.choose(counts, layers, c.num_experts, slots, expert_policy)
            placement = offload.with_resident_experts(placement, c, profile, experts.expected_share)
        if slots or ring_slots:
            arena_bytes += (expert_pool.router_bytes(c) + expert_pool.pool_layout(c).pool_bytes(slots) + ALIGN
                            + expert_pool.ring_bytes(c, ring_slots))
    kv = plan_kv_pool(block_bytes, block_size, left_bytes=budget - arena_bytes, min_positions=min_positions,
                      default_positions=min_positions)
    return GpuMemoryPlan(arena_bytes, window, kv, needs, budget, placement=placement, experts=experts,
                         expert_slots=slots, expert_ring_slots=ring_slots, expert_ring_left_out=left_out)
