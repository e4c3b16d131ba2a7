"""CUDA C++ kernel sources of kestrel-stream and their NVRTC build (see build.py)."""
from .build import KERNEL_SOURCES, compile_cubin, source_dir

__all__ = ["KERNEL_SOURCES", "compile_cubin", "source_dir"]
