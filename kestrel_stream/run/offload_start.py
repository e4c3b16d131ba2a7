"""Mode offload's start, for StepExecutor (step_executor.py): whether gpu mode becomes offload (every expert
resident, or host layers beside the ring predicted faster than streaming alone), the pool figures the
placement needs, and the build: the device backend's offload memory plan, the streaming ring, the experts'
ring with its pinned host images, MixedSteps over them.  Functions of the executor (their first argument),
which holds what they set.

One concern, starting mode offload: its decisions and its build are read together.
"""
from __future__ import annotations

import sys
import time

import scheduler
from kestrel_stream.run import host_memory
from kestrel_stream.run.device.budget import (DEFAULT_MAX_SESSIONS, PREFILL_CHUNK_TOKENS, holds_every_expert,
                                              plan_gpu_memory, plan_offload_memory, step_rows)
from kestrel_stream.run.device.budget import EXECUTOR_DEFAULTS as DEFAULTS
from kestrel_stream.run.device.expert_budget import (HostMemoryError, expert_image_layers, host_reserve_bytes,
                                                     size_text)
from kestrel_stream.run.executor import StepCounters


def holds_every_expert_here(executor, vram_budget, max_seq_len, max_batch, kv_dtype: str) -> bool:
    """gpu mode of a mixture-of-experts model: whether every weight, every expert with them, stays resident."""
    from kestrel_stream.cuda import driver
    max_tokens, _ = step_rows(max_batch or DEFAULTS[True][1], PREFILL_CHUNK_TOKENS)
    free = driver.Device(executor.options.device_ordinal).free_bytes()
    return holds_every_expert(executor.config, budget_bytes=vram_budget, free_bytes=free,
                              max_tokens=max_tokens, max_seq_len=max_seq_len or DEFAULTS[True][0],
                              max_batch=max_batch or DEFAULTS[True][1], kv_dtype=kv_dtype)


def offload_wins(executor, vram_budget, max_seq_len, max_batch, kv_dtype: str, profile) -> bool:
    """gpu mode under a budget the weights do not fit: whether mode offload's placement (host layers beside
    the ring) is predicted faster than the window streaming every non-resident weight (Options.offload:
    auto asks the cost model, place always, stream never)."""
    if executor.options.offload == "stream":
        return False
    from kestrel_stream.cuda import driver
    c = executor.config
    max_tokens, _ = step_rows(max_batch or DEFAULTS[True][1], PREFILL_CHUNK_TOKENS)
    free = driver.Device(executor.options.device_ordinal).free_bytes()
    try:
        memory = plan_gpu_memory(c, budget_bytes=vram_budget, free_bytes=free, max_tokens=max_tokens,
                                 max_sessions=DEFAULT_MAX_SESSIONS, max_seq_len=max_seq_len or DEFAULTS[True][0],
                                 attention_splits=16, max_batch=max_batch or DEFAULTS[True][1], kv_dtype=kv_dtype)
    except scheduler.WindowBudgetError:
        return True                           # gpu mode's window cannot start here; offload's may

    if memory.window is None or not memory.window.streamed:
        return False                          # everything resident
    if executor.options.offload == "place":
        return True
    profile = pool_profile(executor, profile)
    placement = plan_offload_memory(
        c, budget_bytes=vram_budget, free_bytes=free, profile=profile, max_tokens=max_tokens,
        max_sessions=DEFAULT_MAX_SESSIONS, max_seq_len=max_seq_len or DEFAULTS[True][0], attention_splits=16,
        max_batch=max_batch or DEFAULTS[True][1], kv_dtype=kv_dtype).placement
    return placement.host_bytes > 0


def pool_profile(executor, profile):
    """The cost model's figures for mode offload: the given profile, else this machine's (measured once and
    cached: calibrate)."""
    if profile is not None and getattr(profile, "host_joint_GBps", None):
        return profile
    from kestrel_stream.run.calibrate import calibrate
    return calibrate(options=executor.options)


