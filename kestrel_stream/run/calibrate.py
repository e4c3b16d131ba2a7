"""``kestrel-stream calibrate``: measure this machine's DeviceProfile once and cache it.

Host figures come from what the host backend runs: the native quantized kernels (numpy's float32 BLAS
where they are unavailable or KESTREL_HOST_KERNELS=numpy); GPU figures from kestrel_stream.cuda.calibrate.
The host memory pool (measure_pool): the host kernels' GB/s and pinned H2D's, each while the other runs,
since both read host DRAM (LinkCopies keeps the link busy beside a host measurement; benches reuse it).  The
profile is cached per device + driver (scheduler.profile), so later runs and the lazy first use of a GPU read it
instead of measuring again.  One concern, one file: measuring the profile on this machine (its GPU figures
through kestrel_stream.cuda.calibrate) and caching it.
"""
from __future__ import annotations

import sys
import statistics
import threading
import time

import numpy as np

from scheduler.profile import DeviceProfile, default_cache_dir, load_profile, save_profile

from kestrel_stream.model.quant import GROUP


def measure_host(repeats: int = 5) -> dict:
    """host_gflops (M=32 float32 matmul) and host_weight_GBps (M=1, in Q8_0 bytes of the weight per second)."""
    rng = np.random.default_rng(0)
    rows, cols = 4096, 2048
    weight = rng.standard_normal((rows, cols), dtype=np.float32)
    q8_bytes = rows * cols * (GROUP + 2) / GROUP

    def best_seconds(x) -> float:
        x @ weight.T
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            x @ weight.T
            times.append(time.perf_counter() - start)
        return min(times)

    batch = rng.standard_normal((32, cols), dtype=np.float32)
    gflops = 2 * 32 * rows * cols / best_seconds(batch) / 1e9
    weight_GBps = q8_bytes / best_seconds(batch[:1]) / 1e9
    return {"host_gflops": round(gflops, 2), "host_weight_GBps": round(weight_GBps, 2)}


POOL_WEIGHT_BYTES = 512 << 20    # host kernels' weights per pass: far beyond any last-level cache
POOL_COPY_BYTES = 256 << 20      # one pinned H2D


