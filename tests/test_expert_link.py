"""Mode offload's link share (run/device/expert_link.py): in a one-token step graph with host items, the last
N of a token's host-side expert choices are read by the device from pinned images while the host computes
the rest; the step's logits are the CPU engine's (the sums in another order), the host reads fewer expert
bytes and the link carries the rest, and eager steps (the first of a size) leave the share unarmed."""
from __future__ import annotations

import numpy as np
import pytest

import fake_cuda
from bench.synthetic import random_q8_weights
from hf_oracle import assert_logits_match, relative_error
from kestrel_stream.cuda import driver
from kestrel_stream.options import Options
from kestrel_stream.run.step_executor import StepExecutor
from test_moe_device_emulated import MAX_BATCH, MAX_SEQ_LEN, MODELS, PROMPTS, expert_budget, run, with_executor
from test_moe_offload_emulated import POOL

DEVICES = ["emulated", pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not driver.gpu_available(), reason="no GPU")])]


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    from kestrel_stream.run.engine import Engine
    weights = random_q8_weights(MODELS[request.param], seed=7)
    cpu = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    return weights, [run(cpu, prompt) for prompt in PROMPTS]


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    if request.param == "emulated":
        fake_cuda.install(monkeypatch, mode="deferred")
    return request.param


# runs of one placement agree to float rounding, not bit for bit, on the H200 (measured 2026-12-05: 1e-7 to 3e-7
# relative between two runs that differ only in the images' pages, up to 2.4e-5 between the host reading the
# images and its own copies); the emulated device is exact
SAME_RUN_TOLERANCE = 1e-4


def linked_engine(weights, link: int | str, experts: int = 2, host_reads_images: bool = False, pages: str = "pinned"):
    options = Options.from_env({}).with_(resident_experts="frequency", link_experts=link,
                                         host_reads_images=host_reads_images, expert_images=pages)
    executor = StepExecutor(weights, "offload", POOL, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH,
                            vram_budget=expert_budget(weights.config, experts), options=options)
    return with_executor(weights, executor)


@pytest.mark.parametrize("link", [1, 2])
def test_the_link_share_decodes_as_the_cpu_engine(model, device, link):
    weights, reference = model
    if native_missing():
        pytest.skip("no native host kernels (no C compiler)")
    engine = linked_engine(weights, link)
    x = engine.executor
    assert x.steps.item_graphs.link is not None and x.steps.item_graphs.link.count == link
    for prompt, expected in zip(PROMPTS, reference):
        assert_logits_match(run(engine, prompt), expected)
    assert x.stats.get("streamed_bytes", 0) > 0, "the device read some experts over the link"
    assert x.stats["graph_replays"] > 0
    # the resident experts of a layer whose host item shares ran during that item, not before it
    assert x.steps.item_graphs.deferrals > 0
    engine.close()


def test_the_host_reads_fewer_expert_bytes_with_a_share(model, device):
    weights, _ = model
    if native_missing():
        pytest.skip("no native host kernels (no C compiler)")
    per_step = {}
    for link in (0, 2):
        engine = linked_engine(weights, link)
        x = engine.executor
        with engine.new_session() as s:
            token = int(np.argmax(s.prefill(PROMPTS[0])[-1]))
            for _ in range(3):                          # eager, captured, replayed: the share from the second
                token = int(np.argmax(s.decode(token)))
            before = dict(x.stats)
            token = int(np.argmax(s.decode(token)))
            per_step[link] = {k: x.stats.get(k, 0) - before.get(k, 0) for k in ("cpu_weight_read_bytes", "streamed_bytes")}
        engine.close()
    assert per_step[0]["streamed_bytes"] == 0 and per_step[2]["streamed_bytes"] > 0
    assert per_step[2]["cpu_weight_read_bytes"] < per_step[0]["cpu_weight_read_bytes"]


def test_defer_runs_the_resident_experts_during_the_host_item(model, device):
    """KESTREL_LINK_EXPERTS=defer: no images, no expert over the link; the hand-off carries a layer's resident
    experts (captured after the item's word): the CPU engine's logits, none streamed, some deferred."""
    weights, reference = model
    if native_missing():
        pytest.skip("no native host kernels (no C compiler)")
    engine = linked_engine(weights, "defer")
    x = engine.executor
    link = x.steps.item_graphs.link
    assert link is not None and link.image_bytes == 0 and not link.parts and link.layers
    for prompt, expected in zip(PROMPTS, reference):
        assert_logits_match(run(engine, prompt), expected)
    assert x.stats.get("streamed_bytes", 0) == 0 and x.stats["graph_replays"] > 0
    assert x.steps.item_graphs.deferrals > 0
    engine.close()