def start_offload(executor, profile, vram_budget, max_seq_len, max_batch, max_sessions, prefill_chunk,
                  kv_dtype: str, kv_block_size: int) -> None:
    """Mode offload: resident layers in the arena, streamed layers through the ring, host layers on the host
    backend, attention on the GPU for every layer; the placement per step size (plan)."""
    from kestrel_stream.run.device.backend import DeviceBackend
    from kestrel_stream.run.device.stream_ring import StreamRing
    from kestrel_stream.run.mixed import ATTENTION_SPLITS, MixedSteps
    c, weights = executor.config, executor.weights
    executor._check_gpu_mode(kv_dtype, kv_block_size, ATTENTION_SPLITS)
    executor.mode, executor.group_choice = "offload", None
    executor.profile = pool_profile(executor, profile)
    executor.gpu_layers = c.num_hidden_layers                      # every layer's attention and KV on the GPU
    default_seq, default_batch, default_chunk = DEFAULTS[False]
    executor.max_seq_len, executor.max_batch = max_seq_len or DEFAULTS[True][0], max_batch or DEFAULTS[True][1]
    T = max(executor.max_batch, prefill_chunk or default_chunk)
    executor.counters = StepCounters.counting("gpu_weight_read_bytes", "cpu_weight_read_bytes")
    start = time.perf_counter()
    table_rows = max_sessions or DEFAULT_MAX_SESSIONS
    # the host memory the experts' ring's pinned images would take from, read before anything is pinned
    host_available = (host_memory.available_bytes() if c.is_moe and executor.options.stream_experts != "off"
                      else None)
    memory = lambda free_bytes, scratch_bytes: plan_offload_memory(     # noqa: E731
        c, budget_bytes=vram_budget, free_bytes=free_bytes, profile=executor.profile, max_tokens=T,
        max_sessions=table_rows, max_seq_len=executor.max_seq_len, attention_splits=ATTENTION_SPLITS,
        max_batch=executor.max_batch, kv_dtype=kv_dtype, block_size=kv_block_size, homes=executor.options.offload_homes,
        expert_policy=executor.options.resident_experts, stream_experts=executor.options.stream_experts,
        host_available_bytes=host_available, host_reserve=executor.options.host_reserve)
    backend = DeviceBackend(
        weights, executor.options, executor.counters, max_tokens=T, logits_rows=T, plan_memory=memory,
        kv_dtype=kv_dtype, kv_layers=c.num_hidden_layers, max_sessions=table_rows, max_seq_len=executor.max_seq_len,
        attention_splits=ATTENTION_SPLITS, dense=False, step_outputs=False, pinned_state=True)
    executor.placement = backend.memory.placement
    executor.window_plan = backend.memory.window
    executor.resident_experts = backend.memory.experts
    ring = StreamRing(backend.window, weights) if backend.window.streamed else None
    if backend.memory.expert_ring_left_out:
        print(f"kestrel-stream: {backend.memory.expert_ring_left_out}", file=sys.stderr)
    expert_ring = build_expert_ring(executor, backend) if backend.memory.expert_ring_slots else None
    link = build_link(executor, backend, expert_ring) if executor.options.link_experts else None
    executor.steps = MixedSteps(backend, executor.counters, executor.plan, gpu_layers=executor.gpu_layers, max_tokens=T,
                            mode=executor.mode, load_s=time.perf_counter() - start, options=executor.options, ring=ring,
                            expert_ring=expert_ring, link=link)
    executor.preload_line = executor.steps.preload_line
    images = {**getattr(expert_ring, "images", {}), **(link.all_images if link is not None else {})}
    if images and executor.options.host_reads_images:       # the host's experts read there: no second copy
        from kestrel_stream.run.device.expert_ring import host_expert_images
        executor.steps.host.expert_images = host_expert_images(backend.experts, executor.weights, images)
    sizes = (1,) + ((executor.max_batch, T) if expert_ring is not None else ())
    for tokens in sorted(set(sizes)):         # the experts' ring: the placement of each step size it serves
        for line in executor.placement_for(tokens).describe().splitlines():
            print(f"kestrel-stream: {line}", file=sys.stderr)
    if executor.resident_experts is not None:
        print(f"kestrel-stream: {executor.resident_experts.describe(c.num_experts)}", file=sys.stderr)


