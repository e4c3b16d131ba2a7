"""A projection of many tokens as one GEMM: the launch object gemv_launch returns for it.

`DenseGemm` stands in a step's launch list for one projection (like kernels.Launch: enqueue(stream),
labels, the weight address in storage[0] for the residency window) and enqueues, in stream order:

  the expansion    cuBLAS only: the weight -> fp16 [N, K] in the scratch (dense_gemm.cu): q8_dequant_f16
                   for Q8_0, <fmt>[_<tail fmt>]_dequant_f16 for the 4/6-bit block formats (dequant_launch)
  gemm_input_f16   x (times inv_rms_in) -> fp16 A [T, K]
  the GEMM         C = A @ W^T, fp32 accumulation: straight into y (qkv, lm_head), added into y in
                   place (o, down: y is the residual they add to), or into the fp32 scratch (gate_up).
                   cuBLAS on the fp16 expansion where the library loads, else the built-in
                   q8_gemm_f16.cu, which expands the Q8_0 weight in registers (no weight scratch)
  gemm_epilogue    where needed: SiLU·mul from the scratch, residual add, xn_out and inv_rms_out

`launch_count` says how many launches that is (2 to 4), and the plan counts the same
(scheduler/dense.py).  Which steps and weights take this path: `DenseScratch.serves`.  No model
knowledge: shapes come from the caller.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kestrel_stream.obs import trace
from kestrel_stream.cuda import driver
from scheduler.dense import path_formats

EPILOGUE_SIGNATURE = "pippppppfi"        # gemm_epilogue(_silu): c, ldc, y, ldy, res, normw, xn, inv_rms, eps, N
THREADS = 256
MAX_DEQUANT_BLOCKS = 1 << 16             # grid-stride beyond
BLOCK_DEQUANT_SIGNATURE = "pppiippi"    # <fmt>_dequant_f16: qs, meta, out, N, K, qs_b, meta_b, head_rows
BLOCK_UNITS = {"Q4_0": 32, "Q4_K": 32, "Q6_K": 64}   # weights a thread expands (q4_formats.cuh's UNIT)
GEMM_SIGNATURE = "pppipiiiii"            # q8_gemm_f16: qs, scales, a, lda, c, ldc, T, N, K, accumulate
GEMM_K_STEP = 64                         # q8_gemm_f16.cu's BK


class GemmTile(NamedTuple):
    """A tile of the built-in GEMM: tokens x weight rows of output per block.  q8_gemm_f16.cu (mma.sync,
    warps_m x warps_n warps) or, wgmma, q8_wgmma.cu (sm_90: one warpgroup per 64 rows); the cp.async
    ring's depth."""
    tokens: int
    rows: int
    warps_m: int
    warps_n: int
    stages: int
    wgmma: bool = False

    @property
    def name(self) -> str:
        if self.wgmma:
            return f"q8_wgmma_{self.rows}x{self.tokens}_s{self.stages}"
        return f"q8_gemm_f16_{self.tokens}x{self.rows}_w{self.warps_m}x{self.warps_n}_s{self.stages}"

    @property
    def threads(self) -> int:
        return 128 * (self.rows // 64) if self.wgmma else 32 * self.warps_m * self.warps_n

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory.  Per stage: fp16 token rows (160 bytes for 128; wgmma: 128, swizzled), int8
        weight rows of 80 bytes, 8 bytes of scales a row; wgmma stages at 1024-byte boundaries, plus 1024
        to align the first."""
        if self.wgmma:
            stage = self.tokens * 2 * GEMM_K_STEP + self.rows * (GEMM_K_STEP + 16) + self.rows * 8
            return self.stages * (-(-stage // 1024) * 1024) + 1024
        return self.stages * (self.tokens * (2 * GEMM_K_STEP + 32) + self.rows * (GEMM_K_STEP + 16) + self.rows * 8)

    def blocks(self, tokens: int, rows: int) -> int:
        return -(-tokens // self.tokens) * -(-rows // self.rows)


def wgmma_tile(rows: int, tokens: int, stages: int) -> GemmTile:
    return GemmTile(tokens, rows, 0, 0, stages, wgmma=True)


# the tiles q8_gemm_f16.cu compiles (its DEFINE_Q8_GEMM_F16 lines), largest first
GEMM_TILES = (GemmTile(128, 256, 2, 4, 4), GemmTile(256, 128, 4, 2, 3), GemmTile(128, 128, 2, 4, 4),
              GemmTile(128, 128, 2, 2, 3), GemmTile(64, 128, 2, 2, 4), GemmTile(64, 64, 2, 2, 4))
# q8_wgmma.cu's (DEFINE_Q8_WGMMA: warpgroups, rows, tokens, stages), sm_90 only
WGMMA_TILES = (wgmma_tile(128, 256, 4), wgmma_tile(128, 128, 4), wgmma_tile(64, 256, 4), wgmma_tile(64, 128, 4))
ALL_GEMM_TILES = GEMM_TILES + WGMMA_TILES
# (tokens, rows, cols) -> tile name, from the H200 sweep (bench/results/2026-12-01-h200-q8-gemm-wgmma.md);
# shapes not in it take choose_gemm_tile's rule
MEASURED_GEMM: dict[tuple[int, int, int], str] = {
                 (128, 2048, 2048): 'q8_gemm_f16_64x64_w2x2_s4',
                 (128, 2048, 6144): 'q8_wgmma_64x128_s4',
                 (128, 4096, 2048): 'q8_gemm_f16_64x64_w2x2_s4',
                 (128, 4096, 4096): 'q8_gemm_f16_64x64_w2x2_s4',
                 (128, 4096, 12288): 'q8_wgmma_64x128_s4',
                 (128, 6144, 4096): 'q8_wgmma_64x128_s4',
                 (128, 12288, 2048): 'q8_wgmma_64x128_s4',
                 (128, 24576, 4096): 'q8_wgmma_64x128_s4',
                 (512, 2048, 2048): 'q8_wgmma_64x128_s4',
                 (512, 2048, 6144): 'q8_wgmma_64x128_s4',
                 (512, 4096, 2048): 'q8_wgmma_64x128_s4',
                 (512, 4096, 4096): 'q8_wgmma_64x128_s4',
                 (512, 4096, 12288): 'q8_wgmma_64x128_s4',
                 (512, 6144, 4096): 'q8_wgmma_128x256_s4',
                 (512, 12288, 2048): 'q8_wgmma_64x128_s4',
                 (512, 24576, 4096): 'q8_wgmma_128x256_s4'}


def choose_gemm_tile(tokens: int, rows: int, cols: int, sm_count: int = 132, arch: str = "sm_90") -> GemmTile:
    """The measured tile for this shape, else the sweep's rule: on sm_90 wgmma's 64 x 128 tiles (128 x 256
    for 512+ tokens, 6,144+ rows and K of 4,096+) unless they leave most SMs without a block; elsewhere (and then) the
    largest mma.sync tile that still gives every SM a block."""
    tiles = ALL_GEMM_TILES if arch == "sm_90" else GEMM_TILES
    by_name = {tile.name: tile for tile in tiles}
    if MEASURED_GEMM.get((tokens, rows, cols)) in by_name:
        return by_name[MEASURED_GEMM[(tokens, rows, cols)]]
    if arch == "sm_90" and wgmma_tile(64, 128, 4).blocks(tokens, rows) >= 0.6 * sm_count:
        return wgmma_tile(128, 256, 4) if tokens >= 512 and rows >= 6144 and cols >= 4096 else wgmma_tile(64, 128, 4)
    for tile in GEMM_TILES:
        if tile.blocks(tokens, rows) >= sm_count:
            return tile
    return GEMM_TILES[-1]


@dataclass
class DenseScratch:
    """The device buffers of the dense path and the library handle that runs it (None: q8_gemm_f16.cu).

    weights: cuBLAS only, fp16 [weight_elements] (one expanded weight at a time); inputs: fp16
    [max_tokens, max_cols]; outputs: fp32 [max_tokens * output_floats] (GEMM results an epilogue reads)."""
    blas: object              # cublas.Cublas (tests: the emulated device's twin), or None: the built-in GEMM
    min_tokens: int
    max_tokens: int
    weights: int
    weight_elements: int
    inputs: int
    max_cols: int
    outputs: int
    output_floats: int

    @classmethod
    def allocate(cls, arena, blas, *, min_tokens: int, max_tokens: int, weight_elements: int, max_cols: int,
                 output_floats: int, workspace_bytes: int) -> "DenseScratch":
        weights = arena.array((weight_elements,), np.float16).ptr if blas is not None else 0
        inputs = arena.array((max_tokens * max_cols,), np.float16)
        outputs = arena.array((max_tokens * output_floats,), np.float32)
        if blas is not None:
            workspace = arena.array((workspace_bytes,), np.uint8)
            blas.use_workspace(workspace.ptr, workspace_bytes)
        return cls(blas, min_tokens, max_tokens, weights, weight_elements, inputs.ptr, max_cols, outputs.ptr,
                   output_floats)

    @property
    def fused(self) -> bool:
        """Whether the built-in GEMM runs (the weight expanded in registers), not cuBLAS."""
        return self.blas is None

    def serves(self, w, tokens: int, silu_pairs: bool) -> bool:
        """Whether a step of `tokens` tokens computes weight `w` here: in a format the path expands
        (scheduler.dense.path_formats: cuBLAS's any of Q8_0 and the block formats, the built-in GEMM's Q8_0)
        and fitting the scratch (cuBLAS's weight scratch: the built-in GEMM needs none)."""
        return (weight_formats(w) in path_formats(self.fused) and self.min_tokens <= tokens <= self.max_tokens
                and (self.fused or w.rows * w.cols <= self.weight_elements) and w.cols <= self.max_cols
                and (not silu_pairs or tokens * w.rows <= self.max_tokens * self.output_floats))


def weight_formats(w) -> tuple:
    """(format, format of the last rows or None) of a device weight."""
    return w.fmt, (w.tail.fmt if w.tail is not None else None)


def dequant_launch(kernels, w, out: int):
    """The launch that expands weight `w` to fp16 [w.rows, w.cols] at `out`: dense_gemm.cu's q8_dequant_f16
    (a thread per 16 weights), or <fmt>[_<tail fmt>]_dequant_f16 (a thread per format unit; the tail's rows
    after the head's)."""
    N, K = w.rows, w.cols
    if w.fmt == "Q8_0":
        chunks = N * K // 16
        return kernels.launch("q8_dequant_f16", (min(-(-chunks // THREADS), MAX_DEQUANT_BLOCKS),), (THREADS,),
                              "pppii", [w.qs, w.scales, out, N, K])
    tail = w.tail if w.tail is not None else w
    head_rows = N - (w.tail.rows if w.tail is not None else 0)
    units = head_rows * (K // BLOCK_UNITS[w.fmt]) + (N - head_rows) * (K // BLOCK_UNITS[tail.fmt])
    name = w.fmt.lower() + (f"_{w.tail.fmt.lower()}" if w.tail is not None else "") + "_dequant_f16"
    return kernels.launch(name, (min(-(-units // THREADS), MAX_DEQUANT_BLOCKS),), (THREADS,),
                          BLOCK_DEQUANT_SIGNATURE, [w.qs, w.scales, out, N, K, tail.qs, tail.scales, head_rows])


class DenseGemm:
    """One projection's launches on the library GEMM path, enqueued as one entry of a launch list."""

    def __init__(self, blas, dequant, inputs, gemm, epilogue=None):
        """gemm: cuBLAS's gemm_nt arguments (a dict) after `dequant`, or, with blas None, the built-in
        q8_gemm_f16 launch (dequant None)."""
        self.blas, self.dequant, self.inputs, self.gemm, self.epilogue = blas, dequant, inputs, gemm, epilogue
        self.builtin = None if blas is not None else gemm
        self.parts = [launch for launch in (dequant, inputs, self.builtin, epilogue) if launch is not None]
        self.launch_count = len(self.parts) + (blas is not None)
        self.name = "dense_gemm"
        self.labels: dict = {}
        self.storage = (dequant or gemm).storage    # [0]: the weight's address (the window checks it)

    def label(self, **labels) -> "DenseGemm":
        """Labels of the whole projection; each part traces under its own kernel name with op/layer/weight."""
        self.labels.update((k, v) for k, v in labels.items() if v is not None)
        shared = {k: v for k, v in labels.items() if k in ("op", "layer", "weight") and v is not None}
        for part in self.parts:
            part.label(**shared)
        if "bytes" in labels:
            (self.dequant or self.builtin).label(bytes=labels["bytes"])
        return self

    @property
    def programmatic(self) -> bool:
        return self.parts[0].programmatic

    @programmatic.setter
    def programmatic(self, enabled: bool) -> None:
        for part in self.parts:      # each kernel waits for its predecessor (pdl_wait) before it reads
            part.programmatic = enabled

    def _gemm(self, stream) -> None:
        g = self.gemm
        self.blas.gemm_nt(stream, g["rows"], g["cols"], g["depth"], g["a"], g["lda"], g["b"], g["ldb"], g["c"],
                          g["ldc"], accumulate=g["accumulate"])

    def enqueue(self, stream) -> None:
        if self.builtin is not None:
            for part in self.parts:
                part.enqueue(stream)
            return
        self.dequant.enqueue(stream)
        self.inputs.enqueue(stream)
        rec = trace.active
        if rec is None or stream.capturing:
            self._gemm(stream)
        else:
            g = self.gemm
            driver.timed(rec, stream, lambda: self._gemm(stream), "cublas_gemm_f16",
                         **{k: v for k, v in self.labels.items() if k in ("op", "layer", "weight")},
                         flops=2 * g["rows"] * g["cols"] * g["depth"])
        if self.epilogue is not None:
            self.epilogue.enqueue(stream)

    def submit(self, stream) -> None:
        """Every part on `stream`, untraced."""
        if self.builtin is not None:
            for part in self.parts:
                part.submit(stream)
            return
        self.dequant.submit(stream)
        self.inputs.submit(stream)
        self._gemm(stream)
        if self.epilogue is not None:
            self.epilogue.submit(stream)


def dense_gemm_launch(kernels, scratch: DenseScratch, w, x: int, ldx: int, y: int, ldy: int, tokens: int, *,
                      silu_pairs: bool = False, inv_rms_in: int = 0, res: int = 0, normw_out: int = 0,
                      xn_out: int = 0, inv_rms_out: int = 0, eps: float = 1e-6) -> DenseGemm:
    """gemv_launch's contract (kernels.gemv_launch) on the library GEMM path; scratch.serves(w, tokens, silu_pairs)."""
    assert scratch.serves(w, tokens, silu_pairs), (w.rows, w.cols, tokens)
    N, K = w.rows, w.cols
    dequant = None if scratch.fused else dequant_launch(kernels, w, scratch.weights)
    inputs = kernels.launch("gemm_input_f16", (-(-K // (4 * THREADS)), tokens), (THREADS,), "pippi",
                            [x, ldx, inv_rms_in, scratch.inputs, K])
    in_place = not silu_pairs and res in (0, y)          # the GEMM writes (or adds into) y itself
    c, ldc = (y, ldy) if in_place else (scratch.outputs, N)
    accumulate = in_place and res == y and res != 0
    if scratch.fused:
        device = getattr(kernels, "device", None)
        tile = choose_gemm_tile(tokens, N, K, arch=getattr(device, "arch", "sm_90"))
        gemm = kernels.launch(tile.name, (-(-tokens // tile.tokens), -(-N // tile.rows)), (tile.threads,),
                              GEMM_SIGNATURE, [w.qs, w.scales, scratch.inputs, K, c, ldc, tokens, N, K,
                                               int(accumulate)], tile.shared_bytes).label(flops=2 * tokens * N * K)
    else:
        gemm = dict(rows=tokens, cols=N, depth=K, a=scratch.inputs, lda=K, b=scratch.weights, ldb=K, c=c, ldc=ldc,
                    accumulate=accumulate)
    epilogue = None
    if not in_place or xn_out or inv_rms_out:
        outputs = N // 2 if silu_pairs else N
        epilogue = kernels.launch("gemm_epilogue" + ("_silu" if silu_pairs else ""), (tokens,), (THREADS,),
                                  EPILOGUE_SIGNATURE, [c, ldc, y, ldy, 0 if in_place else res, normw_out, xn_out,
                                                       inv_rms_out, eps, outputs])
    return DenseGemm(scratch.blas, dequant, inputs, gemm, epilogue)
