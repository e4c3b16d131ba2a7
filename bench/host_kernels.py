"""Native host kernels: effective bandwidth of quantized weight bytes on qwen3-1.7b-shaped layers.

    python3 -m bench.host_kernels [--types Q8_0,Q4_0,Q4_K,Q6_K] [--tokens 1,4,16,64] [--threads 1,2]
                                  [--layers 4] [--repeats 7] [--kernels-only] [--name host-kernels-2core-vm] [--out DIR]

One "layer" is the four projections of a qwen3-1.7b layer (qkv 4096x2048, o 2048x2048, gate_up
12288x2048, down 2048x6144), each a quantized matmul of `tokens` rows; `--layers` distinct copies
are cycled so the weights come from memory, not the last-level cache.  GB/s = the layer's quantized
bytes / its time (best of the repeats, wall clock; the median beside it).  Beside them: the
machine's plain read bandwidth (numpy's sum over a large array, and the library's C read loop) and
numpy's float32 matmul of the same layer's dequantized weights, counted in Q8_0 bytes (what the
current host backend reads 4 bytes per weight to compute).  And per type the kernels' error against
float32 `x @ dequant(W).T` on the o projection (2048x2048, 16 tokens): relative RMS with Gaussian
activations and with 1 % of the channels 20x outliers.  --kernels-only: the quantized layers' rows alone (an
A/B of two trees runs it in each).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from bench.synthetic import random_blocks
from kestrel_stream import native
from kestrel_stream.cli.bench import environment
from kestrel_stream.native.build import cpu_signature

from .report import write_results

SHAPES = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144)}


def make_layer(rng, fmt: str) -> list:
    """The four projections in `fmt`: (rows, cols, qs/blocks, scales or None)."""
    layer = []
    for rows, cols in SHAPES.values():
        if fmt == "Q8_0":
            layer.append((rows, cols, rng.integers(-127, 128, (rows, cols), dtype=np.int8),
                          np.full((rows, cols // 32), 0.01, np.float16)))
        else:
            layer.append((rows, cols, random_blocks(rng, fmt, rows, cols, 0.02), None))
    return layer


def layer_bytes(layer) -> int:
    return sum(w.nbytes + (0 if s is None else s.nbytes) for _, _, w, s in layer)


def accuracy(kernels, fmt: str, projection, rng) -> dict:
    """The relative RMS error of the kernels against float32 on one projection, 16 Gaussian tokens, and
    the same with 1 % of the channels 20x (outliers)."""
    from kestrel_stream.model.quant4 import BlockTensor
    rows, cols, w, scales = projection
    if scales is not None:
        dense = w.astype(np.float32) * np.repeat(scales.astype(np.float32), 32, axis=1)
        prepared = kernels.prepare_q8_0(w, scales)
    else:
        dense = BlockTensor(fmt, w, cols).dequantize()
        prepared = kernels.prepare_blocks(fmt, w, cols)
    row = {"what": f"{fmt} {kernels.isa} vs float32", "threads": kernels.threads, "tokens": 16}
    for key, scale in (("rel_rms", 1), ("rel_rms_outliers", 20)):
        x = rng.standard_normal((16, cols)).astype(np.float32)
        x[:, rng.choice(cols, cols // 100, replace=False)] *= scale
        ref = x @ dense.T
        row[key] = float(f"{np.sqrt(np.square(kernels.matmul(x, prepared) - ref).sum() / np.square(ref).sum()):.2e}")
    return row


def time_calls(run, count: int, repeats: int) -> tuple[float, float, float]:
    """(best, median) wall seconds per call of run(i) for i over `count` layers, after one warm pass, and
    the median CPU seconds of the process per call (all threads; spinning included)."""
    for i in range(count):
        run(i)
    times, cpu = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        for i in range(count):
            run(i)
        times.append((time.perf_counter() - start) / count)
        cpu.append((time.process_time() - cpu_start) / count)
    return min(times), statistics.median(times), statistics.median(cpu)


def memory_rows(args, kernels, threads, add) -> None:
    """The machine's plain read bandwidth: 1 GiB of uint64 words summed by the library's C loop and by numpy."""
    from threadpoolctl import threadpool_limits
    words = np.ones(1 << 27, np.uint64)
    for n in threads:
        best, median, cpu = time_calls(lambda i: kernels.read_sum(words, n), 1, args.repeats)
        add({"what": "memory read (C loop)", "threads": n, "tokens": "", "GB_s": round(words.nbytes / best / 1e9, 1),
             "GB_s_median": round(words.nbytes / median / 1e9, 1), "ms": round(best * 1e3, 2), "cpu_ms": round(cpu * 1e3, 2)})
    for n in threads:
        with threadpool_limits(n):
            best, median, cpu = time_calls(lambda i: words.sum(), 1, args.repeats)
        add({"what": "memory read (numpy sum)", "threads": f"{n} (numpy: 1)", "tokens": "",
             "GB_s": round(words.nbytes / best / 1e9, 1), "GB_s_median": round(words.nbytes / median / 1e9, 1),
             "ms": round(best * 1e3, 2), "cpu_ms": round(cpu * 1e3, 2)})


def reference_rows(args, kernels, rng, threads, tokens, add) -> None:
    """The rows beside the quantized layers: numpy float32 matmuls of the same shapes, and a decode step's float
    ops and fused projections against run/host.py's numpy."""
    from threadpoolctl import threadpool_limits
    # numpy float32 matmul of dequantized weights (the host backend today), in Q8_0 bytes per second
    q8_bytes = sum(r * c + 2 * r * c // 32 for r, c in SHAPES.values())
    dense = [[rng.standard_normal((r, c), dtype=np.float32) for r, c in SHAPES.values()] for _ in range(2)]
    f32_bytes = sum(w.nbytes for w in dense[0])
    for t in tokens:
        x = {c: rng.standard_normal((t, c)).astype(np.float32) for _, c in SHAPES.values()}
        for n in threads:
            with threadpool_limits(n):
                best, median, cpu = time_calls(lambda i: [x[w.shape[1]] @ w.T for w in dense[i]], len(dense), args.repeats)
            add({"what": "numpy float32 (as Q8_0 bytes)", "threads": n, "tokens": t,
                 "GB_s": round(q8_bytes / best / 1e9, 1), "GB_s_median": round(q8_bytes / median / 1e9, 1),
                 "ms": round(best * 1e3, 2), "cpu_ms": round(cpu * 1e3, 2),
                 "layer_MB": f"{f32_bytes / 1e6:.0f} (float32)"})

    # the float ops at qwen3-1.7b's shapes, one token, against run/host.py's numpy
    from kestrel_stream.run import host
    hidden, heads, n_kv, d, inter = 2048, 16, 8, 128, 6144
    x1 = rng.standard_normal((1, hidden)).astype(np.float32)
    norm_w = rng.standard_normal(hidden).astype(np.float32)
    gu = rng.standard_normal((1, 2 * inter)).astype(np.float32)
    qk = rng.standard_normal((1, heads + n_kv, d)).astype(np.float32)
    cos, sin = host.rope_tables(np.array([300]), d, 1e6)
    ops = [("rmsnorm [1, 2048]", lambda k: k.rmsnorm(x1, norm_w, 1e-6), lambda: host.rmsnorm(x1, norm_w, 1e-6)),
           ("silu_mul [1, 6144]", lambda k: k.silu_mul(gu[:, :inter], gu[:, inter:]),
            lambda: host.silu_mul(gu[:, :inter], gu[:, inter:])),
           ("rope [1, 24, 128]", lambda k: k.rope(qk, cos, sin), lambda: host.apply_rope(qk, cos, sin))]
    # a decode step's projections with their prologue and epilogue in one call (kernels.linear), Q8_0
    w_qkv = rng.integers(-127, 128, (4096, hidden), dtype=np.int8)
    s_qkv = np.full((4096, hidden // 32), 0.01, np.float16)
    w_gu = rng.integers(-127, 128, (2 * inter, hidden), dtype=np.int8)
    s_gu = np.full((2 * inter, hidden // 32), 0.01, np.float16)
    bound = {}          # (kernels, name) -> the Linear, bound on its first call

    def linear(k, name, w, scales, glu):
        if (k, name) not in bound:
            bound[k, name] = k.linear(k.prepare_q8_0(w, scales), norm_w, 1e-6, glu)
        return bound[k, name](x1)
    ops += [("linear qkv 4096x2048 + rmsnorm prologue, Q8_0", lambda k: linear(k, "qkv", w_qkv, s_qkv, False), None),
            ("linear gate_up 12288x2048 + rmsnorm, SiLU·mul, Q8_0", lambda k: linear(k, "gu", w_gu, s_gu, True), None)]
    # rope as the step runs it: bias-free qkv, q/k norm, rotation, the cache write (kernels.qkv_rope)
    qkv1 = rng.standard_normal((1, (heads + 2 * n_kv) * d)).astype(np.float32)
    qk_norm = rng.standard_normal((heads + n_kv, d)).astype(np.float32)
    rot_cos, rot_sin, _ = host.rope_rotation(cos, sin)
    q_out, cache = np.empty((1, heads, d), np.float32), np.zeros((2, 4, n_kv, d), np.float32)
    ops.append(("qkv_rope [1, 32 x 128]: q/k norm, rotation, cache write",
                lambda k: k.qkv_rope(qkv1, heads, n_kv, None, qk_norm, 1e-6, rot_cos, rot_sin, q_out, cache[0, 1:2],
                                     cache[1, 1:2]), None))
    for context in (512, 2048):
        q = rng.standard_normal((1, heads, d)).astype(np.float32)
        kv = [rng.standard_normal((context, n_kv, d)).astype(np.float32) for _ in range(2)]
        kv16 = [a.astype(np.float16) for a in kv]
        last = context - 1
        ops += [(f"attention 1 query, {context} keys, f32 KV", lambda k, q=q, kv=kv, p=last: k.attention(q, kv[0], kv[1], p),
                 lambda q=q, kv=kv, p=last: host.attention(q, kv[0], kv[1], p)),
                (f"attention 1 query, {context} keys, f16 KV",
                 lambda k, q=q, kv=kv16, p=last: k.attention(q, kv[0], kv[1], p), None)]
        for n_q in (4, 16, 64):         # a prompt's chunk (the native side: the tiled kernel)
            qn = rng.standard_normal((n_q, heads, d)).astype(np.float32)
            ops.append((f"attention {n_q} queries, {context} keys, f32 KV",
                        lambda k, q=qn, kv=kv, p=context - n_q: k.attention(q, kv[0], kv[1], p),
                        lambda q=qn, kv=kv, p=context - n_q: host.attention(q, kv[0], kv[1], p)))
    for name, native_op, numpy_op in ops:
        for n in threads:
            k = native.HostKernels(kernels.path, isa=kernels.isa, threads=n)
            best, median, cpu = time_calls(lambda i: native_op(k), 20, args.repeats)
            row = {"what": f"op: {name}", "threads": n, "tokens": 1, "us": round(best * 1e6, 1),
                   "us_median": round(median * 1e6, 1)}
            if numpy_op is not None:
                with threadpool_limits(n):
                    np_best, _, _ = time_calls(lambda i: numpy_op(), 20, args.repeats)
                row["numpy_us"] = round(np_best * 1e6, 1)
            add(row)



def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--types", default="Q8_0,Q4_0,Q4_K,Q6_K")
    parser.add_argument("--tokens", default="1,4,16,64")
    parser.add_argument("--threads", default=None, help="comma list (default: 1 and the physical cores)")
    parser.add_argument("--layers", type=int, default=4, help="distinct layers cycled (4 Q8_0 layers: 212 MB)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--isa", default=None, help="the widest ISA to use (default: the CPU's widest)")
    parser.add_argument("--spin-us", type=int, default=None,
                        help="how long an idle worker polls before it sleeps (default: the library's, 100)")
    parser.add_argument("--kernels-only", action="store_true", help="only the quantized layers' rows")
    parser.add_argument("--name", default="host-kernels")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    load = os.getloadavg()
    kernels = native.load(isa=args.isa, spin_us=args.spin_us)
    cores = native.physical_cores()
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, cores})
    tokens = [int(t) for t in args.tokens.split(",")]
    rng = np.random.default_rng(0)
    rows = []

    def add(row):
        print(row, flush=True)
        rows.append(row)

    if not args.kernels_only:
        memory_rows(args, kernels, threads, add)

    for fmt in args.types.split(","):
        layers = [make_layer(rng, fmt) for _ in range(args.layers)]
        nbytes = layer_bytes(layers[0])
        if not args.kernels_only:
            add(accuracy(kernels, fmt, layers[0][1], rng))
        for t in tokens:
            x = {cols: rng.standard_normal((t, cols)).astype(np.float32) for _, cols in SHAPES.values()}
            outs = {rows_: np.empty((t, rows_), np.float32) for rows_, _ in SHAPES.values()}
            for n in threads:
                k = native.HostKernels(kernels.path, isa=kernels.isa, threads=n)

                prepared = [[k.prepare_q8_0(w, s) if s is not None else k.prepare_blocks(fmt, w, c)
                             for r, c, w, s in layer] for layer in layers]

                def run(i):
                    for w in prepared[i]:
                        k.matmul(x[w.cols], w, out=outs[w.rows])
                best, median, cpu = time_calls(run, len(layers), args.repeats)
                add({"what": f"{fmt} {k.isa}", "threads": n, "tokens": t, "GB_s": round(nbytes / best / 1e9, 1),
                     "GB_s_median": round(nbytes / median / 1e9, 1), "ms": round(best * 1e3, 2),
                     "cpu_ms": round(cpu * 1e3, 2), "layer_MB": round(nbytes / 1e6, 1)})
        del layers

    if not args.kernels_only:
        reference_rows(args, kernels, rng, threads, tokens, add)

    env = environment()
    signature = cpu_signature()
    model, _, flags = signature.partition("; ")
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "amx_int8")
    env["machine"] = (f"{model}, {cores} physical cores, flags: "
                      f"{' '.join(f for f in flags.split() if f in wanted)}")
    notes = ("One layer = qkv 4096x2048 + o 2048x2048 + gate_up 12288x2048 + down 2048x6144 (qwen3-1.7b), "
             f"{args.layers} distinct layers cycled; GB/s = quantized bytes of the layer / best time "
             f"(median beside); tokens = rows of activations per matmul. Library: {Path(kernels.path).name}, "
             f"ISA {kernels.isa} (CPU has: {', '.join(kernels.supported)}). numpy float32 rows count the "
             "Q8_0 bytes of the same layer (the float32 weights are 4 bytes per value). "
             f"Load average before the run: {load[0]:.1f} (1 min), {load[1]:.1f} (5 min) on a machine of "
             f"{os.cpu_count()} CPUs: other processes shared the cores. cpu_ms: the process's CPU time per "
             "call, all threads (a worker polling for work counts). rel_rms: the kernels against float32 "
             "x @ dequant(W).T on the o projection, 16 tokens (outliers: 1 % of the channels 20x). Idle workers poll for "
             f"{args.spin_us if args.spin_us is not None else 100} us before sleeping.")
    path = write_results(args.name, env, rows, ["what", "threads", "tokens", "GB_s", "GB_s_median", "ms", "cpu_ms", "layer_MB",
                                                    "us", "us_median", "numpy_us", "rel_rms", "rel_rms_outliers"],
                         notes=notes, out_dir=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
