"""Driver call results: CudaError and check(), below both the driver and the memory layer."""
from __future__ import annotations

from cuda.bindings import driver as cu


class CudaError(RuntimeError):
    """A driver call that did not return CUDA_SUCCESS."""


def check(result, what: str = "CUDA call"):
    """Unpack a cuda.bindings ``(err, *outputs)`` tuple; raise on error, return the outputs."""
    err, *outputs = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        text = name.decode() if isinstance(name, bytes) else str(err)
        raise CudaError(f"{what} failed: {text}")
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else tuple(outputs)
