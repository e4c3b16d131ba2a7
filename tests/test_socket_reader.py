"""The daemon's socket reader thread (kestrel_stream/socket_reader.py): it calls each watched connection when bytes
arrive, stops calling one that is unwatched, polls without sleeping while asked to, and survives a connection
whose handler fails."""
from __future__ import annotations

import socket
import threading
import time

from kestrel_stream.serve.socket_reader import SocketReader


class FakePeer:
    def __init__(self, sock: socket.socket, explode: bool = False):
        self.sock, self.explode = sock, explode
        self.received, self.failed = [], None
        self.seen = threading.Event()

    def on_readable(self) -> None:
        data = self.sock.recv(100)
        self.received.append(data)
        self.seen.set()
        if self.explode:
            raise RuntimeError("a bug in this connection's handler")

    def fail(self, error: Exception) -> None:
        self.failed = error


def pair():
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    return ours, theirs


def test_each_connection_is_called_with_its_bytes_and_a_failing_one_ends_alone():
    reader = SocketReader()
    (a, a_client), (b, b_client) = pair(), pair()
    bad, good = FakePeer(a, explode=True), FakePeer(b)
    try:
        reader.watch(a.fileno(), bad)
        reader.watch(b.fileno(), good)
        a_client.send(b"x")
        assert bad.seen.wait(5)
        for _ in range(100):                        # the failure is handled right after the call
            if bad.failed is not None:
                break
            time.sleep(0.01)
        assert isinstance(bad.failed, RuntimeError)
        a_client.send(b"more")                      # no longer watched: never read
        b_client.send(b"hello")
        assert good.seen.wait(5) and good.received == [b"hello"]
        time.sleep(0.05)
        assert bad.received == [b"x"]
    finally:
        reader.stop()
        for s in (a, a_client, b, b_client):
            s.close()
    assert not reader.thread.is_alive()


def test_unwatched_connections_are_not_read_and_spinning_ends_by_itself():
    reader = SocketReader()
    ours, theirs = pair()
    peer = FakePeer(ours)
    try:
        reader.watch(ours.fileno(), peer)
        reader.unwatch(ours.fileno())
        theirs.send(b"x")
        assert not peer.seen.wait(0.1)
        reader.spin_for(0.02)
        reader.watch(ours.fileno(), peer)           # watched again: the waiting bytes are read
        assert peer.seen.wait(5) and peer.received == [b"x"]
        time.sleep(0.05)
        assert reader.spin_until < time.perf_counter()
    finally:
        reader.stop()
        ours.close()
        theirs.close()
