"""CUDA device layer and GPU executor.  Importing needs no driver; `gpu_available()` probes once."""
from kestrel_stream.cuda.driver import CudaError, detect, gpu_available, gpu_status

__all__ = ["CudaError", "detect", "gpu_available", "gpu_status"]
