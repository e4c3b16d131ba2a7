"""Compiled kernel modules and launches with pre-packed argument arrays.

A `Launch` owns a numpy uint64 storage array (one 8-byte slot per argument) and
a `void*[]` array pointing into it; cuLaunchKernel gets the integer address of
the pointer array, so a launch packs nothing per call (cuda-bindings' tuple form
costs a packing pass every time).  Arguments are mutated in place with `set`.

While tracing, each enqueue is a launch on its stream's row, timed by the
device layer (driver.py), with the launch's `labels` (op, layer, flops, bytes,
set by the builders and the executors) as its args.
"""
from __future__ import annotations


import numpy as np
from cuda.bindings import driver as cu

from kernels_ptx.build import KERNEL_SOURCES, compile_cubin

from kestrel_stream.obs import trace
from kestrel_stream.cuda.driver import Device, Stream, check, timed
from kestrel_stream.cuda import mma_variants
from kestrel_stream.cuda.device_weight import QWeight   # noqa: F401  (kept importable from here)
from kestrel_stream.cuda.gemv_variants import (HMMA_VARIANTS, MULTI_VARIANTS, VARIANTS, hmma_variant, kernel_name,
                                               m1_variant, multi_variant)

# (source, arch, device ordinal) -> CUmodule: a module belongs to the context it was loaded in, and each device's
# primary context is its own (the daemon's replicas: one engine per GPU)
_modules: dict[tuple[str, str, int], object] = {}
STATIC_SHARED_BYTES = 48 * 1024   # shared memory per block a launch gets without cuFuncSetAttribute


def load_module(name: str, arch: str, cache_dir=None, ordinal: int = 0):
    """The CUmodule of kernels_ptx/<name> for `arch` in device `ordinal`'s context: compiled (or read from the disk
    cache) and loaded once per device of the process."""
    key = (name, arch, ordinal)
    if key not in _modules:
        cubin, _log = compile_cubin(name, arch, cache_dir=cache_dir)
        _modules[key] = check(cu.cuModuleLoadData(cubin), f"cuModuleLoadData({name})")
    return _modules[key]


def load_modules(names, arch: str, cache_dir=None, ordinal: int = 0) -> None:
    """Every module of `names` not loaded yet in device `ordinal`'s context: compiled (or read from the disk
    cache) on threads at once -- NVRTC releases the GIL, so a cold cache costs about the slowest module's
    compile instead of the sum -- then loaded here, in the thread whose context (that device's) is current."""
    from concurrent.futures import ThreadPoolExecutor
    missing = [name for name in names if (name, arch, ordinal) not in _modules]
    if not missing:
        return
    with ThreadPoolExecutor(len(missing), thread_name_prefix="kestrel-nvrtc") as pool:
        cubins = list(pool.map(lambda name: compile_cubin(name, arch, cache_dir=cache_dir)[0], missing))
    for name, cubin in zip(missing, cubins):
        _modules[(name, arch, ordinal)] = check(cu.cuModuleLoadData(cubin), f"cuModuleLoadData({name})")


