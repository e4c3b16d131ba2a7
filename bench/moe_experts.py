"""One routed layer on the device at a model's shape (route, gate_up, down, combine: the four launches of
run/device/moe_ops.py), the experts on the GEMVs (kernels_ptx/moe.cu) beside the grouped tensor-core GEMM
(kernels_ptx/moe_mma.cu) in each of its tiles, µs per layer and tokens/s of the layer, for setting
cuda/moe_kernels.py's switch point (MMA_MIN_EXPERT_TOKENS) and tile choice.

    PYTHONPATH=. python3 -m bench.moe_experts [--preset qwen3-30b-a3b] [--tokens 16,32,64,128,256,512,1024]
        [--hot 0.0] [--repeats 20] [--out DIR]

Every expert of the layer in Q8_0 in an expert pool (random levels and scales), a random float32 router;
--hot H adds H to an eighth of the experts' router rows (a skewed routing: those experts get most tokens).
Each tokens count runs: `gemv g4` and `gemv m8` (moe_experts_q8_0_g4 / _m8: 8 experts a block, or one), `gemm
<tile>` for every tile of MMA_TILES, and `default`
(experts_launch's own choice), each the layer's four launches timed as bench/gpu_kernels.py times kernels (a
CUDA graph of `repeats` layers).  The summary names the fastest per tokens count beside the default.
"""
from __future__ import annotations

import argparse

import numpy as np

from kestrel_stream.cli.bench import environment
from kestrel_stream.cuda import driver, kernels as kernel_module, moe_kernels
from kestrel_stream.loading.presets import PRESETS

from .gpu_kernels import time_graph_us
from .report import write_results

TOKENS = "16,32,64,128,256,512,1024"
REPEATS = 20
NEVER = 1 << 30     # a switch point no step reaches: the GEMVs


