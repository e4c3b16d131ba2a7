"""ctypes bindings of the host kernels: numpy arrays in, numpy arrays out.

Every function checks its arrays once (dtype, shape, inner contiguity) and passes pointers and row
strides, so row slices and column slices of a fused output (gate | up) go in without a copy.  ctypes
releases the GIL for the call.

One concern, the library seen from Python: each C entry's argument types and checks, and the weights as
it holds them (a repacked weight's rows read back out of its groups, `PreparedWeight.file_rows`), change
together with the C.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from kestrel_stream.native.repacked_rows import REPACK_ROWS, repacked_source

ISAS = ("scalar", "avx2", "avxvnni", "avx512vnni", "amx")     # widening order; the C enum's values
FORMATS = {"Q8_0": (0, 32, None), "Q4_0": (1, 32, 18), "Q4_K": (2, 256, 144), "Q6_K": (3, 256, 210)}
# fmt → (C enum, values per block, bytes per block of a block-format row; Q8_0 is split qs | scales)
REPACKED = {"Q4_K": 4, "Q6_K": 5}          # fmt → the C enum of its weight repacked 16 rows together

_p, _i, _z, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_ssize_t, ctypes.c_float


def physical_cores() -> int:
    """The cores this process may run on, one per physical core (SMT siblings counted once)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def pick_isa(supported: tuple[str, ...], isa: str | None) -> str:
    """The widest of the CPU's `supported` ISAs up to `isa` (None: the widest of all).  A CPU may lack one in
    between (AVX-512 VNNI without AVX-VNNI: Ice Lake, Zen 4), which is then never chosen."""
    return supported[-1] if isa is None else [s for s in supported if ISAS.index(s) <= ISAS.index(isa)][-1]


