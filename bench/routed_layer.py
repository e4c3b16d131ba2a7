"""One routed (mixture-of-experts) layer's experts op on the native host kernels, beside a dense Q8_0
projection pair of the same bytes: where a decode step's routed host time goes.

    python3 -m bench.routed_layer [--tokens 1,2,4,7] [--threads N] [--experts 128 --hidden 2048 --inter 768
                                  --choices 8] [--calls 200] [--dense-mb 256] [--out DIR]

Qwen3-30B-A3B's routed layer by default (128 experts of 2048 -> 768, 8 a token), random Q8_0 weights
(~640 MB, so the chosen experts come from memory, not the last-level cache: where that cache is larger,
raise --experts and --dense-mb well past it).  Per token count:

- experts: native/routed.Experts over random choices (distinct experts per token, new ones every call),
  its Python wrapper included, and the same C call through ctypes alone (ks_experts);
- dense: one gate|up (SiLU·mul) and one down Linear of the bytes the experts read ([T*k*2I... for T = 1:
  k experts' gate|up rows as one [k*2I, H] weight, their down as one [H, k*I]), several copies cycled;
- parts: the experts op with none of the chosen experts on this side (its fixed part: norm, routing sort,
  sums, the call from Python), rmsnorm and one row's activation quantization as their own calls (what the
  experts op does on the calling thread), a call with no work to speak of.

GB/s = the expert bytes the call read / its median time (best: its fastest call, where other work shares
the CPUs).  Runs on any tree whose native/routed.py has
`Experts` (bench.host_offload's --base trees): run it as a file with PYTHONPATH set to the tree.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kestrel_stream import native
from kestrel_stream.native.routed import Experts
from kestrel_stream.options import Options


def median_us(fn, calls: int) -> float:
    return timed_us(fn, calls)[0]


def timed_us(fn, calls: int) -> tuple[float, float]:
    """(median, best) µs of `calls` calls after three warm-ups: the best where other work shares the CPUs."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6, min(times) * 1e6


def q8(rng, rows: int, cols: int):
    return (rng.integers(-127, 128, (rows, cols), dtype=np.int8),
            rng.uniform(0.001, 0.002, (rows, cols // 32)).astype(np.float16))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1,2,4,7")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--choices", type=int, default=8)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--dense-mb", type=int, default=256,
                        help="the dense pairs' cycled footprint (larger than the last-level cache)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    E, H, I, k = args.experts, args.hidden, args.inter, args.choices
    kernels = native.load(Options.from_env({}), threads=args.threads)
    rng = np.random.default_rng(0)
    gu_qs, gu_sc = q8(rng, E * 2 * I, H)
    dn_qs, dn_sc = q8(rng, E * H, I)
    norm = np.ones(H, np.float32)
    gate_ups = [kernels.linear(kernels.prepare_q8_0(gu_qs[e * 2 * I:(e + 1) * 2 * I], gu_sc[e * 2 * I:(e + 1) * 2 * I]),
                               None, 0.0, glu=True) for e in range(E)]
    downs = [kernels.linear(kernels.prepare_q8_0(dn_qs[e * H:(e + 1) * H], dn_sc[e * H:(e + 1) * H])) for e in range(E)]
    experts = Experts(kernels, gate_ups, downs, norm, 1e-6, k)
    # expert 0 alone on this side, the route to others: the op's fixed part (norm, sort, sums, the call)
    lone = Experts(kernels, gate_ups[:1] + [None] * (E - 1), downs[:1] + [None] * (E - 1), norm, 1e-6, k)
    expert_bytes = (2 * I * H + H * I) * 34 // 32
    copies = max(2, -(-args.dense_mb * 2**20 // (k * expert_bytes)))
    dense = []
    for c in range(copies):
        g_qs, g_sc = gu_qs[c * k * 2 * I % (E * 2 * I - k * 2 * I):][:k * 2 * I], gu_sc[c * k * 2 * I % (E * 2 * I - k * 2 * I):][:k * 2 * I]
        d_qs, d_sc = q8(rng, H, k * I)
        dense.append((kernels.linear(kernels.prepare_q8_0(np.ascontiguousarray(g_qs), np.ascontiguousarray(g_sc)), None, 0.0, glu=True),
                      kernels.linear(kernels.prepare_q8_0(d_qs, d_sc))))
    print(f"threads {kernels.threads} isa {kernels.isa}; {E} experts of {H} -> {I}, {k} a token; "
          f"{expert_bytes / 1e6:.2f} MB an expert; dense pair {copies} copies", flush=True)
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x = rng.standard_normal((T, H)).astype(np.float32)
        routes = []
        for _ in range(64):
            ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.float32)
            routes.append(np.concatenate([ids, np.full((T, k), 1.0 / k, np.float32)], axis=1))
        used = float(np.mean([len(np.unique(r[:, :k])) for r in routes]))
        state = {"i": 0}

        def call_experts():
            state["i"] += 1
            experts(x.copy(), routes[state["i"] % len(routes)])

        raw_x = x.copy()

        def call_raw():
            state["i"] += 1
            r = routes[state["i"] % len(routes)]
            experts._call(experts.spec_address, raw_x.ctypes.data, H, T, r.ctypes.data, 2 * k, None, H)

        def call_dense():
            state["i"] += 1
            g, d = dense[state["i"] % copies]
            d(g(x))
        others = np.concatenate([np.tile(np.arange(1, k + 1, dtype=np.float32), (T, 1)),
                                 np.full((T, k), 1.0 / k, np.float32)], axis=1)
        parts = {"no_expert_op_us": median_us(lambda: lone(x.copy(), others), args.calls),
                 "rmsnorm_us": median_us(lambda: kernels.rmsnorm(x, norm, 1e-6), args.calls),
                 "quantize_H_us": median_us(lambda: kernels.quantize_activations(x[0], 32), args.calls),
                 "tiny_call_us": median_us(lambda: kernels.rmsnorm(x[:1, :32], norm[:32], 1e-6), args.calls),
                 "quantize_I_us": median_us(lambda: kernels.quantize_activations(x[0, :I], 32), args.calls)}
        op_us = median_us(call_experts, args.calls)
        raw_us, raw_best_us = timed_us(call_raw, args.calls)
        dense_us, dense_best_us = timed_us(call_dense, args.calls) if T == 1 else (None, None)
        nbytes = used * expert_bytes
        row = {"tokens": T, "threads": kernels.threads, "experts_used": round(float(used), 2),
               "expert_MB": round(float(nbytes) / 1e6, 2), "experts_op_us": round(op_us, 1), "ks_experts_us": round(raw_us, 1),
               "experts_GBps": round(nbytes / raw_us / 1e3, 2), "ks_experts_best_us": round(raw_best_us, 1),
               "experts_best_GBps": round(nbytes / raw_best_us / 1e3, 2),
               "dense_pair_us": None if dense_us is None else round(dense_us, 1),
               "dense_GBps": None if dense_us is None else round(k * expert_bytes / dense_us / 1e3, 2),
               "dense_best_GBps": None if dense_us is None else round(k * expert_bytes / dense_best_us / 1e3, 2),
               **{key: round(v, 1) for key, v in parts.items()}}
        print(row, flush=True)
        rows.append(row)
    if args.out:
        from kestrel_stream.cli.bench import environment
        from bench.report import write_results
        write_results("routed-layer", environment(), rows, list(rows[0]),
                      "One routed layer's experts op vs a dense Q8_0 pair of the same bytes: median µs.", out_dir=args.out)


if __name__ == "__main__":
    main()
