"""Mode offload streaming a routed layer's every expert into the experts' ring and running it on the device
(fake_cuda's emulation, deferred copies) against the CPU engine on the numpy reference arithmetic (2e-3
relative, the same argmax): a prompt's step streams the layers the cost model picks, decode steps keep the
experts on the host; the bytes it copies are its plan's; a budget that cannot hold the ring is refused, and
so is a host that cannot hold its pinned images (auto: no ring, one line), their bytes and build time reported.
tests/test_gpu_moe_stream.py runs these checks on a GPU."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fake_cuda
from bench.synthetic import random_q8_weights
from hf_oracle import assert_logits_match
from kestrel_stream.loading.presets import PRESETS
from kestrel_stream.options import Options
from kestrel_stream.run import host_memory
from kestrel_stream.run.device import expert_pool
from kestrel_stream.run.device.expert_budget import HOST_MARGIN_BYTES, HostMemoryError, size_text
from kestrel_stream.run.engine import Engine
from kestrel_stream.run.step_executor import StepExecutor
from scheduler.window import WindowBudgetError
from test_moe_device_emulated import block_experts, expert_budget
from test_moe_offload_emulated import POOL

MODELS = {"qwen3-moe-tiny": PRESETS["qwen3-moe-tiny"],
          "mixtral-tiny": dataclasses.replace(PRESETS["mixtral-tiny"], head_dim=32)}
PROMPT = [5, 3, 200, 17, 42, 8, 1, 99, 250, 7, 64, 31, 4, 77, 120, 9]
MAX_SEQ_LEN, MAX_BATCH, DECODE_STEPS = 32, 4, 3
NUMPY = Options.from_env().with_(host_kernels="numpy")     # the reference arithmetic, on the host parts too
# these tiny experts at a host a thousand times slower than the link: a step of many tokens streams every
# routed layer, one of a single token keeps them on the host (the figures decide, as on a GPU's host)
STREAM_POOL = dataclasses.replace(POOL, host_weight_GBps=0.02, host_joint_GBps=0.02, host_gflops=0.5)


@pytest.fixture
def emulated(monkeypatch):
    fake_cuda.install(monkeypatch, mode="deferred")
    return monkeypatch


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    weights = random_q8_weights(MODELS[request.param], seed=7)
    cpu = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    return weights, cpu


def ring_budget(config, resident: int = 0) -> int:
    """Mode offload's budget for every non-expert weight, the routers, `resident` experts and the experts' ring."""
    from kestrel_stream.run.device.expert_budget import EXPERT_RING_SLOTS
    return expert_budget(config, resident) + expert_pool.ring_bytes(config, EXPERT_RING_SLOTS)


def stream_engine(weights, resident: int = 0, profile=STREAM_POOL, stream: str = "on",
                  options: Options = NUMPY) -> Engine:
    executor = StepExecutor(weights, "offload", profile, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH,
                            vram_budget=ring_budget(weights.config, resident),
                            options=options.with_(stream_experts=stream))
    engine = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    engine.device, engine.mode, engine.executor = "cuda", executor.mode, executor
    return engine


def routed(config) -> list:
    return [i for i in range(config.num_hidden_layers) if config.moe_layer(i)]


# ---- checks shared with the GPU's tests (test_gpu_moe_stream.py) ----------------------------------------
def check_prompt_streams_and_matches(weights, cpu, resident: int = 0, options: Options = NUMPY) -> None:
    """A prompt's step streams every routed layer's experts through the ring and runs them on the device, the
    decode steps after it keep them on the host; every row is the CPU engine's."""
    c = weights.config
    engine = stream_engine(weights, resident, options=options)
    x = engine.executor
    prompt_plan, decode_plan = x.plan(len(PROMPT)), x.plan(1)
    assert [int(n[1:].split(".")[0]) for n in prompt_plan.expert_ring] == routed(c), prompt_plan.notes
    assert not decode_plan.expert_ring
    sides = {op.name: seg.side for seg in prompt_plan.segments for op in seg.ops}
    assert all(sides[f"L{i}.router"] == sides[f"L{i}.experts"] == "gpu" for i in routed(c))
    with engine.new_session() as s, cpu.new_session() as ref:
        before = dict(x.stats)
        ours, theirs = s.prefill(PROMPT), ref.prefill(PROMPT)
        assert_logits_match(ours, theirs)
        streamed = x.stats["streamed_bytes"] - (before.get("streamed_bytes") or 0)
        assert streamed == len(routed(c)) * expert_pool.layer_slot_bytes(c)
        assert x.backend.experts.formats == {i: expert_pool.expert_formats(c, i) for i in routed(c)}
        for counter, planned in (("h2d_bytes", prompt_plan.h2d_bytes_per_step),
                                 ("syncs", prompt_plan.syncs_per_step)):     # the plan is what ran
            assert x.stats[counter] - before[counter] == planned, counter
        token = int(np.argmax(theirs[-1]))
        for _ in range(DECODE_STEPS):
            before = dict(x.stats)
            ours, theirs = s.decode(token), ref.decode(token)
            assert_logits_match(ours[None], theirs[None])
            assert x.stats["streamed_bytes"] == before["streamed_bytes"]       # decode: the host's experts
            token = int(np.argmax(theirs))
    engine.close()