def slot_bytes(rows: int, cols: int) -> tuple[int, int]:
    """(qs, meta) bytes of one Q8_0 slot of `rows` x `cols`, rounded up to 256 as the expert pool's."""
    return tuple(-(-b // 256) * 256 for b in (rows * cols, rows * (cols // 32) * 2))


class RoutedLayer:
    """One routed layer of `config` on the device: every expert's gate_up and down in a Q8_0 pool, the router,
    and the step buffers for up to `tokens` tokens."""

    def __init__(self, arena, config, tokens: int, hot: float, rng):
        c = config
        self.E, self.k, self.H, self.I = c.num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
        E, k, H, I, T = self.E, self.k, self.H, self.I, tokens
        self.parts = []
        for rows, cols in ((2 * I, H), (H, I)):
            qs_slot, meta_slot = slot_bytes(rows, cols)
            qs, meta = arena.alloc(E * qs_slot), arena.alloc(E * meta_slot)
            for e in range(E):
                driver.h2d_sync(qs + e * qs_slot, rng.integers(-127, 128, rows * cols, dtype=np.int8))
                scales = (rng.random(rows * (cols // 32)) + 0.5) / (127 * np.sqrt(cols))
                driver.h2d_sync(meta + e * meta_slot, scales.astype(np.float16))
            self.parts.append(moe_kernels.PoolPart(qs, meta, qs_slot, meta_slot))
        xn = rng.standard_normal((T, H)).astype(np.float32)
        xn[:, 0] = 1.0                                          # a feature every token has: ...
        router = rng.standard_normal((E, H)).astype(np.float32) / np.sqrt(H)
        router[:, 0] = 0.0
        router[: max(E // 8, 1), 0] = hot                       # ... `hot` added to those experts' logits
        self.router, self.slot_of = self.put(arena, router), self.put(arena, np.arange(E, dtype=np.int32))
        self.xn = self.put(arena, xn)
        self.inv_rms = self.put(arena, np.ones(T, np.float32))
        self.x = self.put(arena, np.zeros((T, H), np.float32))
        self.normw = self.put(arena, np.ones(H, np.float32))
        self.route, self.counts = arena.alloc(4 * T * 2 * k), arena.alloc(4 * E)
        self.groups = arena.alloc(4 * moe_kernels.group_ints(E, T, k))
        self.tickets = self.put(arena, np.zeros(moe_kernels.route_tickets(T), np.uint32))
        self.act, self.expert_out = arena.alloc(4 * T * k * I), arena.alloc(4 * T * k * H)

    @staticmethod
    def put(arena, array: np.ndarray) -> int:
        ptr = arena.alloc(max(array.nbytes, 16))
        driver.h2d_sync(ptr, np.ascontiguousarray(array))
        return ptr

    def launches(self, kernels, tokens: int) -> list:
        """The layer's four launches for `tokens` tokens, as moe_ops.MoeOps makes them (the whole layer: into x)."""
        E, k, H, I = self.E, self.k, self.H, self.I
        shape = dict(experts=E, chosen=k, tokens=tokens)
        table = dict(slot_of=self.slot_of, groups=self.groups, **shape)
        return [
            moe_kernels.route_launch(kernels, xn=self.xn, inv_rms=self.inv_rms, router=self.router, route=self.route,
                                     counts=0, slot_of=self.slot_of, groups=self.groups, tickets=self.tickets,
                                     hidden=H, softmax_first=True, normalize=True, **shape),
            moe_kernels.experts_launch(kernels, "Q8_0", self.parts[0], x=self.xn, ldx=H, gather=True,
                                       inv_rms=self.inv_rms, y=self.act, ldy=I, rows=2 * I, cols=H, silu=True, **table),
            moe_kernels.experts_launch(kernels, "Q8_0", self.parts[1], x=self.act, ldx=I, gather=False, inv_rms=0,
                                       y=self.expert_out, ldy=H, rows=H, cols=I, silu=False, **table),
            moe_kernels.combine_launch(kernels, route=self.route, groups=self.groups, slot_of=self.slot_of,
                                       expert_out=self.expert_out, res=self.x, y=self.x, normw_out=self.normw,
                                       xn_out=0, inv_rms_out=0, eps=1e-6, hidden=H, **shape)]

    def loads(self, stream, tokens: int) -> np.ndarray:
        """Tokens per expert of the last step (its groups' offsets)."""
        offsets = np.empty(self.E + 1, np.int32)
        driver.d2h_async(offsets, self.groups, offsets.nbytes, stream)
        stream.synchronize()
        return np.diff(offsets)


def variants() -> dict:
    """name -> (moe_mma_min_tokens, moe_mma_tile, moe_gemv) of the kernel set."""
    return {**{f"gemv {layout}": (NEVER, None, layout) for layout in moe_kernels.GEMV_LAYOUTS},
            **{f"gemm {tile}": (0, tile, None) for tile in moe_kernels.MMA_TILES}, "default": (None, None, None)}


def run(kernels, arena, stream, config, tokens_list, hot: float, rng, repeats: int = REPEATS) -> list[dict]:
    layer = RoutedLayer(arena, config, max(tokens_list), hot, rng)
    weight_bytes = sum(layer.E * (p.qs_slot + p.meta_slot) for p in layer.parts)
    rows = []
    for tokens in tokens_list:
        for name, (min_tokens, tile, layout) in variants().items():
            kernels.moe_mma_min_tokens, kernels.moe_mma_tile, kernels.moe_gemv = min_tokens, tile, layout
            launches = layer.launches(kernels, tokens)
            us = max(time_graph_us(stream, lambda i: [launch.enqueue(stream) for launch in launches], repeats),
                     0.1)   # (the emulated device's events read 0)
            loads = layer.loads(stream, tokens)
            active = int((loads > 0).sum())
            rows.append({"tokens": tokens, "variant": name, "kernels": f"{launches[1].name} {launches[2].name}",
                         "us": round(us, 1), "layer_tok_s": round(tokens / us * 1e6),
                         "active_experts": active, "most_tokens": int(loads.max()),
                         "weight_GB_s": round(weight_bytes * active / layer.E / us / 1e3, 1)})
    kernels.moe_mma_min_tokens = kernels.moe_mma_tile = kernels.moe_gemv = None
    return rows


def summary(rows: list[dict]) -> list[dict]:
    table = []
    for tokens in sorted({r["tokens"] for r in rows}):
        mine = [r for r in rows if r["tokens"] == tokens]
        default, best = next(r for r in mine if r["variant"] == "default"), min(mine, key=lambda r: r["us"])
        table.append({"tokens": tokens, "default": default["kernels"], "default_us": default["us"],
                      "best": best["variant"], "best_us": best["us"], "gain": round(default["us"] / best["us"], 3)})
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", default=TOKENS)
    parser.add_argument("--hot", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = driver.Device(0)
    device.make_current()
    kernels = kernel_module.KernelSet(device)
    config = PRESETS[args.preset]
    tokens_list = [int(t) for t in args.tokens.split(",")]
    E, k, H, I, T = (config.num_experts, config.num_experts_per_tok, config.hidden_size,
                     config.moe_intermediate_size, max(tokens_list))
    pool = E * sum(sum(slot_bytes(r, c)) for r, c in ((2 * I, H), (H, I)))
    arena = driver.Arena(pool + 4 * (E * H + 4 * T * H + 2 * T * k * (H + I) + T * E) + (64 << 20))
    rows = run(kernels, arena, driver.Stream(), config, tokens_list, args.hot, np.random.default_rng(0),
               args.repeats)
    env = environment()
    path = write_results("moe-experts", env, summary(rows), ["tokens", "default", "default_us", "best", "best_us",
                                                              "gain"],
                         f"One routed layer of {args.preset} (Q8_0, --hot {args.hot}): the fastest variant per "
                         "tokens count beside the default (bench/moe_experts.py's docstring).", args.out)
    write_results("moe-experts-all", env, rows, ["tokens", "variant", "kernels", "us", "layer_tok_s",
                                                 "active_experts", "most_tokens", "weight_GB_s"], "", args.out)
    print(path.read_text())


if __name__ == "__main__":
    main()