class HostKernels:
    """The loaded library: quantized matmuls and float ops, on `threads` threads with the widest ISA
    up to `isa` that the CPU has.  The threads are the library's own persistent workers (one pool per
    process); `spin_us` sets how long an idle one polls for the next call before it sleeps (default
    100 us: calls a step apart find it awake; 0 on a machine shared with other work)."""

    def __init__(self, path: Path, isa: str | None = None, threads: int | None = None, spin_us: int | None = None):
        self.path = path
        self._lib = lib = ctypes.CDLL(str(path))
        lib.ks_isa_supported.restype = _i
        lib.ks_matmul.argtypes = [_i, _i, _p, _z, _p, _z, _i, _i, _p, _z, _i, _p, _z, _i]
        lib.ks_matmul.restype = _i
        lib.ks_linear.argtypes = [_p, _p, _z, _i, _p, _z]
        lib.ks_linear.restype = _i
        lib.ks_qkv_rope.argtypes = [_p, _z, _i, _i, _i, _i, _p, _p, _f, _p, _p, _p, _z, _p, _p, _z, _i]
        lib.ks_qkv_rope.restype = _i
        lib.ks_program.argtypes = [_p, _i, _p]
        lib.ks_program.restype = _i
        self.program_call = lib.ks_program        # run/host/native_program.py's step: its op list and buffers
        lib.ks_norm_node.argtypes = lib.ks_serve_begin.argtypes = [_p]
        self.norm_call = lib.ks_norm_node          # a step graph's host items and their server (run/host_nodes.py)
        self.serve_begin, self.serve_end, self.serve_abort = lib.ks_serve_begin, lib.ks_serve_end, lib.ks_serve_abort
        lib.ks_route.argtypes = [_p, _p, _z, _i, _p, _z]          # a routed layer's ops (native/routed.py)
        lib.ks_route.restype = _i
        lib.ks_experts.argtypes = [_p, _p, _z, _i, _p, _z, _p, _z]
        lib.ks_experts.restype = _i
        lib.ks_experts_times.argtypes = lib.ks_serve_times.argtypes = [_p, _i]
        lib.ks_quantize_act.argtypes = [_i, _p, _i, _i, _p, _p, _p, _p, _p]
        lib.ks_rmsnorm.argtypes = [_p, _z, _i, _i, _p, _i, _f, _p, _z, _i]
        lib.ks_silu_mul.argtypes = [_p, _z, _p, _z, _i, _i, _p, _z, _i]
        lib.ks_rope.argtypes = [_p, _z, _z, _i, _i, _i, _p, _p]
        lib.ks_attention.argtypes = [_p, _z, _z, _i, _i, _i, _p, _p, _i, _z, _z, _i, _i, _i, _f, _p, _z, _i]
        lib.ks_attention.restype = _i
        lib.ks_attention_tiled.argtypes = lib.ks_attention.argtypes
        lib.ks_attention_tiled.restype = _i
        lib.ks_read_sum.argtypes = [_p, ctypes.c_size_t, _i]
        lib.ks_read_sum.restype = ctypes.c_uint64
        lib.ks_set_spin_us.argtypes = [_i]
        lib.ks_pool_workers.restype = _i
        lib.ks_repacked_group_bytes.argtypes = [_i, _i]
        lib.ks_repacked_group_bytes.restype = ctypes.c_size_t
        lib.ks_repack.argtypes = [_i, _p, _z, _i, _i, _p]
        if spin_us is not None:          # the library's pool is one per process: this sets it for every caller
            lib.ks_set_spin_us(spin_us)
        mask = lib.ks_isa_supported()
        self.supported = tuple(name for i, name in enumerate(ISAS) if mask >> i & 1)
        if isa is not None and isa not in ISAS:
            raise ValueError(f"host kernel ISA {isa!r}: one of {', '.join(ISAS)}")
        self.isa = pick_isa(self.supported, isa)
        self.threads = threads or physical_cores()
        self._isa_id = ISAS.index(self.isa)
        self._matmul_c = lib.ks_matmul

    def times(self, reset: bool = False) -> dict:
        """Process-wide, since the last reset: one-token routed-experts calls, µs a call, of those with a link
        share ("linked") µs a call waited for the device's sum; step graphs' host item lists ("steps"), their
        items, a step's µs of items and of waits for the device's word (its segments and the hand-offs)."""
        e, s = (ctypes.c_longlong * 4)(), (ctypes.c_longlong * 4)()
        self._lib.ks_experts_times(e, int(reset)), self._lib.ks_serve_times(s, int(reset))
        per = lambda ns, n: ns / 1e3 / max(n, 1)       # noqa: E731
        return {"calls": e[0], "us": per(e[1], e[0]), "linked": e[3], "link_wait_us": per(e[2], e[3]),
                "steps": s[0], "items": s[1], "items_us": per(s[2], s[0]), "waits_us": per(s[3], s[0])}

    def set_spin_us(self, spin_us: int) -> None:
        """How long an idle worker (and a caller waiting for workers) polls before sleeping, for every caller in
        this process (the pool is one per process)."""
        self._lib.ks_set_spin_us(int(spin_us))

    @property
    def pool_workers(self) -> int:
        """Worker threads the library has started in this process (the calling thread is not one)."""
        return self._lib.ks_pool_workers()

    def with_isa(self, isa: str) -> "HostKernels":
        """The same library, run with at most `isa` (tests force each fallback this way)."""
        return HostKernels(self.path, isa, self.threads)

    # ------------------------------------------------------------ quantized matmuls

    def prepare_q8_0(self, qs: np.ndarray, scales: np.ndarray) -> "PreparedWeight":
        """A Q8_0 weight as stored (model/quant.QTensor): qs int8 [N, K], scales float16 [N, K/32],
        checked once and held for `matmul` (no copy)."""
        assert qs.dtype == np.int8 and scales.dtype == np.float16 and qs.ndim == scales.ndim == 2
        n, k = qs.shape
        assert k % 32 == 0 and scales.shape == (n, k // 32), (qs.shape, scales.shape)
        _rows_contiguous(qs, scales)
        return PreparedWeight("Q8_0", n, k, qs.ctypes.data, qs.strides[0], scales.ctypes.data, scales.strides[0],
                              (qs, scales))

    def prepare_q8_0_halves(self, gate: tuple, up: tuple) -> "PreparedWeight":
        """A glu weight in Q8_0 whose gate and up halves lie apart: gate, up = (qs int8 [I, K], scales float16
        [I, K/32]) with the same row strides (the device's expert pool: rows interleaved, read in place)."""
        (gq, gs), (uq, us) = gate, up
        assert gq.shape == uq.shape and gs.shape == us.shape and gq.strides == uq.strides and gs.strides == us.strides
        w = self.prepare_q8_0(gq, gs)
        w.rows, w.arrays, w.nbytes = 2 * w.rows, (gq, gs, uq, us), 2 * w.nbytes
        w.up_w, w.up_meta = uq.ctypes.data - gq.ctypes.data, us.ctypes.data - gs.ctypes.data
        return w

    def prepare_blocks(self, fmt: str, blocks: np.ndarray, cols: int) -> "PreparedWeight":
        """A Q4_0 / Q4_K / Q6_K weight as stored (model/quant4.BlockTensor): blocks uint8
        [N, cols/QK * block bytes], checked once and held for `matmul`.  Q4_0 and, below AVX-512 VNNI,
        every format: the blocks themselves (no copy).  Q4_K and Q6_K with VNNI: a copy of the blocks
        repacked 16 rows together (host_kquants.c; the same bytes, N rounded up to 16), which its
        kernels read 16 rows a load; the blocks are not kept."""
        _, elements, nbytes = FORMATS[fmt]
        assert nbytes is not None and blocks.dtype == np.uint8 and blocks.ndim == 2
        assert cols % elements == 0 and blocks.shape[1] == cols // elements * nbytes, (fmt, blocks.shape, cols)
        _rows_contiguous(blocks)
        rows = blocks.shape[0]
        if not self.repacks(fmt) or rows == 0:
            return PreparedWeight(fmt, rows, cols, blocks.ctypes.data, blocks.strides[0], None, 0, (blocks,))
        stride = self._lib.ks_repacked_group_bytes(FORMATS[fmt][0], cols)
        groups = -(-rows // REPACK_ROWS)
        raw = np.empty(groups * stride + 64, np.uint8)
        packed = raw[-raw.ctypes.data % 64:][:groups * stride]                  # 64-byte aligned
        self._lib.ks_repack(FORMATS[fmt][0], blocks.ctypes.data, blocks.strides[0], rows, cols, packed.ctypes.data)
        return PreparedWeight(fmt, rows, cols, packed.ctypes.data, stride, None, 0, (packed,), REPACKED[fmt])

    def repacks(self, fmt: str) -> bool:
        """Whether `prepare_blocks` makes a repacked copy of a weight in `fmt` (not a view of its blocks)."""
        return fmt in REPACKED and self.isa in ("avxvnni", "avx512vnni", "amx")

    def matmul(self, x: np.ndarray, w: "PreparedWeight", out: np.ndarray | None = None) -> np.ndarray:
        """x: float32 [T, K] (rows contiguous; any row stride) → float32 [T, N] (or into `out`, any row
        stride), on a prepared weight."""
        assert not w.up_w, "a weight whose halves lie apart (prepare_q8_0_halves) runs as a glu Linear"
        if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != w.cols or x.strides[1] != 4:
            x = _float_rows(x, w.cols)
        t = x.shape[0]
        if out is None:
            out = np.empty((t, w.rows), np.float32)
        else:
            assert out.dtype == np.float32 and out.shape == (t, w.rows) and (w.rows < 2 or out.strides[1] == 4)
        if t == 0 or w.rows == 0:
            return out
        status = self._matmul_c(w.fmt_id, self._isa_id, w.w_ptr, w.w_stride, w.meta_ptr, w.meta_stride, w.rows,
                                w.cols, _address(x), x.strides[0] >> 2, t, _address(out), out.strides[0] >> 2,
                                self.threads)
        if status != 0:
            raise MemoryError(f"host kernels: no memory for {t} x {w.cols} quantized activations")
        return out

    def linear(self, w: "PreparedWeight", norm: np.ndarray | None = None, eps: float = 0.0,
               glu: bool = False) -> "Linear":
        """A projection bound once: x [T, K] -> x @ W.T, with rmsnorm(x, norm, eps) as its prologue (as
        `rmsnorm` then `matmul`, the same numbers) and, with glu, silu(gate) * up of its two halves as its
        epilogue ([T, N/2], as `silu_mul`)."""
        return Linear(self, w, norm, eps, glu)

    def matmul_q8_0(self, x: np.ndarray, qs: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """x: float32 [T, K] @ a Q8_0 weight (qs int8 [N, K], scales float16 [N, K/32]) → float32 [T, N]."""
        return self.matmul(x, self.prepare_q8_0(qs, scales), out)

    def matmul_blocks(self, x: np.ndarray, fmt: str, blocks: np.ndarray, cols: int,
                      out: np.ndarray | None = None) -> np.ndarray:
        """x: float32 [T, cols] @ a Q4_0 / Q4_K / Q6_K weight (blocks uint8 [N, cols/QK * bytes]) → [T, N]."""
        return self.matmul(x, self.prepare_blocks(fmt, blocks, cols), out)

    def quantize_activations(self, x: np.ndarray, group: int) -> tuple:
        """One token's activation quantization as the matmuls do it, in two int8 levels (group 32: q8_0;
        256: q8_K): (hi int8 [K], lo int8 [K], d float32 [K/group], and for q8_K each level's bsums int16
        [K/16], else None, None); value i is d * (hi[i] + lo[i] / 128)."""
        x = np.ascontiguousarray(x, np.float32)
        k = x.shape[0]
        assert x.ndim == 1 and k % group == 0 and group in (32, 256)
        hi, lo, d = np.empty(k, np.int8), np.empty(k, np.int8), np.empty(k // group, np.float32)
        bsums = np.empty(k // 16, np.int16) if group == 256 else None
        bsums_lo = np.empty(k // 16, np.int16) if group == 256 else None
        self._lib.ks_quantize_act(self._isa_id, x.ctypes.data, k, group, hi.ctypes.data, lo.ctypes.data, d.ctypes.data,
                                  None if bsums is None else bsums.ctypes.data,
                                  None if bsums_lo is None else bsums_lo.ctypes.data)
        return hi, lo, d, bsums, bsums_lo

    # ------------------------------------------------------------ float ops

    def rmsnorm(self, x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
        """x: float32 [..., n]; w: float32 [n], or [h, n] for x [..., h, n] (q/k norms per head) → x's shape."""
        n = x.shape[-1]
        w = np.ascontiguousarray(w, np.float32)
        assert x.dtype == np.float32 and w.shape[-1] == n and x.shape[x.ndim - w.ndim:] == w.shape
        rows2d = _float_rows(x.reshape(-1, n), n)
        out = np.empty(x.shape, np.float32) if out is None else out
        assert out.dtype == np.float32 and out.shape == x.shape and out.flags.c_contiguous
        out2d = out.reshape(-1, n)
        w_rows = 1 if w.ndim == 1 else w.shape[0]
        self._lib.ks_rmsnorm(_address(rows2d), rows2d.strides[0] // 4, rows2d.shape[0], n, _address(w),
                             w_rows, eps, _address(out2d), out2d.strides[0] // 4, self.threads)
        return out

    def silu_mul(self, gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """gate, up: float32 [T, n] (row strides of their own: slices of one gate|up output) → [T, n]."""
        t, n = gate.shape
        assert up.shape == (t, n)
        gate, up = _float_rows(gate, n), _float_rows(up, n)
        out = np.empty((t, n), np.float32) if out is None else out
        assert out.dtype == np.float32 and out.shape == (t, n) and out.strides[1] == 4
        self._lib.ks_silu_mul(_address(gate), gate.strides[0] // 4, _address(up), up.strides[0] // 4, t, n,
                              _address(out), out.strides[0] // 4, self.threads)
        return out

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """In place: x float32 [T, heads, D] (D contiguous) rotated by cos, sin [T, D] (rotate-half, as
        run/host.apply_rope).  Returns x."""
        t, heads, d = x.shape
        assert x.dtype == np.float32 and x.strides[2] == 4 and cos.shape == sin.shape == (t, d)
        cos, sin = np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32)
        self._lib.ks_rope(_address(x), x.strides[0] // 4, x.strides[1] // 4, t, heads, d, _address(cos),
                          _address(sin))
        return x

    def qkv_rope(self, qkv: np.ndarray, heads: int, kv_heads: int, bias: np.ndarray | None, qk_norm: np.ndarray | None,
                 eps: float, cos: np.ndarray, sin: np.ndarray, q_out: np.ndarray, k_out: np.ndarray,
                 v_out: np.ndarray) -> None:
        """The rope op of rows of one session, as run/host/program.py does it in numpy: qkv float32 [T,
        (heads + 2 kv_heads) * D] (rows contiguous) plus bias, q and k heads rmsnormed by qk_norm [heads +
        kv_heads, D] (None: not), rotated by rope_rotation's cos, signed sin [T, D]; q into q_out [T, heads,
        D], k and v into k_out, v_out [T, kv_heads, D] (a cache's rows)."""
        t, d = cos.shape[0], cos.shape[-1]
        assert qkv.dtype == np.float32 and qkv.shape == (t, (heads + 2 * kv_heads) * d) and qkv.strides[1] == 4
        assert q_out.shape == (t, heads, d) and q_out.strides[1:] == (4 * d, 4)
        assert k_out.shape == v_out.shape == (t, kv_heads, d) and k_out.strides == v_out.strides
        assert k_out.dtype == v_out.dtype == q_out.dtype == np.float32 and k_out.strides[1:] == (4 * d, 4)
        cos, sin = _float_rows(cos.reshape(t, d), d), _float_rows(sin.reshape(t, d), d)
        assert cos.strides[0] == sin.strides[0] == 4 * d
        for vector in (bias, qk_norm):
            assert vector is None or (vector.dtype == np.float32 and vector.flags.c_contiguous)
        status = self._lib.ks_qkv_rope(_address(qkv), qkv.strides[0] // 4, t, heads, kv_heads, d,
                                       None if bias is None else _address(bias),
                                       None if qk_norm is None else _address(qk_norm), eps, _address(cos),
                                       _address(sin), _address(q_out), q_out.strides[0] // 4, _address(k_out),
                                       _address(v_out), k_out.strides[0] // 4, self.threads)
        if status != 0:
            raise ValueError(f"host kernels: a head of {d} values (at most 1,024, even)")

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, window: int | None = None,
                  scale: float | None = None, out: np.ndarray | None = None, tiled: bool = False) -> np.ndarray:
        """q: float32 [n, H, D] at positions start..start+n-1; k, v: [S, n_kv, D] float32 or float16 with
        S >= start + n (the first start + n are read) → [n, H * D], as run/host.attention (GQA, causal,
        sliding window).  tiled: the chunk kernel (query tiles, an online softmax) at any size."""
        n, heads, d = q.shape
        assert q.dtype == np.float32 and q.strides[2] == 4
        assert k.dtype == v.dtype and k.dtype in (np.float32, np.float16) and k.strides == v.strides
        s, n_kv, dk = k.shape
        assert dk == d and v.shape == k.shape and s >= start + n and heads % n_kv == 0
        assert k.strides[2] == k.itemsize
        out = np.empty((n, heads * d), np.float32) if out is None else out
        assert out.dtype == np.float32 and out.shape == (n, heads * d) and out.strides[1] == 4
        scale = float(np.float32(1.0 / np.sqrt(d))) if scale is None else scale
        kernel = self._lib.ks_attention_tiled if tiled else self._lib.ks_attention
        status = kernel(_address(q), q.strides[0] // 4, q.strides[1] // 4, n, heads, d,
                                        _address(k), _address(v), int(k.dtype == np.float16),
                                        k.strides[0] // k.itemsize, k.strides[1] // k.itemsize, n_kv, start,
                                        window or 0, scale, _address(out), out.strides[0] // 4, self.threads)
        if status != 0:
            raise MemoryError("host kernels: no memory for attention scores")
        return out

    def read_sum(self, words: np.ndarray, threads: int | None = None) -> int:
        """The sum of a uint64 array, read once by `threads` threads (the bench's memory-read baseline)."""
        assert words.dtype == np.uint64 and words.flags.c_contiguous
        return int(self._lib.ks_read_sum(words.ctypes.data, words.size, threads or self.threads))


class _LinearSpec(ctypes.Structure):
    """host_kernels.c's ks_linear_t."""
    _fields_ = [("fmt", _i), ("isa", _i), ("N", _i), ("K", _i), ("glu", _i), ("threads", _i), ("w", _p), ("meta", _p),
                ("w_stride", _z), ("meta_stride", _z), ("norm", _p), ("eps", _f), ("up_w", _z), ("up_meta", _z)]


class Linear:
    """HostKernels.linear's bound projection: `linear(x)` -> float32 [T, N] ([T, N/2] with glu).  The
    weight, the norm and the settings are fixed in a C struct once, so a call passes x and out alone."""
    __slots__ = ("weight", "norm", "glu", "width", "spec_address", "_spec", "_call")

    def __init__(self, kernels: HostKernels, w: "PreparedWeight", norm: np.ndarray | None, eps: float, glu: bool):
        assert not glu or w.rows % 2 == 0
        assert glu or not w.up_w, "a weight whose halves lie apart is a glu weight"
        self.weight, self.glu, self.width = w, glu, w.rows // 2 if glu else w.rows
        self.norm = None if norm is None else np.ascontiguousarray(norm, np.float32)
        assert self.norm is None or self.norm.shape == (w.cols,)
        self._spec = _LinearSpec(w.fmt_id, kernels._isa_id, w.rows, w.cols, int(glu), kernels.threads, w.w_ptr,
                                 w.meta_ptr, w.w_stride, w.meta_stride,
                                 None if self.norm is None else self.norm.ctypes.data, eps, w.up_w, w.up_meta)
        self.spec_address = ctypes.addressof(self._spec)      # host_program.c's ops point here
        self._call = kernels._lib.ks_linear

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        k = self.weight.cols
        if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != k or x.strides[1] != 4:
            x = _float_rows(x, k)
        t = x.shape[0]
        if out is None:
            out = np.empty((t, self.width), np.float32)
        else:
            assert out.dtype == np.float32 and out.shape == (t, self.width) and (self.width < 2 or out.strides[1] == 4)
        if t == 0 or self.width == 0:
            return out
        if self._call(self.spec_address, _address(x), x.strides[0] >> 2, t, _address(out), out.strides[0] >> 2) != 0:
            raise MemoryError(f"host kernels: no memory for {t} x {k} quantized activations")
        return out


class PreparedWeight:
    """A quantized weight checked once for HostKernels.matmul: its format, shape, pointers and row
    strides (repacked: the stride of a group of 16 rows); it holds its arrays, so the pointers stay valid
    while it lives."""
    __slots__ = ("fmt", "fmt_id", "rows", "cols", "w_ptr", "w_stride", "meta_ptr", "meta_stride", "nbytes", "arrays",
                 "up_w", "up_meta")

    def __init__(self, fmt, rows, cols, w_ptr, w_stride, meta_ptr, meta_stride, arrays, fmt_id=None):
        self.fmt, self.rows, self.cols = fmt, rows, cols
        self.up_w = self.up_meta = 0            # glu's up half: right after the gate half (prepare_q8_0_halves)
        self.fmt_id = FORMATS[fmt][0] if fmt_id is None else fmt_id     # the C enum of the layout held
        self.w_ptr, self.w_stride, self.meta_ptr, self.meta_stride = w_ptr, w_stride, meta_ptr, meta_stride
        self.arrays = arrays
        self.nbytes = sum(a.nbytes for a in arrays)

    def file_rows(self, index: np.ndarray | slice) -> np.ndarray:
        """Rows `index` of a Q4_0 / Q4_K / Q6_K weight as the file stores them, uint8 [n, cols/QK * block
        bytes]: a repacked weight's rows gathered back out of their groups (the same bytes), otherwise
        the blocks held."""
        if self.fmt_id == FORMATS[self.fmt][0]:
            return self.arrays[0][index]
        rows = np.arange(self.rows)[index] if isinstance(index, slice) else np.asarray(index)
        source = repacked_source(self.fmt)                                 # [16, block bytes]
        nb = self.cols // FORMATS[self.fmt][1]
        groups = self.arrays[0].reshape(-1, nb, self.w_stride // nb)
        out = groups[(rows // REPACK_ROWS)[:, None, None], np.arange(nb)[None, :, None],
                     source[rows % REPACK_ROWS][:, None, :]]                  # [n, nb, block bytes]
        return out.reshape(len(rows), -1)


def _address(a: np.ndarray) -> int:
    """The address of a's first element: through the buffer protocol where a is writable and
    C-contiguous (a fifth of the cost of a.ctypes.data), else a.ctypes.data."""
    if a.flags.c_contiguous and a.flags.writeable and a.nbytes:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    return a.ctypes.data


def _rows_contiguous(*arrays: np.ndarray) -> None:
    for a in arrays:
        assert a.shape[0] <= 1 or a.strides[0] > 0, "rows in ascending memory order"
        assert a.strides[1] == a.itemsize, "each row contiguous"


def _float_rows(x: np.ndarray, k: int) -> np.ndarray:
    """x as float32 [T, k] with contiguous rows (a copy only when x is not already that)."""
    if x.dtype != np.float32 or x.ndim != 2 or (x.shape[0] > 0 and x.strides[1] != 4):
        x = np.ascontiguousarray(x, np.float32).reshape(-1, k)
    assert x.shape[1] == k, (x.shape, k)
    return x
