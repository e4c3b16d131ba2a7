"""The daemon reuses a cached prompt prefix across clients by block hash: a second client's prompt that
shares a 1,000-token prefix computes only its suffix and gets the tokens a fresh run gets."""
from __future__ import annotations

import numpy as np

import kestrel_stream as ks
from daemon_helpers import DaemonProcess, solo_tokens

PREFIX = [int(t) for t in np.random.default_rng(3).integers(0, 256, 1000)]


def test_a_second_client_reuses_the_first_clients_prefix(long_tiny_model, tmp_path):
    proc = DaemonProcess.on_socket(long_tiny_model, tmp_path, "--max-seq-len", "1100")
    engine = ks.load(long_tiny_model, device="cpu", max_seq_len=1100)
    try:
        with ks.Client(proc.address) as first, first.new_session() as s:
            s.generate(PREFIX + [1, 2], 4)
            before = first.stats()
        with ks.Client(proc.address) as second, second.new_session() as s:
            prompt = PREFIX + [7, 7, 7]
            tokens = s.generate(prompt, 8)
            after = second.stats()
        cache_before, cache_after = before["prefix_cache"], after["prefix_cache"]
        assert cache_after["prefix_hits"] == cache_before["prefix_hits"] + 1
        assert cache_after["prefix_reused_tokens"] - cache_before["prefix_reused_tokens"] == 992
        # 1003 prompt tokens + 7 decode steps, of which only 11 + 7 ran
        assert after["counters"]["tokens"] - before["counters"]["tokens"] == 1003 - 992 + 7
        assert tokens == solo_tokens(engine, prompt, 7)
    finally:
        engine.close()
        assert proc.stop() == 0, (tmp_path / "serve.log").read_text()


def test_prefix_reuse_can_be_turned_off(tiny_model, tmp_path):
    proc = DaemonProcess.on_socket(tiny_model, tmp_path, "--prefix-cache-positions", "0")
    try:
        with ks.Client(proc.address) as client, client.new_session() as s:
            s.generate(list(range(40)), 2)
            s.reset()
            s.generate(list(range(40)), 2)
            assert client.stats()["prefix_cache"] == {}
    finally:
        assert proc.stop() == 0
