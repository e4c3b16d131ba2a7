"""What one host hand-off inside a step graph costs on this machine (run/host_nodes.py: the graph writes a
pinned word, the host library's thread runs the item and writes the other, the graph waits for it), against
what a host sync costs (a small H2D and D2H, then a stream sync):

    python3 -m bench.graph_handoff [--replays 300] [--activation-kb 128] [--busy-link-mb 14]

Graphs of 0, 1, 8 and 32 hand-offs (each a tiny norm item) between two memsets are replayed; a hand-off's cost
is (replay(N) - replay(0)) / N, medians after a warm-up.  scheduler/step_sim.py prices each hand-off at the
profile's round_trip_us (a sync) plus a host call; this says what the graphs pay instead.
--activation-kb: each hand-off also copies that much down before its item and up after it (a mixed step's x,
16 tokens of a 2,048-wide model: 128 KB), as copies in the graph.  --busy-link-mb: meanwhile another stream
keeps the host-to-device link busy with copies of that size (mode offload's weight ring: 2-14 MB items), to
see whether the activations' copies queue behind them; --kernel-copy: the upload as the copy_words kernel mode
offload launches where a ring streams (run/mixed.py).  Needs a GPU.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

HANDOFFS = (0, 1, 8, 32)
BUSY_AHEAD = 64            # --busy-link-mb copies queued at a time


def median_us(run, replays: int) -> float:
    times = []
    for _ in range(replays):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times[replays // 6:]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replays", type=int, default=300)
    parser.add_argument("--activation-kb", type=int, default=0, help="copied down and up around each hand-off")
    parser.add_argument("--kernel-copy", action="store_true",
                        help="the activation's upload as mode offload's copy_words kernel (reads pinned memory), not a copy")
    parser.add_argument("--busy-link-mb", type=float, default=0.0, help="H2D copies of this size meanwhile (0: none)")
    args = parser.parse_args()
    from kestrel_stream import native
    from kestrel_stream.cuda import driver
    from kestrel_stream.run.host_nodes import ITEM_NORM, HostNodes

    driver.Device(0)
    kernels = native.load(None)
    pinned = type("Pinned", (), {})()           # what a norm item reads and writes: x, xn, 1/rms of one row
    x = driver.PinnedBuffer(4 * 64)
    pinned.buffers = {"x": x}
    pinned.xn, pinned.inv_rms = np.zeros((1, 64), np.float32), np.zeros(1, np.float32)
    nodes = HostNodes(kernels, pinned)
    node = nodes.norm(np.ones(64, np.float32), 1e-6, 1)
    stream = driver.Stream("graph hand-offs")
    act = args.activation_kb << 10
    busy = int(args.busy_link_mb * (1 << 20))
    arena = driver.Arena((1 << 20) + act + busy)
    scratch = arena.alloc(4096)
    act_dev = arena.alloc(act) if act else 0
    act_host = driver.PinnedBuffer(act) if act else None
    link = driver.Stream("busy link") if busy else None
    upload = None
    if act and args.kernel_copy:
        from kestrel_stream.cuda.kernels import KernelSet
        words = act // 4
        upload = KernelSet(driver.Device(0), None).launch("copy_words", (max(1, min(-(-words // 256), 64)),), (256,),
                                                         "ppi", [act_dev, act_host.address, words])
    busy_dev, busy_host = (arena.alloc(busy), driver.PinnedBuffer(busy)) if busy else (0, None)
    drained = driver.Event(name="busy link drained")
    queued = [0]

    def keep_link_busy() -> None:
        """At least BUSY_AHEAD copies queued on the link's stream (refilled once the last batch is done)."""
        if busy and (not queued[0] or drained.query()):
            for _ in range(BUSY_AHEAD):
                driver.h2d_async(busy_dev, busy_host, busy, link)
            drained.record(link)
            queued[0] = 1

    replay_us = {}
    for n in HANDOFFS:
        items: list = []
        with driver.capture(stream) as held:
            driver.memset_async(scratch, 64, stream)
            for _ in range(n):
                if act:
                    driver.d2h_async(act_host, act_dev, act, stream)
                nodes.hand_over(stream, items, ITEM_NORM, node)
                if upload is not None:
                    upload.enqueue(stream)
                elif act:
                    driver.h2d_async(act_dev, act_host, act, stream)
            driver.memset_async(scratch, 64, stream)
        made = nodes.item_list(items) if items else None

        def replay() -> None:
            keep_link_busy()
            if made:
                nodes.begin(made)
            held.graph.launch(stream)
            stream.synchronize()
            if made and nodes.end() != 0:
                raise RuntimeError("a hand-off's word never came")

        replay_us[n] = median_us(replay, args.replays)
        print(f"graph with {n:2d} hand-offs: {replay_us[n]:.1f} us a replay")
    for n in HANDOFFS[1:]:
        print(f"a hand-off, from {n:2d}: {(replay_us[n] - replay_us[0]) / n:.2f} us")
    small = driver.PinnedBuffer(4096)

    def round_trip() -> None:
        driver.h2d_async(scratch, small, 4096, stream)
        driver.d2h_async(small, scratch, 4096, stream)
        stream.synchronize()

    print(f"a host sync (4 KB H2D + D2H + stream sync): {median_us(round_trip, args.replays):.1f} us")
    if link is not None:
        link.synchronize()
    nodes.close()


if __name__ == "__main__":
    main()