def batch_decode(engine, steps: int = 4) -> tuple[np.ndarray, int]:
    """Three sessions (PROMPTS) prefilled, then decoding together greedily: each step's logits [3, vocab],
    and the expert bytes those steps read over the link."""
    sessions = [engine.new_session() for _ in PROMPTS]
    tokens = [int(np.argmax(s.prefill(prompt)[-1])) for s, prompt in zip(sessions, PROMPTS)]
    stats = getattr(engine.executor, "stats", {})
    before, rows = stats.get("streamed_bytes", 0), []
    for _ in range(steps):
        logits = engine.decode_batch(list(zip(sessions, tokens)))
        rows.append(logits)
        tokens = [int(t) for t in logits.argmax(axis=1)]
    streamed = getattr(engine.executor, "stats", {}).get("streamed_bytes", 0) - before
    for s in sessions:
        s.close()
    return np.stack(rows), streamed


@pytest.mark.parametrize("link", ["half", "auto"])
def test_several_sessions_share_the_most_used_experts(model, device, link):
    """Steps of three sessions decoding together take the share too (count / k of the experts the host
    would compute, the most used): the CPU engine's logits, some expert bytes over the link; under auto
    the three-token steps have a tuner of their own, trying counts from 0."""
    from kestrel_stream.run.engine import Engine
    weights, _ = model
    if native_missing():
        pytest.skip("no native host kernels (no C compiler)")
    cpu = Engine(weights, device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    expected, _ = batch_decode(cpu)
    engine = linked_engine(weights, weights.config.num_experts_per_tok // 2 if link == "half" else link)
    share = engine.executor.steps.item_graphs.link
    if link == "auto":
        share.tuner.steps = 1                      # a step a count: three replays try 0, 1 (and 2 if 1 was faster)
    ours, streamed = batch_decode(engine)
    for step_ours, step_expected in zip(ours, expected):
        assert_logits_match(step_ours, step_expected)
    if link == "auto":
        assert sorted(share.tuners) == [1, 3] and list(share.tuners[3].tried)[:2] == [0, 1]
        assert not share.tuners[1].tried               # no one-token replay yet
    assert streamed > 0, "three-token steps read some experts over the link"
    engine.close()


def test_auto_tries_counts_while_serving_and_keeps_one(model, device, capsys):
    """KESTREL_LINK_EXPERTS=auto: replays try counts from 0 up (0 included: the device finds no expert and
    still hands back a zero sum), a few steps each, then keep the one measured fastest; the logits are the
    CPU engine's throughout."""
    weights, reference = model
    if native_missing():
        pytest.skip("no native host kernels (no C compiler)")
    engine = linked_engine(weights, "auto")
    link = engine.executor.steps.item_graphs.link
    link.tuner.steps = 1                              # one step a count: the short prompts settle it
    assert link.count == 0 and not link.tuner.settled
    for prompt, expected in zip(PROMPTS, reference):
        assert_logits_match(run(engine, prompt), expected)
    tuner = link.tuner
    assert tuner.settled and 0 in tuner.tried and link.count == tuner.best
    assert link.count == min(tuner.tried, key=tuner.tried.get)
    assert "link share: kept" in capsys.readouterr().err
    engine.close()


def native_missing() -> bool:
    from kestrel_stream import native
    return native.load(Options.from_env({})) is None


def test_the_host_reads_its_experts_from_the_link_images_and_keeps_no_copy_of_its_own(model, device):
    """KESTREL_HOST_READS_IMAGES=1: with the link's pinned images (pool layout: gate and up rows interleaved), the
    host's native experts read their Q8_0 rows there (device/expert_ring.host_expert_images): the same logits
    (to SAME_RUN_TOLERANCE) as a host reading its own split copies of the weights (0, the default), none of those
    prepared."""
    weights, reference = model
    if native_missing():
        pytest.skip("no native host kernels (no C compiler)")
    stacked = {id(lw.moe.gate_up) for lw in weights.layers if lw.moe is not None}
    stacked |= {id(lw.moe.down) for lw in weights.layers if lw.moe is not None}
    logits = {}
    for images in (True, False):                       # KESTREL_HOST_READS_IMAGES=1, 0
        engine = linked_engine(weights, 2, host_reads_images=images)
        host = engine.executor.steps.host
        assert engine.executor.steps.item_graphs.link.images
        assert sorted(host.expert_images) == (sorted(engine.executor.steps.item_graphs.link.images) if images else [])
        logits[images] = [run(engine, prompt) for prompt in PROMPTS]
        own = [key for key in host._prepared if key[0] in stacked]
        assert bool(own) != images, "expert rows the host prepared from its own weights"
        engine.close()
    for a, b in zip(logits[True], logits[False]):
        assert relative_error(a, b) < SAME_RUN_TOLERANCE and np.array_equal(a.argmax(-1), b.argmax(-1))
    for got, expected in zip(logits[True], reference):
        assert_logits_match(got, expected)


def test_registered_images_decode_as_pinned_ones(model, device):
    """KESTREL_EXPERT_IMAGES=registered: the link's images on huge pages, filled, then cuMemHostRegister'ed;
    the GPU reads its share and the host its own experts there (KESTREL_HOST_READS_IMAGES=1): the logits of
    cuMemHostAlloc'ed images (to SAME_RUN_TOLERANCE)."""
    weights, _ = model
    if native_missing():
        pytest.skip("no native host kernels (no C compiler)")
    logits = {}
    for pages in ("registered", "pinned"):
        engine = linked_engine(weights, 2, host_reads_images=True, pages=pages)
        link = engine.executor.steps.item_graphs.link
        buffers = [buffer for buffer, _ in link.images.values()]
        assert buffers and all((type(b).__name__ == "RegisteredBuffer") == (pages == "registered") for b in buffers)
        assert all(b.pinned for b in buffers if pages == "registered")
        x = engine.executor
        assert x.stats["expert_image_bytes"] == link.image_bytes > 0 and x.stats["expert_image_build_ms"] >= 0
        logits[pages] = [run(engine, prompt) for prompt in PROMPTS]
        assert engine.executor.stats.get("streamed_bytes", 0) > 0
        engine.close()
    for a, b in zip(logits["registered"], logits["pinned"]):
        assert relative_error(a, b) < SAME_RUN_TOLERANCE and np.array_equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("link", [1, 2])
def test_a_layer_whose_router_runs_on_the_host_shares_by_the_hosts_route(model, device, link):
    """A budget that leaves a routed layer no resident expert puts its router on the host too; the device's
    share of that layer combines by the route rows the host item copies up with the grouping (the device's own
    route buffer is stale there: the share once summed the last device-routed layer's weights, 0.17 relative
    error).  Decode replays match the CPU engine's."""
    weights, reference = model
    if native_missing():
        pytest.skip("no native host kernels (no C compiler)")
    for experts in range(3):            # the budget of one resident expert fewer than the routed layers
        engine = linked_engine(weights, link, experts=experts)
        x = engine.executor
        host_routed = [op.layer for segment in x.plan(1).segments if segment.side == "cpu" for op in segment.ops
                       if op.kind == "router"]
        if x.steps.item_graphs.link is not None and host_routed:
            break
        engine.close()
    else:
        raise AssertionError("no budget with a link share and a routed layer routed on the host")
    for prompt, expected in zip(PROMPTS, reference):
        assert_logits_match(run(engine, prompt), expected)
    assert x.stats["graph_replays"] > 0 and x.stats.get("streamed_bytes", 0) > 0
    engine.close()


@pytest.mark.parametrize("homes", ["first-host", "first-mlp", "last-host"])
def test_the_link_share_beside_every_home_decodes_as_the_cpu_engine(model, device, homes):
    """KESTREL_OFFLOAD_HOMES beside the share: the first or the last layer homed on the host (H), or the first
    streamed with its MLP on the host (M: the weights' ring, whose steps run eagerly and share nothing); the
    placement is the one asked for and every row is the CPU engine's."""
    weights, reference = model
    if native_missing():
        pytest.skip("no native host kernels (no C compiler)")
    L = weights.config.num_hidden_layers
    letters = {"first-host": "H" + "A" * (L - 1), "first-mlp": "M" + "A" * (L - 1), "last-host": "A" * (L - 1) + "H"}
    options = Options.from_env({}).with_(resident_experts="frequency", link_experts=1, offload_homes=letters[homes])
    executor = StepExecutor(weights, "offload", POOL, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH,
                            vram_budget=expert_budget(weights.config, 2), options=options)
    engine = with_executor(weights, executor)
    assert executor.placement_for(1).describe().split("layers ")[1].startswith(letters[homes])
    for prompt, expected in zip(PROMPTS, reference):
        assert_logits_match(run(engine, prompt), expected)
    engine.close()