def check_ring_and_link_share(weights, cpu) -> None:
    """An experts' ring and a link share together: the share reads the ring's images (none made again); a
    prompt's step streams every routed layer's experts through the ring, decode steps (none streamed) replay
    one graph with host items from their third step, the device reading some of the host's choices over the
    link; every row the CPU engine's."""
    from kestrel_stream import native
    options = Options.from_env().with_(host_kernels="native", link_experts=2)
    if native.load(options) is None:
        pytest.skip("no native host kernels (no C compiler): no host items, no link share")
    c = weights.config
    engine = stream_engine(weights, options=options)
    x = engine.executor
    ring, link = x.steps.expert_ring, x.steps.item_graphs.link
    assert ring is not None and link is not None and not link.images
    assert sorted(link.shared) == sorted(ring.images) == routed(c) and link.all_images == ring.images
    with engine.new_session() as s, cpu.new_session() as ref:
        before = dict(x.stats)
        ours, theirs = s.prefill(PROMPT), ref.prefill(PROMPT)
        assert_logits_match(ours, theirs)
        assert x.stats["streamed_bytes"] - (before.get("streamed_bytes") or 0) == len(routed(c)) * \
            expert_pool.layer_slot_bytes(c)
        token = int(np.argmax(theirs[-1]))
        for step in range(4):
            before = dict(x.stats)
            ours, theirs = s.decode(token), ref.decode(token)
            assert_logits_match(ours[None], theirs[None])
            if step >= 2:                    # eager, captured, then replayed with the share armed
                assert x.stats["graph_replays"] > before.get("graph_replays", 0)
                assert x.stats["streamed_bytes"] > before["streamed_bytes"]       # the link's, not the ring's
            token = int(np.argmax(theirs))
    engine.close()


def check_batch_of_prompts_matches(weights, cpu) -> None:
    """Three sessions' prompts in one streamed step, then their decode tokens: each row its own."""
    engine = stream_engine(weights, resident=3)
    x = engine.executor
    prompts = (PROMPT[:9], PROMPT[3:10], PROMPT[:3])
    kvs = [x.alloc_kv(MAX_SEQ_LEN) for _ in prompts]
    cpu_kvs = [cpu.executor.alloc_kv(MAX_SEQ_LEN) for _ in prompts]
    batch = [(kv, np.array(p), 0) for kv, p in zip(kvs, prompts)]
    cpu_batch = [(kv, np.array(p), 0) for kv, p in zip(cpu_kvs, prompts)]
    assert x.plan(sum(map(len, prompts))).expert_ring
    ours, theirs = x.forward(batch), cpu.executor.forward(cpu_batch)
    for a, b in zip(ours, theirs):
        assert_logits_match(a, b)
    for kv in kvs:
        x.free_kv(kv)
    engine.close()