def build_expert_ring(executor, backend):
    """Mode offload's experts' ring, its pinned images built (device/expert_ring.py); their bytes and build
    time go to the counters and a load line.  Where pinning fails: HostMemoryError naming the bytes under
    KESTREL_STREAM_EXPERTS=on; under auto a line, no ring (the placement without it; its VRAM stays idle)."""
    from kestrel_stream.cuda.errors import CudaError
    from kestrel_stream.obs import load_stages
    from kestrel_stream.run.device.expert_ring import ExpertRing
    layers = expert_image_layers(executor.config, executor.placement)
    image_bytes = executor.placement.expert_image_bytes
    start = time.perf_counter()
    try:
        with load_stages.stage("  experts: pinned images of the experts' ring"):
            expert_ring = ExpertRing(backend.experts, executor.weights, layers, pages=executor.options.expert_images)
    except (CudaError, MemoryError) as e:
        what = (f"pinning its host images (every expert of {len(layers)} routed layers, {size_text(image_bytes)}) "
                f"failed ({e})")
        if executor.options.stream_experts == "on":
            backend.close()
            raise HostMemoryError(f"mode offload's experts' ring (KESTREL_STREAM_EXPERTS=on): {what}; free host "
                                  "memory or set KESTREL_STREAM_EXPERTS=auto (the experts on the host when the "
                                  "images cannot be pinned)") from None
        print(f"kestrel-stream: experts' ring left out for host memory: {what}; prompt steps keep the experts on "
              f"the host, the ring's {size_text(executor.placement.expert_ring_bytes)} of VRAM idle "
              "(KESTREL_STREAM_EXPERTS=off gives it to resident experts)", file=sys.stderr)
        executor.placement = executor.placement.with_expert_ring(0, 0)
        return None
    build_s = time.perf_counter() - start
    executor.counters.expert_image_bytes = expert_ring.image_bytes
    executor.counters.expert_image_build_ms = round(build_s * 1e3, 1)
    print(f"kestrel-stream: experts' ring: pinned host images of {len(layers)} routed layers' experts, "
          f"{size_text(expert_ring.image_bytes)}, built in {build_s:.2f} s", file=sys.stderr)
    return expert_ring


def build_link(executor, backend, expert_ring=None):
    """Mode offload's link share (device/expert_link.py, KESTREL_LINK_EXPERTS): the pinned images of the routed
    layers whose experts the device does not hold -- the experts' ring's where it has them (the same layout:
    prompt steps stream them, steps of a few tokens share them), made for the others; left out, with a line,
    where the model has no device router or pinning them fails or would eat the host's reserve."""
    from kestrel_stream.cuda.errors import CudaError
    from kestrel_stream.run.device.expert_link import ExpertLink
    store, count = backend.experts, executor.options.link_experts
    if store is None or backend.pinned is None:
        print("kestrel-stream: link share left out: the routers are not on the device", file=sys.stderr)
        return None
    shared = expert_ring.images if expert_ring is not None else {}
    need = 0 if count == "defer" else (len([layer for layer in store.layers if layer not in shared])
                                       * executor.config.num_experts * store.layout.slot_bytes)
    reserve = executor.options.host_reserve
    if reserve is None:        # the weights the host reads every step (the model file's pages) and a margin
        reserve = host_reserve_bytes(executor.placement)
    if need and host_memory.available_bytes() - need < reserve:
        print(f"kestrel-stream: link share left out: its pinned images ({size_text(need)}) would leave less host "
              "memory than the reserve", file=sys.stderr)
        return None
    start = time.perf_counter()
    try:
        link = ExpertLink(store, executor.weights, count, store.layers, pages=executor.options.expert_images,
                          shared=shared)
    except (CudaError, MemoryError) as e:
        print(f"kestrel-stream: link share left out: pinning its images ({size_text(need)}) failed ({e})", file=sys.stderr)
        return None
    if count == "defer":
        print("kestrel-stream: link share: no expert over PCIe; the routed layers' resident experts run on the "
              "GPU while the host computes its own", file=sys.stderr)
        return link
    build_s = time.perf_counter() - start
    if link.images:              # images of its own (beside any the ring's counters already count)
        executor.counters.expert_image_bytes = (executor.counters.expert_image_bytes or 0) + link.image_bytes
        executor.counters.expert_image_build_ms = round((executor.counters.expert_image_build_ms or 0)
                                                        + build_s * 1e3, 1)
    told = "a count measured while serving" if count == "auto" else count
    made = (f"pinned images of {len(link.images)} routed layers, {size_text(link.image_bytes)}, built in "
            f"{build_s:.2f} s" if link.images else "")
    print(f"kestrel-stream: link share: {told} of a token's host-side expert choices read by the GPU over PCIe; "
          + "; ".join(part for part in (made, f"the experts' ring's images of {len(link.shared)} layers"
                                        if link.shared else "") if part), file=sys.stderr)
    return link
