"""The daemon's limits as a client meets them: an error frame that names the flag, then (for a connection's
limits) that connection closes; every other client goes on."""
from __future__ import annotations

import time

import numpy as np
import pytest
from daemon_helpers import DaemonProcess, closed_by_peer, frame_bytes, raw_connect, read_frame

import kestrel_stream as ks
from kestrel_stream.wire import protocol as wire


@pytest.fixture(scope="module")
def tight(tiny_model, tmp_path_factory):
    where = tmp_path_factory.mktemp("tight")
    proc = DaemonProcess.on_socket(tiny_model, where, "--max-seq-len", "128",
                                   "--max-connections", "4", "--max-unauthenticated", "2", "--hello-timeout-s", "0.5",
                                   "--idle-timeout-s", "1.0", "--max-sessions-per-client", "2",
                                   "--write-timeout-s", "0.5")
    yield proc
    assert proc.stop() == 0, (where / "serve.log").read_text()


def wait_for_connections(client, count: int, sessions: int | None = None) -> None:
    """Until the daemon holds ``count`` connections (and ``sessions``: a leaving client's are freed just after)."""
    deadline = time.monotonic() + 20
    while True:
        stats = client.stats()
        if stats["connections"] == count and sessions in (None, stats["sessions"]):
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_connections_over_the_limits_are_refused_with_the_flag_named(tight):
    with ks.Client(tight.address) as watcher:
        silent = [raw_connect(tight.address, hello=False) for _ in range(2)]
        time.sleep(0.1)
        extra = raw_connect(tight.address, hello=False)
        reply = read_frame(extra).header
        assert reply["code"] == "capacity" and "--max-unauthenticated 2" in reply["message"]
        assert closed_by_peer(extra)
        for sock in silent:
            sock.close()
        wait_for_connections(watcher, 1)
        held = [ks.Client(tight.address) for _ in range(3)]
        with pytest.raises(ks.CapacityError, match="--max-connections 4"):
            ks.Client(tight.address)
        for client in held:
            client.close()
        wait_for_connections(watcher, 1)
        assert ks.Client(tight.address).stats()["connections"] == 2


def test_a_connection_that_does_not_say_hello_in_time_is_closed(tight):
    sock = raw_connect(tight.address, hello=False)
    started = time.monotonic()
    reply = read_frame(sock).header
    assert reply["code"] == "auth" and "--hello-timeout-s" in reply["message"]
    assert 0.4 < time.monotonic() - started < 5 and closed_by_peer(sock)


def test_frames_before_hello_are_small(tight):
    sock = raw_connect(tight.address, hello=False)
    sock.sendall(frame_bytes({"op": "hello", "id": 1, "v": 1, "pad": "x" * 5000}))
    reply = read_frame(sock).header
    assert reply["code"] == "protocol" and "4096" in reply["message"]
    assert closed_by_peer(sock)


def test_an_idle_connection_is_closed_and_its_sessions_freed(tight):
    idle = ks.Client(tight.address)
    idle.new_session().prefill([1, 2], want="token")
    busy = ks.Client(tight.address)
    s = busy.new_session()
    token = s.prefill([3], want="token")
    for _ in range(15):                           # 1.5 s of decodes answered by the reader thread: not idle
        token = s.decode(token, want="token")
        time.sleep(0.1)
    with pytest.raises(wire.IdleTimeoutError, match="--idle-timeout-s"):
        idle.stats()
    wait_for_connections(busy, 1, sessions=1)     # busy's own, still open; idle's freed
    busy.close()


def test_sessions_per_client(tight):
    with ks.Client(tight.address) as a, ks.Client(tight.address) as b:
        a.new_session(), a.new_session()
        with pytest.raises(ks.CapacityError, match="--max-sessions-per-client 2"):
            a.new_session()
        assert b.new_session().prefill([1], want="token") >= 0


def test_a_client_that_does_not_read_is_disconnected(tight):
    with ks.Client(tight.address) as watcher:
        sock = raw_connect(tight.address)
        sock.sendall(wire.encode_frame({"op": "open", "id": 1}))
        session = read_frame(sock).header["session"]
        request = wire.encode_frame({"op": "prefill", "id": 2, "session": session, "want": "logits"},
                                    {"ids": np.arange(64, dtype=np.int64)})
        reset = wire.encode_frame({"op": "reset", "id": 3, "session": session})
        sock.settimeout(5.0)
        try:
            for _ in range(200):                  # answers of 64 x vocab floats each, never read
                sock.sendall(request + reset)
        except OSError:
            pass                                  # the daemon hung up while we were still sending
        wait_for_connections(watcher, 1, sessions=0)
        sock.close()
    assert "did not read" in tight.log_path.read_text() or "read none" in tight.log_path.read_text()
