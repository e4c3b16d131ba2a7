"""The daemon's connection writes (kestrel_stream/peer.py) on a socket pair: answers from the step thread go out
whole and in order, whatever the socket takes at once and whoever else is writing."""
from __future__ import annotations

import socket
import threading

import anyio
import numpy as np
from daemon_helpers import read_frame

from kestrel_stream.wire import protocol as wire


def test_an_answer_the_socket_takes_only_in_part_is_finished_whole_and_first():
    """The step thread writes what a full socket takes; the loop sends the rest before anything else goes out."""
    from kestrel_stream.serve.socket_peer import SocketPeer as Peer

    async def main():
        ours, theirs = socket.socketpair()
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        ours.setblocking(False)
        peer = Peer(await anyio.abc.UNIXSocketStream.from_socket(ours), wire.DEFAULT_MAX_FRAME_BYTES)
        logits = np.arange(200_000, dtype=np.float32)
        finished = anyio.Event()
        await anyio.to_thread.run_sync(peer.send_from_step_thread, {"id": 1, "ok": True}, {"logits": logits},
                                       lambda: peer.loop.call_soon_threadsafe(finished.set))
        assert peer.write_lock.locked() and not finished.is_set()  # the socket took only part of the frame

        async def second():
            await peer.send({"id": 2, "ok": True})

        async with anyio.create_task_group() as tg:
            tg.start_soon(second)
            theirs.settimeout(10.0)
            first = await anyio.to_thread.run_sync(read_frame, theirs)
            after = await anyio.to_thread.run_sync(read_frame, theirs)
        assert first.header["id"] == 1 and np.array_equal(first.arrays["logits"], logits)
        assert after.header["id"] == 2 and finished.is_set()
        assert not peer.write_lock.locked()
        ours.close()
        theirs.close()

    anyio.run(main)


def test_an_answer_waits_for_a_write_in_progress_and_goes_out_whole():
    """When another write holds the socket, the step thread leaves its answer to the loop, which sends it next."""
    from kestrel_stream.serve.socket_peer import SocketPeer

    async def main():
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        peer = SocketPeer(await anyio.abc.UNIXSocketStream.from_socket(ours), wire.DEFAULT_MAX_FRAME_BYTES)
        finished = anyio.Event()
        peer.write_lock.acquire()                           # a shutdown notice, say, being written
        await anyio.to_thread.run_sync(peer.send_from_step_thread, {"id": 1, "ok": True, "token": 7}, None,
                                       lambda: peer.loop.call_soon_threadsafe(finished.set))
        await anyio.sleep(0.01)
        assert not finished.is_set()
        peer.write_lock.release()
        with anyio.fail_after(10):
            await finished.wait()
        theirs.settimeout(10.0)
        assert read_frame(theirs).header == {"id": 1, "ok": True, "token": 7}
        assert not peer.write_lock.locked()
        peer.close()
        ours.close()
        theirs.close()

    anyio.run(main)


def test_reading_pauses_once_the_frames_read_ahead_hold_max_buffered_bytes():
    """--max-buffered-mb: a client that sends faster than its requests are answered is read no further ahead."""
    from kestrel_stream.serve.limits import Limits
    from kestrel_stream.serve.socket_peer import SocketPeer

    async def main():
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        peer = SocketPeer(await anyio.abc.UNIXSocketStream.from_socket(ours), wire.DEFAULT_MAX_FRAME_BYTES,
                          limits=Limits(max_buffered_bytes=1 << 20))
        peer.authenticate()
        frames = [wire.encode_frame({"op": "prefill", "id": i}, {"ids": np.full(75_000, i, np.int64)})
                  for i in range(3)]                        # 600 KB each
        sender = threading.Thread(target=theirs.sendall, args=(b"".join(frames),), daemon=True)
        sender.start()
        with anyio.fail_after(10):
            while peer.reading:
                await anyio.sleep(0.01)
        held = peer.queued_bytes + len(peer.buffer)
        assert peer.frames and 1 << 20 <= held < 1_200_000 + wire.PREFIX_BYTES + 256     # the rest waits in the socket
        got = [await peer.read_frame() for _ in range(3)]
        assert [f.header["id"] for f in got] == [0, 1, 2] and int(got[2].arrays["ids"][0]) == 2
        sender.join()
        peer.close()
        ours.close()
        theirs.close()

    anyio.run(main)


def test_a_closed_connection_is_freed_at_once_with_its_half_read_frame():
    """No reference cycle (peer -> take_at_once -> peer) keeps a dropped client's buffer until a full collection."""
    import gc
    import weakref

    from kestrel_stream.serve.socket_peer import SocketPeer

    async def main():
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        peer = SocketPeer(await anyio.abc.UNIXSocketStream.from_socket(ours), wire.DEFAULT_MAX_FRAME_BYTES)
        peer.take_at_once = lambda frame: peer is not None          # as the daemon's callback refers back
        frame = wire.encode_frame({"op": "prefill", "id": 1}, {"ids": np.zeros(1 << 18, np.int64)})
        theirs.sendall(frame[:len(frame) // 2])
        with anyio.fail_after(10):
            while len(peer.buffer) < len(frame) // 2:
                await anyio.sleep(0.01)
        gone = weakref.ref(peer)
        peer.close()
        del peer
        await anyio.sleep(0.01)                 # callbacks the reader thread scheduled on the loop have run
        assert gone() is None
        ours.close()
        theirs.close()

    gc.disable()
    try:
        anyio.run(main)
    finally:
        gc.enable()