def check_slots_reused_in_one_step() -> None:
    """Eight routed layers through two slots: each slot is written four times in the step, every copy after
    the reader of the layer before it in that slot (a missing wait shows as another layer's experts)."""
    cfg = dataclasses.replace(PRESETS["qwen3-moe-tiny"], num_hidden_layers=9)
    weights = random_q8_weights(cfg, seed=11)
    cpu = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH, options=NUMPY)
    engine = stream_engine(weights)
    assert len(engine.executor.plan(len(PROMPT)).expert_ring) == 8
    for _ in range(2):                       # twice: the second step's first copies wait for the first's readers
        with engine.new_session() as s, cpu.new_session() as ref:
            assert_logits_match(s.prefill(PROMPT), ref.prefill(PROMPT))
    engine.close()


def check_block_format_experts_stream() -> None:
    """llama.cpp's Q4_K_M experts (Q4_K gate and up, Q6_K down; rows of 256) through the ring: their images
    are the pool's layout of those formats."""
    gate, up, down = (f"model.layers.{{i}}.mlp.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down"))
    cfg = dataclasses.replace(PRESETS["qwen3-moe-tiny"], hidden_size=256, moe_intermediate_size=256)
    weights = block_experts(random_q8_weights(cfg, seed=3))
    formats = {gate: "Q4_K", up: "Q4_K", down: "Q6_K"}      # as a GGUF's config names them: the ring's size
    weights.config = dataclasses.replace(cfg, weight_formats=tuple(
        (name.format(i=i, e=e), fmt) for i in routed(cfg) for e in range(cfg.num_experts)
        for name, fmt in formats.items()))
    cpu = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH, options=NUMPY)
    check_prompt_streams_and_matches(weights, cpu)


# ---- the emulated device ------------------------------------------------------------------------------
def test_a_streamed_prompt_step_matches_the_cpu_engine(model, emulated):
    check_prompt_streams_and_matches(*model)


def test_streamed_layers_beside_resident_experts_match(model, emulated):
    """Resident experts beside the ring: decode splits each layer (resident part on the device), the prompt
    streams every expert of the layer (the ring's table, not the resident one)."""
    check_prompt_streams_and_matches(*model, resident=3)


def test_q4_k_m_experts_stream(emulated):
    check_block_format_experts_stream()


def test_ring_slots_are_reused_within_a_step(emulated):
    check_slots_reused_in_one_step()


def test_a_ring_and_a_link_share_together(model, emulated):
    check_ring_and_link_share(*model)


def test_a_batch_of_prompts_in_one_streamed_step_matches(model, emulated):
    check_batch_of_prompts_matches(*model)


def test_the_placement_line_names_each_step_size(model, emulated, capsys):
    """Load prints the placement of a one-token step (experts on the host: A) and of the largest step (E)."""
    engine = stream_engine(model[0])
    err, largest = capsys.readouterr().err, engine.executor.steps.max_tokens
    letters = {line.split("offload, M=", 1)[1].split(":", 1)[0]: line.split("layers ", 1)[1].split(" ", 1)[0]
               for line in err.splitlines() if "offload, M=" in line}
    assert "E" not in letters["1"] and "E" in letters[str(largest)], err
    assert "experts streamed" in err and "through a ring of 2 x" in err
    engine.close()


def test_auto_keeps_the_host_where_the_cost_model_says_streaming_does_not_pay(model, emulated):
    """KESTREL_STREAM_EXPERTS=auto with the ordinary figures for these tiny layers: no ring is worth it."""
    slow_link = dataclasses.replace(POOL, h2d_GBps=1e-4, h2d_joint_GBps=1e-4)
    engine = stream_engine(model[0], profile=slow_link, stream="auto")
    assert engine.executor.steps.expert_ring is None
    assert not engine.executor.placement.expert_slot_count
    engine.close()


