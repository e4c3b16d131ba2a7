"""The experts' pinned images (run/device/expert_ring.layer_images): filled by threads and by one thread alike,
on registered huge pages as on cuMemHostAlloc's, a failing fill freeing every buffer, cuda/memory.RegisteredBuffer
itself, and the host's experts reading their rows in the ring's images (KESTREL_HOST_READS_IMAGES=1) with the
numbers of its own copies.  The ring itself: test_moe_stream_emulated.py; the link share's images:
test_expert_link.py."""
from __future__ import annotations

import numpy as np
import pytest

from kestrel_stream.options import Options
from kestrel_stream.run.device import expert_pool
from test_moe_stream_emulated import (DECODE_STEPS, PROMPT, emulated, host_has, model, routed,  # noqa: F401
                                      stream_engine, streaming_weights)


def test_the_host_reads_its_experts_in_the_rings_images_with_the_same_numbers(model, emulated):
    """KESTREL_HOST_READS_IMAGES=1 with an experts' ring: the host's native experts (decode steps keep them on
    the host) read the ring's pinned images in place: the logits of the host's own copies bit for bit, none of
    those copies prepared."""
    from kestrel_stream import native
    weights, _ = model
    native_options = Options.from_env().with_(host_kernels="native")
    if native.load(native_options) is None:
        pytest.skip("no native host kernels (no C compiler)")
    stacked = {id(w) for lw in weights.layers if lw.moe is not None for w in (lw.moe.gate_up, lw.moe.down)}
    logits = {}
    for reads in (True, False):
        engine = stream_engine(weights, options=native_options.with_(host_reads_images=reads))
        x = engine.executor
        assert bool(x.steps.host.expert_images) == reads and x.steps.expert_ring is not None
        with engine.new_session() as s:
            out = [np.asarray(s.prefill(PROMPT))[-1]]
            for _ in range(DECODE_STEPS):
                out.append(np.asarray(s.decode(int(np.argmax(out[-1])))).reshape(-1))
        logits[reads] = np.stack(out)
        assert bool([key for key in x.steps.host._prepared if key[0] in stacked]) != reads
        engine.close()
    assert np.array_equal(logits[True], logits[False])


@pytest.fixture
def ring_store(emulated):
    """(weights, the ExpertStore) of an engine with an experts' ring (streaming_weights), closed after."""
    weights = streaming_weights()
    host_has(emulated, 64 * 2**30)
    engine = stream_engine(weights, stream="auto")
    yield weights, engine.executor.steps.expert_ring.store
    engine.close()


def test_images_filled_by_several_threads_are_one_threads_and_a_failing_fill_frees_them_all(emulated, ring_store):
    """expert_ring.layer_images: the buffers pinned on the calling thread, filled by a pool: 3 threads write the
    bytes 1 thread writes; an expert whose copy fails mid-way frees every buffer pinned and raises its error."""
    from kestrel_stream.run.device import expert_ring
    weights, store = ring_store
    c = weights.config
    one = expert_ring.layer_images(store, weights, routed(c), threads=1)
    three = expert_ring.layer_images(store, weights, routed(c), threads=3)
    assert list(one) == list(three) == routed(c)
    for layer in routed(c):
        (a, regions), (b, regions_b) = one[layer], three[layer]
        assert regions == regions_b and a.nbytes == b.nbytes == expert_pool.layer_slot_bytes(c)
        assert np.array_equal(a.view(np.uint8, (a.nbytes,), 0), b.view(np.uint8, (b.nbytes,), 0))
        assert a.view(np.uint8, (a.nbytes,), 0).any()
    for images in (one, three):
        for buffer, _ in images.values():
            buffer.free()
    assert_a_failing_fill_frees_every_buffer(emulated, store, weights, "pinned", threads=2)


def test_registered_images_are_the_pinned_ones_pinned_after_their_fill(emulated, ring_store):
    """layer_images(pages="registered"): the same bytes as cuMemHostAlloc'ed images, each buffer pinned once
    its fill is done (a kernel may read it then), every one freed when a fill fails."""
    from kestrel_stream.cuda import driver
    from kestrel_stream.run.device import expert_ring
    weights, store = ring_store
    c = weights.config
    pinned = expert_ring.layer_images(store, weights, routed(c), threads=2)
    registered = expert_ring.layer_images(store, weights, routed(c), threads=2, pages="registered")
    for layer in routed(c):
        (a, _), (b, _) = pinned[layer], registered[layer]
        assert isinstance(b, driver.RegisteredBuffer) and b.pinned and driver.host_word(b.address) == b.address
        assert np.array_equal(a.view(np.uint8, (a.nbytes,), 0), b.view(np.uint8, (b.nbytes,), 0))
    for images in (pinned, registered):
        for buffer, _ in images.values():
            buffer.free()
    assert_a_failing_fill_frees_every_buffer(emulated, store, weights, "registered", threads=1)


def assert_a_failing_fill_frees_every_buffer(monkeypatch, store, weights, pages: str, threads: int) -> None:
    """layer_images with an expert's copy failing inside the second layer's gate_up: its error raised, every
    buffer made (pinned or registered) freed."""
    from kestrel_stream.cuda import driver
    from kestrel_stream.run.device import expert_ring
    kind = "RegisteredBuffer" if pages == "registered" else "PinnedBuffer"
    made, real, write, calls = [], getattr(driver, kind), expert_ring.write_expert, [0]

    def buffer(nbytes: int):
        made.append(real(nbytes))
        return made[-1]

    def failing(*args):
        calls[0] += 1
        if calls[0] == 2 * weights.config.num_experts + 3:
            raise MemoryError("a copy failed")
        write(*args)
    monkeypatch.setattr(driver, kind, buffer)
    monkeypatch.setattr(expert_ring, "write_expert", failing)
    with pytest.raises(MemoryError, match="a copy failed"):
        expert_ring.layer_images(store, weights, routed(weights.config), threads=threads, pages=pages)
    assert len(made) >= 2 and all(b.address == 0 for b in made)
def test_a_registered_buffer_is_huge_page_advised_anonymous_memory_until_pinned():
    """cuda/memory.RegisteredBuffer without a GPU: page-aligned, zeroed, writable bytes before `pin` (which is
    cuMemHostRegister's); freed unpinned, nothing is asked of the driver."""
    import mmap as mmap_module
    from kestrel_stream.cuda.memory import PinnedBuffer, RegisteredBuffer
    buffer = RegisteredBuffer(3 * mmap_module.PAGESIZE + 5)
    assert isinstance(buffer, PinnedBuffer) and not buffer.pinned
    assert buffer.address % mmap_module.PAGESIZE == 0 and not buffer.bytes.any()
    view = buffer.view(np.float16, (4, 2), 8)
    view[:] = 1.5
    assert buffer.bytes[8:24].view(np.float16).tolist() == [1.5] * 8
    buffer.free()
    assert buffer.address == 0 and buffer.bytes is None
    assert view.tolist() == [[1.5, 1.5]] * 4                  # a view outlives the buffer's own reference