class KernelSet:
    """Every kernel function of every family, by name, for one device."""

    def __init__(self, device: Device, options=None):
        self.device = device
        # GEMV layouts forced by Options (KESTREL_GEMV_M1 / _MN); None: the measured choice per shape
        self.gemv_m1 = options.gemv_m1 if options is not None else None
        self.gemv_mn = options.gemv_mn if options is not None else None
        self.gemv_block = options.gemv_block if options is not None else None   # KESTREL_GEMV_BLOCK
        # KESTREL_BLOCK_MMA_MIN_TOKENS; None: block_kernels.MMA_MIN_TOKENS
        self.block_mma_min_tokens = options.block_mma_min_tokens if options is not None else None
        # KESTREL_MOE_MMA_MIN_TOKENS / _TILE / KESTREL_MOE_GEMV; None: moe_kernels' choice
        self.moe_mma_min_tokens = options.moe_mma_min_tokens if options is not None else None
        self.moe_mma_tile, self.moe_gemv = (options.moe_mma_tile, options.moe_gemv) if options else (None, None)
        self._functions: dict[str, object] = {}
        self._dynamic_shared: dict[str, int] = {}   # kernel -> the dynamic shared bytes it is opted in for
        # the engine's Options.kernel_cache; without options, kernels_ptx.build's default directory
        load_modules(KERNEL_SOURCES, device.arch, options.kernel_cache if options is not None else None,
                     device.ordinal)

    def function(self, kernel_name: str):
        if kernel_name not in self._functions:
            for source in KERNEL_SOURCES:
                module = load_module(source, self.device.arch, ordinal=self.device.ordinal)
                err, fn = cu.cuModuleGetFunction(module, kernel_name.encode())
                if err == cu.CUresult.CUDA_SUCCESS:
                    self._functions[kernel_name] = fn
                    break
            else:
                raise KeyError(f"no kernel named {kernel_name!r} in {', '.join(KERNEL_SOURCES)}")
        return self._functions[kernel_name]

    def launch(self, kernel_name: str, grid, block, signature: str, args, shared_bytes: int = 0) -> "Launch":
        function = self.function(kernel_name)
        if shared_bytes > STATIC_SHARED_BYTES and self._dynamic_shared.get(kernel_name, 0) < shared_bytes:
            # past 48 KiB a kernel's dynamic shared memory needs an opt-in, once per function
            attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(cu.cuFuncSetAttribute(function, attribute, shared_bytes),
                  f"cuFuncSetAttribute({kernel_name}, max dynamic shared {shared_bytes} bytes)")
            self._dynamic_shared[kernel_name] = shared_bytes
        return Launch(function, kernel_name, grid, block, signature, args, shared_bytes)


# argument kinds: "p" device pointer (or 0 for null), "i" int32, "q" int64, "f" float32
_WRITERS = {"p": np.uint64, "q": np.int64, "i": np.int32, "f": np.float32}


class Launch:
    """One kernel launch with its grid, block and pre-packed arguments."""
    launch_count = 1      # launches per entry of a launch list (dense_gemm.DenseGemm enqueues several)

    def __init__(self, function, name: str, grid, block, signature: str, args, shared_bytes: int = 0):
        assert len(signature) == len(args), f"{name}: {len(args)} args for signature {signature!r}"
        self.function, self.name = function, name
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block = tuple(block) + (1,) * (3 - len(block))
        self.shared_bytes = shared_bytes
        self.signature = signature
        self.storage = np.zeros(max(len(args), 1), np.uint64)
        self.pointers = np.array([self.storage.ctypes.data + 8 * i for i in range(len(args))] or [0], np.uint64)
        self.params_address = self.pointers.ctypes.data
        self.labels: dict = {}          # trace args: op, layer, flops, bytes (see `label`)
        self._config = None             # a CUlaunchConfig once `programmatic` is set
        for i, value in enumerate(args):
            self.set(i, value)

    def label(self, **labels) -> "Launch":
        """Name what this launch computes for traces (op="qkv", layer=3, flops=..., bytes=...); None is left out."""
        self.labels.update((k, v) for k, v in labels.items() if v is not None)
        return self

    @property
    def programmatic(self) -> bool:
        """Launched with programmatic stream serialization (see common.cuh's pdl_wait)."""
        return self._config is not None

    @programmatic.setter
    def programmatic(self, enabled: bool) -> None:
        if not enabled:
            self._config = None
            return
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = self.grid
        config.blockDimX, config.blockDimY, config.blockDimZ = self.block
        config.sharedMemBytes = self.shared_bytes
        config.attrs = [attr]
        config.numAttrs = 1
        self._config = config

    def set(self, index: int, value) -> None:
        kind = self.signature[index]
        slot = self.storage[index:index + 1]
        slot[0] = 0   # 4-byte kinds fill the low half (little-endian); the rest stays zero
        slot.view(_WRITERS[kind])[0] = _WRITERS[kind](value)

    def enqueue(self, stream: Stream) -> None:
        rec = trace.active
        if rec is None or stream.capturing:
            self.submit(stream)
        else:
            timed(rec, stream, lambda: self.submit(stream), self.name, **self.labels)

    def submit(self, stream: Stream) -> None:
        """cuLaunchKernel on `stream`, untraced."""
        if self._config is not None:
            self._config.hStream = stream.handle
            (err,) = cu.cuLaunchKernelEx(self._config, self.function, self.params_address, 0)
            if err != cu.CUresult.CUDA_SUCCESS:
                check((err,), f"cuLaunchKernelEx({self.name} grid={self.grid} block={self.block}, programmatic)")
            return
        gx, gy, gz = self.grid
        bx, by, bz = self.block
        (err,) = cu.cuLaunchKernel(self.function, gx, gy, gz, bx, by, bz, self.shared_bytes,
                                   stream.handle, self.params_address, 0)
        if err != cu.CUresult.CUDA_SUCCESS:
            check((err,), f"cuLaunchKernel({self.name} grid={self.grid} block={self.block})")


