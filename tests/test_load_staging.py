"""The preload's two pinned staging buffers (run/window.py upload_images): each is as big as the largest
group of images it takes, so one image bigger than a chunk (a vocabulary-sized lm_head) pins one buffer
of its size instead of two; every image still reaches the device as written."""
from __future__ import annotations

import fake_cuda
import numpy as np
from kestrel_stream.loading.presets import PRESETS, random_q8_weights
from kestrel_stream.run import window


def test_one_big_image_pins_one_big_buffer_and_every_image_arrives(monkeypatch):
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
    order = [small, small, small, big, small, small, small]
    sizes = [window._align(window.image_bytes_of(w)) for w in order]
    offsets = np.cumsum([0] + sizes[:-1]).tolist()
    chunk = 2 * sizes[0]                                    # two small ones a group; the big one alone
    assert sizes[3] > chunk
    arena = driver.Arena(sum(sizes))
    base = arena.alloc(sum(sizes))
    stream = driver.Stream("test")
    window.upload_images([(o, w, False) for o, w in zip(offsets, order)], base, stream, chunk_bytes=chunk)
    # groups [s s] [s] [B] [s s] [s]: buffer 0 takes groups 0, 2, 4 (B), buffer 1 groups 1 and 3
    image = window.image_bytes_of
    assert pinned == [image(big), sizes[0] + image(small)], pinned
    assert sum(pinned) < 2 * sizes[3]
    for offset, w in zip(offsets, order):
        expected = np.zeros(window.image_bytes_of(w), np.uint8)
        window.write_image(expected, w, False)
        np.testing.assert_array_equal(fake_cuda.dev(base + offset, expected.nbytes), expected)
