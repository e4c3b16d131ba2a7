"""CUDA device layer: driver calls, memory, kernel build and launch; no model knowledge.

Importing the package needs neither a driver nor cuda.bindings (the CPU-only install imports
kestrel_stream.cuda.gemv_variants); `driver.gpu_available()` probes once.
"""