def test_auto_streams_where_it_pays(emulated):
    """auto: a ring where the room does not hold every expert and the cost model streams the largest step
    (five layers, four routed: the ring's two layers of experts are half of them); the logits still match."""
    weights = random_q8_weights(dataclasses.replace(PRESETS["qwen3-moe-tiny"], num_hidden_layers=5), seed=3)
    cpu = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    engine = stream_engine(weights, stream="auto")
    assert engine.executor.steps.expert_ring is not None
    assert engine.executor.plan(len(PROMPT)).expert_ring and not engine.executor.plan(1).expert_ring
    with engine.new_session() as s, cpu.new_session() as ref:
        assert_logits_match(s.prefill(PROMPT), ref.prefill(PROMPT))
    engine.close()
    # the same budget holding every expert of the three-layer model: they stay resident, no ring
    small = stream_engine(random_q8_weights(PRESETS["qwen3-moe-tiny"], seed=3), stream="auto")
    assert small.executor.steps.expert_ring is None and small.executor.resident_experts.used_slots
    small.close()


def test_a_budget_too_small_for_the_ring_is_refused_naming_it(model, emulated):
    weights = model[0]
    short = ring_budget(weights.config) - expert_pool.layer_slot_bytes(weights.config)
    with pytest.raises(WindowBudgetError, match=r"too small for mode offload's experts' ring.*raise --vram-budget by"):
        StepExecutor(weights, "offload", STREAM_POOL, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH,
                     vram_budget=short, options=NUMPY.with_(stream_experts="on"))
    # auto under the same budget: the experts stay on the host, as before the ring
    executor = StepExecutor(weights, "offload", STREAM_POOL, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH,
                            vram_budget=short, options=NUMPY.with_(stream_experts="auto"))
    assert executor.steps.expert_ring is None
    executor.close()


def test_calibrate_measures_the_device_expert_kernels(emulated):
    """The cost model's device expert rate: the route, gate_up, down and combine launches timed over a routed
    layer (a small one here; Qwen3-30B-A3B's on a GPU)."""
    from kestrel_stream.run.calibrate import measure_device_experts
    shape = {"hidden": 64, "intermediate": 32, "experts": 8, "chosen": 2, "tokens": 16}
    figures = measure_device_experts(NUMPY, repeats=1, shape=shape)
    assert figures["gpu_expert_gflops"] > 0


# ---- the host memory the ring's pinned images take ------------------------------------------------------------
def streaming_weights():
    """Five layers, four routed: under ring_budget auto builds a ring (test_auto_streams_where_it_pays)."""
    return random_q8_weights(dataclasses.replace(PRESETS["qwen3-moe-tiny"], num_hidden_layers=5), seed=3)


