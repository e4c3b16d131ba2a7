"""cuBLAS through ctypes: one handle, fp16 x fp16 -> fp32 GEMMs on our streams.  No model knowledge.

The library comes from the optional `nvidia-cublas` wheel (pyproject's `cublas` extra), found by
cuda.pathfinder.  `load()` returns a Cublas or None -- never raises: without the library (or with one
that does not initialise) the built-in GEMM kernels run, and one line on stderr says so.

cuBLAS is built on the CUDA runtime, which works on the driver context current on the calling thread
(driver.Device makes the primary context current); our streams are CUstream handles, passed as ints.
A user-owned workspace makes the calls safe to capture into a CUDA graph (no allocation inside the
capture).  cublasSetStream resets the workspace to the library's pool, so both are set together
whenever the stream changes.
"""
from __future__ import annotations

import ctypes
import sys

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_R_32F, CUDA_R_16F = 0, 2                 # cudaDataType_t
CUBLAS_COMPUTE_32F = 68                       # cublasComputeType_t: fp32 accumulation
# cublasGemmAlgo_t: the heuristic's choice.  With fp16 operands and fp32 compute it takes the tensor cores
# (the older CUBLAS_GEMM_DEFAULT_TENSOR_OP, 99, is deprecated and means the same)
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_DEFAULT_MATH = 0                       # cublasMath_t

_STATUS = {0: "SUCCESS", 1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE", 8: "ARCH_MISMATCH",
           11: "MAPPING_ERROR", 13: "EXECUTION_FAILED", 14: "INTERNAL_ERROR", 15: "NOT_SUPPORTED",
           16: "LICENSE_ERROR"}


class CublasError(RuntimeError):
    """A cuBLAS call that did not return CUBLAS_STATUS_SUCCESS."""


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasError(f"{what} failed: CUBLAS_STATUS_{_STATUS.get(status, status)}")


def _bind(lib) -> None:
    """Argument and result types of the functions used (cublas_api.h)."""
    vp, i32, size_t = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    signatures = {
        "cublasCreate_v2": [ctypes.POINTER(vp)],
        "cublasDestroy_v2": [vp],
        "cublasGetVersion_v2": [vp, ctypes.POINTER(i32)],
        "cublasSetStream_v2": [vp, vp],
        "cublasSetWorkspace_v2": [vp, vp, size_t],
        "cublasSetMathMode": [vp, i32],
        # handle, transa, transb, m, n, k, alpha*, A, Atype, lda, B, Btype, ldb, beta*, C, Ctype, ldc,
        # computeType, algo
        "cublasGemmEx": [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, vp, i32, i32, vp, vp, i32, i32, i32, i32],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int


class Cublas:
    """One cuBLAS handle on the current context, its workspace at `workspace` (device bytes we own)."""

    def __init__(self, lib, path: str):
        self.lib, self.path = lib, path
        self._handle = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(self._handle)), "cublasCreate")
        version = ctypes.c_int()
        _check(lib.cublasGetVersion_v2(self._handle, ctypes.byref(version)), "cublasGetVersion")
        self.version = version.value              # major * 10000 + minor * 100 + patch
        _check(lib.cublasSetMathMode(self._handle, CUBLAS_DEFAULT_MATH), "cublasSetMathMode")
        self.workspace, self.workspace_bytes = 0, 0
        self._stream: int | None = None
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @property
    def version_text(self) -> str:
        return f"{self.version // 10000}.{self.version // 100 % 100}.{self.version % 100}"

    def use_workspace(self, address: int, nbytes: int) -> None:
        """Every later call works in [address, address + nbytes) (set again with each stream change)."""
        self.workspace, self.workspace_bytes = address, nbytes
        self._stream = None

    def _on(self, stream: int) -> None:
        if stream != self._stream:
            _check(self.lib.cublasSetStream_v2(self._handle, ctypes.c_void_p(stream)), "cublasSetStream")
            if self.workspace:
                _check(self.lib.cublasSetWorkspace_v2(self._handle, ctypes.c_void_p(self.workspace),
                                                      self.workspace_bytes), "cublasSetWorkspace")
            self._stream = stream

    def gemm_nt(self, stream, rows: int, cols: int, depth: int, a: int, lda: int, b: int, ldb: int,
                c: int, ldc: int, accumulate: bool = False) -> None:
        """Row-major C[rows, cols] (fp32, row stride ldc) = A[rows, depth] @ B[cols, depth]^T (+ C when
        `accumulate`), A and B fp16 with row strides lda and ldb, fp32 accumulation, on driver.Stream `stream`.

        In cuBLAS's column-major terms that is C^T = B A^T: op(B) = T, op(A) = N, m = cols, n = rows."""
        self._on(int(stream.handle))
        status = self.lib.cublasGemmEx(
            self._handle, CUBLAS_OP_T, CUBLAS_OP_N, cols, rows, depth, ctypes.byref(self._one),
            ctypes.c_void_p(b), CUDA_R_16F, ldb, ctypes.c_void_p(a), CUDA_R_16F, lda,
            ctypes.byref(self._one if accumulate else self._zero), ctypes.c_void_p(c), CUDA_R_32F, ldc,
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        _check(status, f"cublasGemmEx({rows}x{cols}x{depth})")

    def destroy(self) -> None:
        if self._handle:
            self.lib.cublasDestroy_v2(self._handle)
            self._handle = ctypes.c_void_p()


_loaded: dict[str, object] = {}      # "lib": (CDLL, path) or the reason it is absent


def _library():
    """(ctypes.CDLL, path) of libcublas, or the reason there is none (a string)."""
    if "lib" not in _loaded:
        try:
            from cuda.pathfinder import load_nvidia_dynamic_lib
            found = load_nvidia_dynamic_lib("cublas")
            path = found.abs_path or "libcublas.so.13"      # None: already loaded from elsewhere, by soname
            lib = ctypes.CDLL(path)
            _bind(lib)
            _loaded["lib"] = (lib, path)
        except (ImportError, OSError, RuntimeError, AttributeError) as e:
            # pathfinder's DynamicLibNotFoundError is a RuntimeError; AttributeError: a symbol missing
            _loaded["lib"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return _loaded["lib"]


def available() -> bool:
    """Whether the library loads here (load() may still fail to initialise a handle)."""
    return not isinstance(_library(), str)


def load(log=None) -> Cublas | None:
    """A handle on the current context, or None (and one line to `log`, default stderr) without cuBLAS."""
    found = _library()
    say = log or (lambda line: print(f"kestrel-stream: {line}", file=sys.stderr))
    if isinstance(found, str):
        say(f"cuBLAS not available ({found}): steps of many tokens run the built-in GEMM kernels; "
            f"`pip install 'kestrel-stream[cublas]'` adds it")
        return None
    lib, path = found
    try:
        blas = Cublas(lib, path)
    except CublasError as e:
        say(f"cuBLAS at {path} did not initialise ({e}): steps of many tokens run the built-in GEMM kernels")
        return None
    return blas