def _pool_weights(total_bytes: int) -> list:
    """Q8_0 weights of [8192, 4096] (34 MB each) adding up to about `total_bytes`, random values."""
    rng = np.random.default_rng(1)
    rows, cols = 8192, 4096
    count = max(1, total_bytes // (rows * cols * 34 // 32))
    qs = rng.integers(-127, 128, (rows, cols), dtype=np.int8)
    scales = np.full((rows, cols // GROUP), 0.01, np.float16)
    return [(np.copy(qs), np.copy(scales)) for _ in range(count)]      # distinct memory, one pattern


FORMAT_SCALE_BYTES = {"Q4_K": (0, 2), "Q6_K": (208,)}    # where a block's fp16 scales are (d, dmin / d)
# step sizes at which each format's kernel rate is measured: 5 and 6 beside VNNI's switch from dot products to
# tokens in lanes at 6, where its Q8_0 rate turns (on AMX tiles it is flat from 2 to 16 tokens)
KERNEL_TOKENS = (1, 2, 4, 5, 6, 8, 16, 32)


def _format_weights(kernels, fmt: str, total_bytes: int) -> tuple[list, int]:
    """(prepared [8192, 4096] weights of `fmt` adding up to about `total_bytes`, their bytes): values do not
    matter (Q8_0: random; Q4_K / Q6_K: every byte 0x11, each block's fp16 scales small)."""
    from kestrel_stream.native.kernels import FORMATS
    if fmt == "Q8_0":
        weights = [kernels.prepare_q8_0(qs, scales) for qs, scales in _pool_weights(total_bytes)]
        return weights, sum(w.rows * w.cols * 34 // 32 for w in weights)
    _, elements, block_bytes = FORMATS[fmt]
    rows, cols = 8192, 4096
    row_bytes = cols // elements * block_bytes
    count = max(1, total_bytes // (rows * row_bytes))
    blocks = np.full((count * rows, row_bytes), 0x11, np.uint8)
    per_block = blocks.reshape(count * rows, cols // elements, block_bytes)
    for offset in FORMAT_SCALE_BYTES[fmt]:
        per_block[:, :, offset:offset + 2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    return [kernels.prepare_blocks(fmt, blocks[i * rows:(i + 1) * rows], cols) for i in range(count)], blocks.nbytes


def _format_token_rates(kernels, total_bytes: int = POOL_WEIGHT_BYTES // 2) -> dict:
    """Per block format, [[tokens, GB/s]] of the host kernels over weights far larger than the caches at each of
    KERNEL_TOKENS tokens a call (the weight's bytes over the best of a few passes' time): one token reads
    memory; a few more turn each format's kernel compute-bound at its own pace (the placement prices a
    step of M tokens by it, scheduler/step_sim._kernel_us)."""
    rates = {}
    for fmt in ("Q8_0", *FORMAT_SCALE_BYTES):
        weights, nbytes = _format_weights(kernels, fmt, total_bytes)
        cols = weights[0].cols
        curve = []
        for tokens in KERNEL_TOKENS:
            x = np.ones((tokens, cols), np.float32)
            out = np.empty((tokens, weights[0].rows), np.float32)
            kernels.matmul(x, weights[0], out)
            best = float("inf")
            for _ in range(3 if tokens == 1 else 2):
                start = time.perf_counter()
                for w in weights:
                    kernels.matmul(x, w, out)
                best = min(best, time.perf_counter() - start)
            curve.append([tokens, round(nbytes / best / 1e9, 2)])
        rates[fmt] = curve
        del weights
    return rates


HANDOFF_GAP_US = 250     # a device segment between two host segments, as the host waits on it


def call_after_gap_us(kernels, weight, calls: int = 200, gap_us: float = HANDOFF_GAP_US) -> float:
    """Median µs of one batch-1 native matmul on `weight`, each after `gap_us` of the caller busy (as in a
    stream sync); gap_us=0: back to back."""
    x = np.ones((1, weight.cols), np.float32)
    out = np.empty((1, weight.rows), np.float32)
    kernels.matmul(x, weight, out)
    samples = []
    for _ in range(calls):
        until = time.perf_counter() + gap_us * 1e-6
        while time.perf_counter() < until:
            pass
        start = time.perf_counter()
        kernels.matmul(x, weight, out)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def _host_call_us(kernels, options) -> float:
    """One small native call as a mixed step's host segment pays it: after a gap of a device segment's length,
    with the pool's spin a mixed step sets."""
    from kestrel_stream.run.host.pool_spin import LIBRARY_SPIN_US, MIXED_SPIN_US, mixed_spin
    spins = mixed_spin(options)
    if spins:
        kernels.set_spin_us(MIXED_SPIN_US)
    small = kernels.prepare_q8_0(*[np.ascontiguousarray(a[:64]) for a in _pool_weights(1)[0]])
    call_us = call_after_gap_us(kernels, small)
    if spins:
        kernels.set_spin_us(LIBRARY_SPIN_US)
    return call_us


class LinkCopies:
    """Pinned H2D copies of `nbytes` kept queued on a stream of their own, from a thread that waits for each four
    by polling an event (not by spinning on the GPU): the link busy while the host measures something."""

    def __init__(self, nbytes: int, name: str = "calibrate h2d"):
        from kestrel_stream.cuda import driver
        self.nbytes, self.device, self.stream = nbytes, driver.Device(0), driver.Stream(name)
        self.pinned = driver.PinnedBuffer(nbytes)
        self.pinned.bytes[:] = 1
        self.arena = driver.Arena(nbytes)
        self.target = self.arena.alloc(nbytes)

    def run(self, stop) -> float:
        """Copies until stop(); their GB/s."""
        from kestrel_stream.cuda import driver
        self.device.make_current()
        event = driver.Event()
        start, count = time.perf_counter(), 0
        while not stop():
            for _ in range(4):
                driver.h2d_async(self.target, self.pinned, self.nbytes, self.stream)
            event.record(self.stream)
            while not event.query():
                time.sleep(0.0005)
            count += 4
        return count * self.nbytes / (time.perf_counter() - start) / 1e9

    def beside(self, measure) -> tuple:
        """(measure()'s result with the copies running on a thread of their own, the copies' GB/s meanwhile)."""
        stopping, link = threading.Event(), []
        copier = threading.Thread(target=lambda: link.append(self.run(stopping.is_set)))
        copier.start()
        time.sleep(0.05)
        try:
            result = measure()
        finally:
            stopping.set()
            copier.join()
        return result, link[0]

    def close(self) -> None:
        self.stream.synchronize()
        self.pinned.free()
        self.arena.release()


def measure_pool(options=None, seconds: float = 0.6) -> dict:
    """host_weight_GBps and h2d_GBps alone, and host_joint_GBps / h2d_joint_GBps while the other runs, plus
    host_call_us (one small native call), host_gflops (32 tokens at once) and each format's kernel rate by
    tokens (host_format_GBps at one, host_format_tokens_GBps).  The host kernels (options' threads) loop over
    weights far larger than the caches on this thread; a second thread keeps pinned H2D copies queued
    (LinkCopies)."""
    from kestrel_stream import native
    kernels = native.load(options, threads=getattr(options, "host_threads", None))
    weights = [kernels.prepare_q8_0(qs, scales) for qs, scales in _pool_weights(POOL_WEIGHT_BYTES)]
    nbytes = sum(w.rows * w.cols * 34 // 32 for w in weights)
    x = np.ones((1, weights[0].cols), np.float32)
    out = np.empty((1, weights[0].rows), np.float32)

    def host_pass() -> None:
        for w in weights:
            kernels.matmul(x, w, out)

    link = LinkCopies(POOL_COPY_BYTES)

    def host_for(duration: float) -> float:
        host_pass()                                   # warm: pool started, pages touched
        start, passes = time.perf_counter(), 0
        while time.perf_counter() - start < duration:
            host_pass()
            passes += 1
        return passes * nbytes / (time.perf_counter() - start) / 1e9

    host_alone = host_for(seconds)
    end = time.perf_counter() + seconds
    link_alone = link.run(lambda: time.perf_counter() > end)
    host_joint, link_joint = link.beside(lambda: host_for(seconds))      # both at once
    x32 = np.ones((32, weights[0].cols), np.float32)     # steps of many tokens: compute-bound
    kernels.matmul(x32, weights[0])
    start = time.perf_counter()
    for w in weights:
        kernels.matmul(x32, w)
    gflops = 2 * 32 * sum(w.rows * w.cols for w in weights) / (time.perf_counter() - start) / 1e9
    call_us = _host_call_us(kernels, options)
    token_rates = _format_token_rates(kernels)
    format_rates = {fmt: curve[0][1] for fmt, curve in token_rates.items() if fmt != "Q8_0"}
    format_rates["Q8_0"] = round(host_alone, 2)
    link.close()
    return {"host_weight_GBps": round(host_alone, 2), "h2d_GBps": round(link_alone, 2),
            "host_joint_GBps": round(min(host_joint, host_alone), 2),
            "h2d_joint_GBps": round(min(link_joint, link_alone), 2), "host_call_us": round(call_us, 2),
            "host_gflops": round(gflops, 1), "host_format_GBps": format_rates,
            "host_format_tokens_GBps": token_rates, "host_kernels": f"{kernels.path.name}:{kernels.isa}"}


# a prompt chunk through a routed layer of Qwen3-30B-A3B's shape, every expert on the device (Q8_0)
EXPERT_SHAPE = {"hidden": 2048, "intermediate": 768, "experts": 128, "chosen": 8, "tokens": 512}


def measure_device_experts(options=None, repeats: int = 5, shape: dict = EXPERT_SHAPE) -> dict:
    """gpu_expert_gflops: the device expert kernels' FLOP/s (moe_route, gate_up with SiLU·mul, down, combine,
    as moe_ops.py launches them) over `shape`'s routed layer with random Q8_0 experts, timed with events."""
    from kestrel_stream.cuda import driver
    from kestrel_stream.cuda.kernels import KernelSet
    from kestrel_stream.cuda.moe_kernels import (PoolPart, combine_launch, experts_launch, group_ints,
                                                 route_launch, route_tickets)
    from kestrel_stream.run.device.expert_pool import _align, part_bytes
    H, I, E, k, T = (shape[n] for n in ("hidden", "intermediate", "experts", "chosen", "tokens"))
    device = driver.Device(options.device_ordinal if options is not None else 0)
    kernels, stream = KernelSet(device, options), driver.Stream("calibrate experts")
    strides = [_align(b) for b in part_bytes("Q8_0", 2 * I, H) + part_bytes("Q8_0", H, I)]
    pool_bytes = E * sum(strides)
    floats = E * H + T * (3 * H + 2 * k + 2) + T * k * (I + H) + H
    arena = driver.Arena(pool_bytes + 4 * floats + 4 * (group_ints(E, T, k) + route_tickets(T) + 2 * E) + (1 << 20))
    rng = np.random.default_rng(2)
    try:
        pool = arena.alloc(pool_bytes)
        offsets = np.cumsum([0] + [E * s for s in strides]).tolist()
        for region, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):     # qs, meta, qs, meta
            data = (np.full((hi - lo) // 2, 0.01, np.float16) if region % 2 else
                    np.resize(rng.integers(-8, 8, 1 << 20, dtype=np.int8), hi - lo))
            driver.h2d_sync(pool + lo, data)
        gate_up = PoolPart(pool + offsets[0], pool + offsets[1], strides[0], strides[1])
        down = PoolPart(pool + offsets[2], pool + offsets[3], strides[2], strides[3])

        def upload(array) -> int:
            ptr = arena.alloc(array.nbytes)
            driver.h2d_sync(ptr, array)
            return ptr
        router = upload((rng.standard_normal((E, H)) * 0.02).astype(np.float32))
        xn = upload(rng.standard_normal((T, H)).astype(np.float32))
        inv_rms, normw = upload(np.ones(T, np.float32)), upload(np.ones(H, np.float32))
        slot_of, counts = upload(np.arange(E, dtype=np.int32)), upload(np.zeros(E, np.uint32))
        tickets = upload(np.zeros(route_tickets(T), np.uint32))
        route, groups = arena.alloc(4 * T * 2 * k), arena.alloc(4 * group_ints(E, T, k))
        act, expert_out = arena.alloc(4 * T * k * I), arena.alloc(4 * T * k * H)
        x, xn_out, inv_out = upload(np.zeros((T, H), np.float32)), arena.alloc(4 * T * H), arena.alloc(4 * T)
        table = dict(slot_of=slot_of, groups=groups, experts=E, chosen=k, tokens=T)
        launches = [
            route_launch(kernels, xn=xn, inv_rms=inv_rms, router=router, route=route, counts=counts,
                         slot_of=slot_of, groups=groups, tickets=tickets, hidden=H, experts=E, chosen=k,
                         softmax_first=False, normalize=True, tokens=T),
            experts_launch(kernels, "Q8_0", gate_up, x=xn, ldx=H, gather=True, inv_rms=inv_rms, y=act, ldy=I,
                           rows=2 * I, cols=H, silu=True, **table),
            experts_launch(kernels, "Q8_0", down, x=act, ldx=I, gather=False, inv_rms=0, y=expert_out, ldy=H,
                           rows=H, cols=I, silu=False, **table),
            combine_launch(kernels, route=route, expert_out=expert_out, res=x, y=x, normw_out=normw, xn_out=xn_out,
                           inv_rms_out=inv_out, eps=1e-6, hidden=H, **table)]
        for launch in launches:                   # warm-up: module loads, first-touch
            launch.enqueue(stream)
        begin, end = driver.Event(timing=True), driver.Event(timing=True)
        begin.record(stream)
        for _ in range(repeats):
            for launch in launches:
                launch.enqueue(stream)
        end.record(stream)
        end.synchronize()
        us = max(end.elapsed_ms(begin) * 1e3 / repeats, 1e-3)
    finally:
        stream.synchronize()
        arena.release()
    flops = 2.0 * T * E * H + T * k * (2.0 * 2 * I * H + 2.0 * H * I)
    return {"gpu_expert_gflops": round(flops / (us * 1e3), 1)}


def host_kernels_name(options=None) -> str | None:
    """The host kernels these options run, as `library file name:ISA` (None: no native kernels here): a
    profile's host rates are of one library at one ISA."""
    from kestrel_stream import native
    try:
        kernels = native.load(options)
    except native.NativeUnavailable:
        return None
    return f"{kernels.path.name}:{kernels.isa}"


def calibrate(force: bool = False, cache_dir=None, options=None) -> DeviceProfile:
    """The cached profile of GPU 0 (measured now when missing or when ``force``), kept in `cache_dir`
    (default: the profiles directory under the options' cache_dir, KESTREL_CACHE_DIR)."""
    if options is None:
        from kestrel_stream.options import Options
        options = Options.from_env()
    if cache_dir is None:
        cache_dir = default_cache_dir(options.cache_root)
    from kestrel_stream.cuda import driver
    from kestrel_stream.cuda.calibrate import measure_gpu
    from cuda.bindings import driver as cu

    device = driver.Device(0)
    version = str(driver.check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
    if not force:
        cached = load_profile(device.name, version, cache_dir)
        # a profile from before the pool figures, the expert kernels' rate or the kernels' rates by tokens:
        # measured again
        measured = cached is not None and cached.host_joint_GBps and cached.gpu_expert_gflops
        if measured and cached.host_format_tokens_GBps and cached.host_kernels == host_kernels_name(options):
            return cached
    figures = dict(measure_gpu(options=options), **measure_host())
    try:
        figures.update(measure_device_experts(options))
    except Exception as e:                      # noqa: BLE001  (the expert kernels' rate stays gpu_gflops)
        print(f"kestrel-stream: calibrate: device expert kernels not measured ({e})", file=sys.stderr)
    try:
        figures.update(measure_pool(options))
    except Exception as e:                      # noqa: BLE001  (no native kernels: the pool stays unmeasured)
        print(f"kestrel-stream: calibrate: host memory pool not measured ({e})", file=sys.stderr)
    profile = DeviceProfile(**figures)
    save_profile(profile, cache_dir)
    return profile
