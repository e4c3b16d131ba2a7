"""The preload's two pinned staging buffers (run/window.py upload_images): each is as big as the largest
group of images it takes, so one image bigger than a chunk (a vocabulary-sized lm_head) pins one buffer
of its size instead of two; every image still reaches the device as written."""
from __future__ import annotations

import fake_cuda
import numpy as np
import pytest
from kestrel_stream.loading.presets import PRESETS
from bench.synthetic import random_q8_weights
from kestrel_stream.run.device import weight_window as window


@pytest.mark.parametrize("pattern", ["sssBsss", "BBs", "sBsB", "B"])
def test_big_images_pin_one_big_buffer_and_every_image_arrives(monkeypatch, pattern):
    """s: an image of less than a chunk, B: one bigger (two small ones make a chunk)."""
    fake_cuda.install(monkeypatch, mode="deferred")
    from kestrel_stream.cuda import driver
    pinned = []
    real = driver.PinnedBuffer

    def recorded(nbytes):
        pinned.append(nbytes)
        return real(nbytes)
    monkeypatch.setattr(driver, "PinnedBuffer", recorded)
    layer = random_q8_weights(PRESETS["tiny"], seed=3).layers[0]
    small, big = layer.w_down, layer.wqkv                    # 64x160 and 512x64 int8 (+ scales)
    order = [big if c == "B" else small for c in pattern]
    sizes = [window._align(window.image_bytes_of(w)) for w in order]
    offsets = np.cumsum([0] + sizes[:-1]).tolist()
    chunk = 2 * window._align(window.image_bytes_of(small))
    assert window.image_bytes_of(big) > chunk
    arena = driver.Arena(sum(sizes))
    base = arena.alloc(sum(sizes))
    window.upload_images([(o, w, False) for o, w in zip(offsets, order)], base, driver.Stream("test"),
                         chunk_bytes=chunk)
    image = window.image_bytes_of
    two_small = window._align(image(small)) + image(small)
    expected_buffers = {"sssBsss": [image(big), two_small], "BBs": [image(big), image(small)],
                        "sBsB": [image(big), image(small)], "B": [image(big)]}[pattern]
    assert pinned == expected_buffers, pinned            # before: both buffers as big as the big image
    for offset, w in zip(offsets, order):
        written = np.zeros(image(w), np.uint8)
        window.write_image(written, w, False)
        np.testing.assert_array_equal(fake_cuda.dev(base + offset, written.nbytes), written)