def host_has(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(host_memory, "available_bytes", lambda: nbytes)


def test_auto_leaves_the_ring_out_where_the_host_cannot_hold_its_images(emulated, capsys):
    """MemAvailable less the reserve (the model's host-read weights, 4 GiB) short of the images: no ring, one
    line naming the bytes needed and available and how to force it; the ring's room goes to resident experts
    and the prompt still matches the CPU engine."""
    weights = streaming_weights()
    c = weights.config
    host_has(emulated, HOST_MARGIN_BYTES)              # the margin alone: nothing left for the images
    engine = stream_engine(weights, stream="auto")
    x, err = engine.executor, capsys.readouterr().err
    needed = len(routed(c)) * expert_pool.layer_slot_bytes(c)
    assert x.steps.expert_ring is None and not x.placement.expert_slot_count
    assert not x.plan(len(PROMPT)).expert_ring and x.resident_experts.used_slots
    lines = [line for line in err.splitlines() if "experts' ring left out for host memory" in line]
    assert len(lines) == 1, err
    assert (f"take {size_text(needed)}, the host can give 0.0 MB (MemAvailable {size_text(HOST_MARGIN_BYTES)}"
            in lines[0]) and "KESTREL_HOST_RESERVE=SIZE" in lines[0]
    assert "expert_image_bytes" not in x.stats
    cpu = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    with engine.new_session() as s, cpu.new_session() as ref:
        assert_logits_match(s.prefill(PROMPT), ref.prefill(PROMPT))
    engine.close()
    # KESTREL_HOST_RESERVE=0: the same MemAvailable holds the images, the ring is built
    forced = stream_engine(weights, stream="auto", options=NUMPY.with_(host_reserve=0))
    assert forced.executor.steps.expert_ring is not None
    forced.close()


def test_on_refuses_naming_the_bytes_where_the_host_cannot_hold_the_images(emulated):
    weights = streaming_weights()
    c = weights.config
    needed = len(routed(c)) * expert_pool.layer_slot_bytes(c)
    host_has(emulated, needed // 2)
    with pytest.raises(HostMemoryError, match=rf"KESTREL_STREAM_EXPERTS=on.*take {size_text(needed)}, the host can "
                                              rf"give 0.0 MB \(MemAvailable {size_text(needed // 2)}"):
        stream_engine(weights, stream="on", options=NUMPY.with_(host_reserve=HOST_MARGIN_BYTES))


def test_enough_host_memory_keeps_the_ring_and_reports_its_pinned_bytes(emulated, capsys):
    """MemAvailable past the reserve and the images: the ring as before; load names the pinned bytes and the
    build time, the placement of the largest step the images' size, the counters both."""
    weights = streaming_weights()
    c = weights.config
    needed = len(routed(c)) * expert_pool.layer_slot_bytes(c)
    host_has(emulated, needed + 64 * 2**30)
    engine = stream_engine(weights, stream="auto")
    x, err = engine.executor, capsys.readouterr().err
    assert x.steps.expert_ring is not None and x.steps.expert_ring.image_bytes == needed
    assert "left out" not in err
    assert (f"experts' ring: pinned host images of {len(routed(c))} routed layers' experts, {size_text(needed)}, "
            "built in ") in err
    assert f"from {needed / 1e6:.1f} MB of pinned host images" in err          # the placement lines
    largest = x.placement_for(x.steps.max_tokens)
    assert largest.to_dict()["expert_image_bytes"] == needed
    assert x.stats["expert_image_bytes"] == needed and x.stats["expert_image_build_ms"] >= 0
    engine.close()


def test_a_pinning_the_driver_refuses_is_met_as_short_host_memory(emulated, capsys):
    """cuMemHostAlloc failing on the second layer's image: the first is freed; auto goes on without the ring
    (a line, the prompt on the host's experts), on refuses naming the bytes; no CUDA traceback either way."""
    from kestrel_stream.cuda import driver
    weights = streaming_weights()
    c = weights.config
    image = expert_pool.layer_slot_bytes(c)
    made = []
    real = driver.PinnedBuffer

    def pinned(nbytes: int):
        if nbytes == image and len(made) == 1:
            raise fake_cuda.CudaError("cuMemHostAlloc: CUDA_ERROR_OUT_OF_MEMORY")
        buffer = real(nbytes)
        if nbytes == image:
            made.append(buffer)
        return buffer
    emulated.setattr(driver, "PinnedBuffer", pinned)
    engine = stream_engine(weights, stream="auto")
    x, err = engine.executor, capsys.readouterr().err
    assert [buffer.address for buffer in made] == [0]                   # the image pinned before is freed
    assert x.steps.expert_ring is None and not x.plan(len(PROMPT)).expert_ring
    assert (f"experts' ring left out for host memory: pinning its host images (every expert of {len(routed(c))} "
            f"routed layers, {size_text(len(routed(c)) * image)}) failed") in err
    cpu = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    with engine.new_session() as s, cpu.new_session() as ref:
        assert_logits_match(s.prefill(PROMPT), ref.prefill(PROMPT))
    engine.close()
    made.clear()
    with pytest.raises(HostMemoryError, match=rf"KESTREL_STREAM_EXPERTS=on.*{size_text(len(routed(c)) * image)}"):
        stream_engine(weights, stream="on")


def test_the_available_memory_reader_reads_meminfo(monkeypatch, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       65536000 kB\nMemFree:         1000000 kB\nMemAvailable:   40000000 kB\n")
    monkeypatch.setattr(host_memory, "MEMINFO", str(meminfo))
    assert host_memory.available_bytes() == 40000000 * 1024
    monkeypatch.setattr(host_memory, "MEMINFO", str(tmp_path / "absent"))    # no /proc: the free pages
    assert host_memory.available_bytes() is None or host_memory.available_bytes() > 0
