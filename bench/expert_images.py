"""The host's experts op reading its own split copies against reading the device's pinned images of the same
experts in place (KESTREL_HOST_READS_IMAGES=1), the images on cuMemHostAlloc's pages (the default) and on
registered huge pages (KESTREL_EXPERT_IMAGES=registered), and what building each kind of image costs.

    python3 -m bench.expert_images [--layers 16] [--experts 32] [--hidden 2048 --inter 768 --choices 8]
                                   [--threads N] [--calls 200] [--out DIR]

Random Q8_0 experts of Qwen3-30B-A3B's shape by default, --layers x --experts of them (2.5 GB: calls cycle
through the layers, so the chosen experts come from memory, not the last-level cache).  The images are made
by the engine's own code (run/device/expert_ring.layer_images, host_expert_images) from stand-ins of its
ExpertStore and weights.  Rows, per layout: the images' build (pinning and the threads' fill) in s and GB/s,
then a one-token experts call (native/routed.Experts, --choices random experts of a layer, a new layer each
call): median and best µs and GB/s.  The three layouts' calls alternate in rounds (each first in a third of
them), so a machine's drift falls on each alike.  Needs a GPU (pinned memory), or tests/fake_cuda's emulation.
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np

from kestrel_stream import native
from kestrel_stream.model.quant import QTensor
from kestrel_stream.native.routed import Experts
from kestrel_stream.options import Options

LAYOUTS = ("own", "pinned", "registered")


def stand_ins(rng, layers: int, E: int, H: int, I: int):
    """(store, weights) as layer_images and host_expert_images read them: per layer a stacked gate|up
    [E 2I, H] (each expert's gate rows, then its up rows) and down [E H, I] in Q8_0."""
    def q8(rows: int, cols: int) -> QTensor:
        return QTensor(rng.integers(-127, 128, (rows, cols), dtype=np.int8),
                       rng.uniform(0.001, 0.002, (rows, cols // 32)).astype(np.float16))
    moes = [SimpleNamespace(gate_up=q8(E * 2 * I, H), down=q8(E * H, I),
                            gate_up_rows=lambda e: (e * 2 * I, (e + 1) * 2 * I),
                            down_rows=lambda e: (e * H, (e + 1) * H)) for _ in range(layers)]
    weights = SimpleNamespace(layers=[SimpleNamespace(moe=m) for m in moes])
    store = SimpleNamespace(config=SimpleNamespace(num_experts=E),
                            gate_up=SimpleNamespace(qs_slot=2 * I * H, meta_slot=2 * I * H // 16),
                            down=SimpleNamespace(qs_slot=H * I, meta_slot=H * I // 16),
                            formats={layer: ("Q8_0", "Q8_0") for layer in range(layers)})
    return store, weights


def own_experts(kernels, weights, layer: int, E: int, k: int, norm) -> Experts:
    moe = weights.layers[layer].moe
    gate_ups = [kernels.linear(kernels.prepare_q8_0(moe.gate_up.qs[lo:hi], moe.gate_up.scales[lo:hi]), None, 0.0,
                               glu=True) for lo, hi in map(moe.gate_up_rows, range(E))]
    downs = [kernels.linear(kernels.prepare_q8_0(moe.down.qs[lo:hi], moe.down.scales[lo:hi]))
             for lo, hi in map(moe.down_rows, range(E))]
    return Experts(kernels, gate_ups, downs, norm, 1e-6, k)


def image_experts(kernels, parts, E: int, k: int, norm) -> Experts:
    gate_ups, downs = [], []
    for e in range(E):
        halves, down = parts(e)
        gate_ups.append(kernels.linear(kernels.prepare_q8_0_halves(*halves), None, 0.0, glu=True))
        downs.append(kernels.linear(kernels.prepare_q8_0(*down)))
    return Experts(kernels, gate_ups, downs, norm, 1e-6, k)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--choices", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from kestrel_stream.cuda import driver
    from kestrel_stream.run.device.expert_ring import host_expert_images, layer_images
    L, E, H, I, k = args.layers, args.experts, args.hidden, args.inter, args.choices
    assert 0 < k <= E and H % 32 == 0 and I % 32 == 0
    device = driver.Device(0)
    device.make_current()
    kernels = native.load(Options.from_env({}), threads=args.threads)
    rng = np.random.default_rng(0)
    store, weights = stand_ins(rng, L, E, H, I)
    norm = np.ones(H, np.float32)
    layers = list(range(L))
    experts = {"own": [own_experts(kernels, weights, layer, E, k, norm) for layer in layers]}
    built, images = {}, {}
    for pages in ("pinned", "registered"):
        start = time.perf_counter()
        images[pages] = layer_images(store, weights, layers, pages=pages)
        built[pages] = time.perf_counter() - start
        parts = host_expert_images(store, weights, images[pages])
        experts[pages] = [image_experts(kernels, parts[layer], E, k, norm) for layer in layers]
    image_bytes = sum(buffer.nbytes for buffer, _ in images["pinned"].values())
    expert_bytes = (2 * I * H + H * I) * 34 // 32
    x = rng.standard_normal((1, H)).astype(np.float32)
    routes = [np.concatenate([rng.choice(E, k, replace=False).astype(np.float32), np.full(k, 1.0 / k, np.float32)])[None]
              for _ in range(64)]
    times = {layout: [] for layout in LAYOUTS}
    for r in range(3 + args.calls):            # rounds: each layout's call on the same layer and route
        layer, route = r % L, routes[r % len(routes)]
        for layout in LAYOUTS[r % 3:] + LAYOUTS[:r % 3]:      # each layout first in a third of the rounds
            t0 = time.perf_counter()
            experts[layout][layer](x.copy(), route)
            if r >= 3:
                times[layout].append(time.perf_counter() - t0)
    rows = []
    for layout in LAYOUTS:
        median, best = statistics.median(times[layout]), min(times[layout])
        row = {"layout": layout, "threads": kernels.threads, "experts_call_us": round(median * 1e6, 1),
               "experts_GBps": round(k * expert_bytes / median / 1e9, 2),
               "best_us": round(best * 1e6, 1), "best_GBps": round(k * expert_bytes / best / 1e9, 2)}
        if layout in built:
            row.update(image_MB=round(image_bytes / 1e6, 2), build_s=round(built[layout], 3),
                       build_GBps=round(image_bytes / built[layout] / 1e9, 2))
        print(row, flush=True)
        rows.append(row)
    for layout_images in images.values():
        for buffer, _ in layout_images.values():
            buffer.free()
    if args.out:
        from bench.report import write_results
        from kestrel_stream.cli.bench import environment
        write_results("expert-images", environment(), rows, ["layout", "threads", "experts_call_us", "experts_GBps",
                                                             "best_us", "best_GBps", "image_MB", "build_s",
                                                             "build_GBps"],
                      f"{L} layers x {E} experts of {H} -> {I}, {k} a one-token call, the layouts' calls alternated "
                      f"over {args.calls} rounds; images built by run/device/expert_ring.layer_images.",
                      out_dir=args.out)
    return rows


if __name__ == "__main__":
    main()
