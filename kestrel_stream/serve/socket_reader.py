"""One thread that reads every Unix-socket connection of the daemon, off the event loop.

A decode request's way in is then: this thread wakes in ``epoll``, reads and
splits the frame, and queues the request for the step thread; it is back in
``epoll`` (the GIL released) a few bytecodes later.  Read by a callback of
the asyncio loop instead, the step thread waited for the loop to finish its
round before it could take the GIL, and a lone client's step paid for it: on
the 16-core H200 host, a minimal server of the daemon's protocol measured
+80 µs over the in-process step with a blocking reader thread and +262 µs
with an event-loop reader (bench/daemon_floor.py, engine-hop vs engine-loop).

The connection's coroutine still does everything but reading: frames this
thread cannot hand straight to the step thread are queued on the peer and the
coroutine is woken through ``call_soon_threadsafe``.
"""
from __future__ import annotations

import os
import select
import threading
import time
import traceback

WAKE = select.EPOLLIN | select.EPOLLRDHUP
RECEIVE_BYTES = 65536


class SocketReader:
    """The daemon's epoll thread: ``watch`` a peer while it may read, ``unwatch`` it to pause or end."""

    def __init__(self):
        self.epoll = select.epoll()
        self.peers: dict[int, object] = {}          # fd -> SocketPeer (any object with on_readable())
        # What a peer's recv lands in before it joins that peer's buffer: one for all, as only this thread reads
        # (a buffer per connection would hold 64 KiB of every idle one).
        self.scratch = memoryview(bytearray(RECEIVE_BYTES))
        self.stop_r, self.stop_w = os.pipe()
        self.epoll.register(self.stop_r, select.EPOLLIN)
        # Until then, poll without sleeping: set after a lone client's step, whose next request then finds this
        # core awake (a sleeping core takes tens of microseconds to resume, and runs cold a while after).
        self.spin_until = 0.0
        self.thread = threading.Thread(target=self.run, name="kestrel-read", daemon=True)
        self.thread.start()

    def watch(self, fd: int, peer) -> None:
        """Any thread: call ``peer.on_readable()`` on this thread whenever fd has bytes (or hung up)."""
        self.peers[fd] = peer
        try:
            self.epoll.register(fd, WAKE)
        except FileExistsError:
            self.epoll.modify(fd, WAKE)

    def unwatch(self, fd: int) -> None:
        """Any thread: stop reading fd (it may be closed once this returns and no on_readable runs)."""
        self.peers.pop(fd, None)
        try:
            self.epoll.unregister(fd)
        except (FileNotFoundError, OSError, ValueError):     # not registered, or the epoll is closed
            pass

    def spin_for(self, seconds: float) -> None:
        """This thread, after a lone client's step: poll without sleeping for ``seconds``."""
        self.spin_until = time.perf_counter() + seconds

    def run(self) -> None:
        poll, peers, clock = self.epoll.poll, self.peers, time.perf_counter
        while True:
            try:
                events = poll(0 if self.spin_until > clock() else -1)
            except InterruptedError:
                continue
            except (OSError, ValueError):                   # closed by stop()
                return
            for fd, _ in events:
                if fd == self.stop_r:
                    return
                peer = peers.get(fd)
                if peer is None:
                    continue
                try:
                    peer.on_readable()
                except Exception as e:              # a bug: that connection ends, every other one is still read
                    traceback.print_exc()
                    self.unwatch(fd)
                    peer.fail(e)

    def stop(self) -> None:
        os.write(self.stop_w, b"x")
        self.thread.join(timeout=5)
        self.epoll.close()
        os.close(self.stop_r)
        os.close(self.stop_w)