# ---- typed builders for the kernel families (argument order = the .cu signatures) ----------------

GEMV_SIGNATURE = "pppippipppppfiii"
ROPE_SIGNATURE = "pppppppppfiiiii"     # qkv_norm_rope_append
ROPE_PAGED_SIGNATURE = "pppppppppfiiiiiip"   # qkv_rope_append_paged_{f16,f32}: + block_shift, token tree rows
# head dims kernels_ptx/attention.cu instantiates (qkv_rope.cu serves any even D <= 256), for the
# contiguous caches and the paged pool alike
ATTENTION_HEAD_DIMS = (32, 64, 80, 96, 128, 256)
# (head_dim, KV dtype) of attention.cu's _g2 kernels: paged attention for at most 2 q heads per kv head
SMALL_GROUP_ATTENTION = {(64, "f16"), (128, "f16")}
# (head_dim, KV dtype) of attention_rope.cu's kernels: a one-token step's attention with the rope op as its
# prologue (each with a _g2 twin for at most 2 q heads per kv head, as SMALL_GROUP_ATTENTION)
ROPE_ATTENTION = {(64, "f16"), (128, "f16")}
ROPE_ATTENTION_SIGNATURE = "ppppppppfpppppiiiiifii"
# split-key attention's fewest keys per split block (attention_body.cuh keys_per_split): a (kv head, token)
# with at most this many keys runs as one block that writes its output, with no partials and no merge
ATTENTION_MIN_KEYS = 16
# warps a block of attention_rope.cu takes (4: ATTN_WARPS; 8: its _w8 kernels, ATTN_WIDE_WARPS): a wider
# block reads a split's keys in fewer passes, so with more keys per split a short context needs fewer
# blocks and merges (bench/attention_decode.py --warps)
ROPE_ATTENTION_WARPS = (4, 8)
ATTENTION_WARPS = 8
GEMV_MAX_TOKENS = 8      # q8_gemv_m1..m8; more tokens per launch go to the tensor-core q8_mma
GEMV_COUNTER_BYTES = 96   # the zeroed scratch behind `counter`: uint32 ticket, float sums [8..23] (a token each)


