"""bench/host_kernels_beside_link.py on the emulated device (fake_cuda): each format and token count timed alone
and beside a thread keeping H2D copies queued, the copies' rate measured meanwhile (copies run as they are
queued: under the deferred policy the copier's event would wait for a sync that never comes)."""
from __future__ import annotations

import pytest

import fake_cuda
from kestrel_stream import native


def test_each_format_alone_and_beside_the_link(monkeypatch):
    try:
        native.load(None)
    except native.NativeUnavailable:
        pytest.skip("no native host kernels here")
    fake_cuda.install(monkeypatch, mode="immediate")
    from bench import host_kernels_beside_link
    rows = host_kernels_beside_link.main(["--tokens", "1,4", "--formats", "Q8_0,Q4_K", "--seconds", "0.05",
                                          "--weight-mb", "4", "--threads", "1"])
    assert [(r["format"], r["tokens"]) for r in rows] == [("Q8_0", 1), ("Q8_0", 4), ("Q4_K", 1), ("Q4_K", 4)]
    for r in rows:
        assert r["alone_GBps"] > 0 and r["beside_link_GBps"] > 0 and r["link_GBps"] > 0
        assert abs(r["ratio"] - r["beside_link_GBps"] / r["alone_GBps"]) < 0.005