def gemv_launch(kernels: KernelSet, w: QWeight, x: int, ldx: int, y: int, ldy: int, tokens: int, *,
                silu_pairs: bool = False, inv_rms_in: int = 0, res: int = 0, normw_out: int = 0,
                xn_out: int = 0, inv_rms_out: int = 0, counter: int = 0, eps: float = 1e-6,
                variant: str | None = None, split_scratch: mma_variants.SplitScratch | None = None,
                dense=None) -> Launch:
    """y = W @ x for `tokens` rows of x, with the epilogues of kernels_ptx/q8_gemv.cu.

    The GEMV for up to 8 tokens, the int8 tensor-core GEMM (q8_mma.cu) beyond.  inv_rms_in scales
    each token's outputs (RMSNorm of an input pre-multiplied by its norm weight); silu_pairs
    reads rows as (gate, up) pairs and writes silu(gate) * up (rows/2 outputs); res is added;
    xn_out gets y * normw_out; inv_rms_out (+ `counter`, a zeroed GEMV_COUNTER_BYTES scratch)
    gets 1/rms(y) per token.  variant: a single-token layout of gemv_variants.VARIANTS (by
    default the one measured fastest for the shape), of MULTI_VARIANTS or HMMA_VARIANTS for 2..16 tokens (by
    default hmma_launch.py's, 3..16); else a variant of mma_variants (a tile, + "s<splits>" to split K; unsplit
    without `split_scratch`) or "simt", the fp32 tiled q8_matmul.cu (exact fp32 activations; the
    baseline the bench compares with).  split_scratch: the partials and tickets split launches share.
    dense: a dense_gemm.DenseScratch; the steps and weights it serves run on the dense path, one fp16
    tensor-core GEMM (a DenseGemm: several launches), unless `variant` names a kernel.
    For a block-format weight: a layout of q4_gemv_variants.variants(M) (block_kernels.block_gemv_launch).
    From mma_variants.F16_MIN_TOKENS tokens on, by default, the fp16 tensor-core GEMM (q8_mma_f16_ws.cu), a
    tile of mma_variants.F16_TILES (by default mma_variants.choose_f16_tile).
    """
    if dense is not None and variant is None and dense.serves(w, tokens, silu_pairs):
        from kestrel_stream.cuda.dense_gemm import dense_gemm_launch
        from kestrel_stream.cuda.block_kernels import weight_bytes
        return dense_gemm_launch(kernels, dense, w, x, ldx, y, ldy, tokens, silu_pairs=silu_pairs,
                                 inv_rms_in=inv_rms_in, res=res, normw_out=normw_out, xn_out=xn_out,
                                 inv_rms_out=inv_rms_out, eps=eps).label(
            flops=2 * w.rows * w.cols * tokens, bytes=weight_bytes(w))
    if w.fmt != "Q8_0":       # 4/6-bit block formats: kernels_ptx/q4_gemv.cu, q4_mma.cu
        from kestrel_stream.cuda.block_kernels import block_gemv_launch
        return block_gemv_launch(kernels, w, x, ldx, y, ldy, tokens, silu_pairs=silu_pairs, inv_rms_in=inv_rms_in,
                                 res=res, normw_out=normw_out, xn_out=xn_out, inv_rms_out=inv_rms_out,
                                 counter=counter, eps=eps, variant=variant, split_scratch=split_scratch)
    from kestrel_stream.cuda.hmma_launch import hmma_launch, hmma_serves   # (it must not import this module)
    args = [w.qs, w.scales, x, ldx, inv_rms_in, y, ldy, res, normw_out, xn_out, inv_rms_out, counter, eps,
            w.rows, w.cols, tokens]
    if tokens > GEMV_MAX_TOKENS and mma_variants.uses_f16(tokens, variant):   # prefill-sized: fp16 tensor cores
        tile_name = variant or mma_variants.choose_f16_tile(tokens, w.rows, k=w.cols)
        tile = mma_variants.F16_TILES[tile_name]
        launch = kernels.launch(mma_variants.f16_kernel_name(tile_name, silu_pairs),
                                (-(-w.rows // tile.rows), -(-tokens // tile.tokens)), (tile.threads,),
                                GEMV_SIGNATURE, args, tile.shared_bytes)
    elif tokens > GEMV_MAX_TOKENS and hmma_serves(kernels, tokens, variant):
        launch = hmma_launch(kernels, w, tokens, silu_pairs, args, variant or hmma_variant(w.rows))
    elif tokens > GEMV_MAX_TOKENS and variant == "simt":
        launch = kernels.launch("q8_matmul" + ("_silu" if silu_pairs else ""),
                                (-(-w.rows // 64), -(-tokens // 64)), (256,), GEMV_SIGNATURE, args)
    elif tokens > GEMV_MAX_TOKENS:
        launch = _mma_launch(kernels, w, tokens, silu_pairs, args, variant, split_scratch)
    else:
        if variant is None:
            variant = (m1_variant(w.rows, w.cols, kernels.gemv_m1) if tokens == 1
                       else multi_variant(tokens, kernels.gemv_mn, w.rows))
        if tokens > 1 and variant in HMMA_VARIANTS:
            launch = hmma_launch(kernels, w, tokens, silu_pairs, args, variant)
        else:
            shape = (VARIANTS if tokens == 1 else MULTI_VARIANTS)[variant]
            launch = kernels.launch(kernel_name(tokens, variant, silu_pairs), (-(-w.rows // shape.rows),),
                                    (shape.threads,), GEMV_SIGNATURE, args)
    # weight bytes: int8 values + one fp16 scale per 32
    return launch.label(flops=2 * w.rows * w.cols * tokens, bytes=w.rows * w.cols + w.rows * (w.cols // 32) * 2)


MMA_SIGNATURE = GEMV_SIGNATURE + "pp"     # q8_mma.cu: + split K's partials and tickets


def _mma_launch(kernels: KernelSet, w: QWeight, tokens: int, silu_pairs: bool, args: list, variant: str | None,
                scratch: mma_variants.SplitScratch | None) -> Launch:
    if variant is None:
        variant = (mma_variants.choose_variant(tokens, w.rows, w.cols) if scratch is not None
                   else mma_variants.choose_tile(tokens, w.rows))
    tile_name, splits = mma_variants.parse_variant(variant)
    tile = mma_variants.TILES[tile_name]
    assert mma_variants.split_is_valid(w.cols, tile, splits), \
        f"{variant}: K={w.cols} cannot be split {splits} ways (a 16-token tile, no split left empty)"
    partial_floats, tickets = mma_variants.scratch_floats(tokens, w.rows, tile_name, splits)
    if splits > 1:
        assert scratch is not None and partial_floats <= scratch.partial_floats and tickets <= scratch.ticket_count, \
            f"{variant} on {tokens} x {w.rows}: needs {partial_floats} partial floats, {tickets} tickets; has {scratch}"
    split_args = [scratch.partials, scratch.tickets] if splits > 1 else [0, 0]
    return kernels.launch(mma_variants.kernel_name(tile_name, silu_pairs),
                          mma_variants.grid(tokens, w.rows, tile_name, splits), (tile.threads,), MMA_SIGNATURE,
                          args + split_args)


def split_partials(partials: int, rows: int, head_dim: int) -> tuple[int, int, int]:
    """Split-key attention's workspace as (acc [rows, head_dim], max [rows], sum [rows]) float32 addresses."""
    return partials, partials + 4 * rows * head_dim, partials + 4 * rows * (head_dim + 1)


def attention_launch(kernels: KernelSet, q: int, kvpool: int, kvbase: int, pos: int, out: int,
                     partials: int, counters: int, tokens: int, layer: int, n_layers: int, n_heads: int,
                     n_kv: int, head_dim: int, splits: int, window: int = 0, scale: float | None = None,
                     min_keys: int = ATTENTION_MIN_KEYS) -> Launch:
    """Split-key attention, merged by each (kv head, token)'s last split block.

    window: a sliding window's length (0: none); scale: the softmax scale (default 1/sqrt(head_dim));
    min_keys: the fewest keys a split block takes (ATTENTION_MIN_KEYS).

    partials: tokens*n_heads*splits*(head_dim+2) floats; counters: tokens*n_kv zeroed uint32.
    """
    part_acc, part_max, part_sum = split_partials(partials, tokens * n_heads * splits, head_dim)
    assert head_dim in ATTENTION_HEAD_DIMS, head_dim
    return kernels.launch(f"attention_split_d{head_dim}", (n_kv, tokens, splits), (128,), "pppppppppiiiiifi",
                          [q, kvpool, kvbase, pos, part_acc, part_max, part_sum, out, counters, layer, n_layers,
                           n_heads, n_kv, window, 1.0 / float(np.sqrt(head_dim)) if scale is None else scale,
                           min_keys])


def paged_attention_launch(kernels: KernelSet, q: int, tables: int, table_row: int, pos: int, out: int,
                           partials: int, counters: int, tokens: int, layer: int, n_layers: int, n_heads: int,
                           n_kv: int, head_dim: int, splits: int, block_shift: int, kv_dtype: str,
                           window: int = 0, scale: float | None = None, min_keys: int = ATTENTION_MIN_KEYS,
                           tree: int = 0) -> Launch:
    """attention_launch over gpu mode's paged pool (kernels_ptx/kv_cache.cuh): keys through each
    token's block-table row, f16 or float32.  tree: the step's token-tree rows (kv_cache.cuh TreeRow,
    int32 [tokens, 4]; 0: none)."""
    part_acc, part_max, part_sum = split_partials(partials, tokens * n_heads * splits, head_dim)
    assert head_dim in ATTENTION_HEAD_DIMS, head_dim
    small_group = n_heads <= 2 * n_kv and (head_dim, kv_dtype) in SMALL_GROUP_ATTENTION
    return kernels.launch(f"attention_paged_d{head_dim}_{kv_dtype}{'_g2' if small_group else ''}",
                          (n_kv, tokens, splits), (128,),
                          "pppppppppiiiiifiip",
                          [q, tables, table_row, pos, part_acc, part_max, part_sum, out, counters, layer, n_layers,
                           n_heads, n_kv, window, 1.0 / float(np.sqrt(head_dim)) if scale is None else scale,
                           block_shift, min_keys, tree])


def rope_attention_launch(kernels: KernelSet, qkv: int, vectors: list[int], eps: float, tables: int, table_row: int,
                          pos: int, out: int, partials: int, counters: int, tokens: int, layer: int, n_layers: int,
                          n_heads: int, n_kv: int, head_dim: int, splits: int, block_shift: int, kv_dtype: str,
                          window: int = 0, scale: float | None = None, min_keys: int = ATTENTION_MIN_KEYS,
                          warps: int = ATTENTION_WARPS) -> Launch:
    """paged_attention_launch with the rope op (qkv_rope_append_paged's work) as its prologue: q from the
    qkv rows, k and v appended at each token's position.  vectors: the rope op's q_norm, k_norm, inv_freq
    and qkv bias addresses (0: none).  Each token must be the only row of its session in the step.
    warps: a block's (ROPE_ATTENTION_WARPS)."""
    part_acc, part_max, part_sum = split_partials(partials, tokens * n_heads * splits, head_dim)
    assert (head_dim, kv_dtype) in ROPE_ATTENTION, (head_dim, kv_dtype)
    assert warps in ROPE_ATTENTION_WARPS, f"attention warps {warps}: expected one of {ROPE_ATTENTION_WARPS}"
    tail = ("_g2" if n_heads <= 2 * n_kv else "") + ("_w8" if warps == 8 else "")
    return kernels.launch(f"attention_rope_paged_d{head_dim}_{kv_dtype}{tail}",
                          (n_kv, tokens, splits), (32 * warps,), ROPE_ATTENTION_SIGNATURE,
                          [qkv, tables, table_row, pos, *vectors, eps, part_acc, part_max, part_sum, out, counters,
                           layer, n_layers, n_heads, n_kv, window,
                           1.0 / float(np.sqrt(head_dim)) if scale is None else scale, block_shift, min_keys])
