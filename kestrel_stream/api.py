"""`ks.load`: a Hugging Face checkpoint directory or a .gguf file in, an engine with its tokenizer out.

The package's top level re-exports it (`ks.load`); modules inside the package import it from here.
"""
from __future__ import annotations

from functools import partial

from kestrel_stream.run.engine import Engine, resolve_device


def load(path, device: str = "auto", mode: str = "auto", vram_budget=None, max_seq_len: int | None = None,
         max_batch: int = 32, max_sessions: int | None = None, cache: bool = True, progress=None,
         kv_dtype: str = "f16", cpu_threads: int | None = None, gguf_blocks: str = "native",
         hf_file: str | None = None) -> Engine:
    """Load a Hugging Face checkpoint directory or a .gguf file and build an engine for it.

    path may also name a model on the Hugging Face Hub (loading/hub.py): "org/repo" (a safetensors
    checkpoint), "org/repo:FILE.gguf" or "org/repo:Q4_K_M" (a GGUF; or hf_file="FILE"), downloaded once into
    huggingface_hub's cache; a local path wins over a name it could also be.

    kv_dtype: gpu mode's KV cache, "f16" (default) or "f32" (the reference arithmetic).
    cpu_threads: the host's threads, process-wide: the native host kernels' and BLAS's (None: the
    physical cores, BLAS's default; 1 where other processes share the cores, see run/blas_threads.py).
    gguf_blocks: "native" runs a GGUF's Q4_0 / Q4_K / Q6_K tensors in their own blocks (default),
    "q8_0" converts them to Q8_0 at load."""
    from kestrel_stream.loading.hub import resolve_model
    from kestrel_stream.loading.loader import load_weights
    from kestrel_stream.obs import prof
    from kestrel_stream.obs.load_stages import stage
    from kestrel_stream.options import Options
    from kestrel_stream.run.blas_threads import set_cpu_threads
    from kestrel_stream.text.lazy_tokenizer import LazyTokenizer
    options = Options.from_env(vram_budget=vram_budget, host_threads=cpu_threads)   # every KESTREL_* setting, once
    path = resolve_model(path, hf_file)
    set_cpu_threads(cpu_threads)
    with stage("resolve device"):
        device, mode = resolve_device(device, mode)
    if options.prof:
        prof.enable()               # before loading: the table has the load's stage times too
    with stage("weights: read, split, fuse"):
        weights = load_weights(path, cache=cache, progress=progress, gguf_blocks=gguf_blocks)
    with stage("engine: executor"):
        engine = Engine(weights, device=device, mode=mode, max_seq_len=max_seq_len, max_batch=max_batch,
                        max_sessions=max_sessions, options=options, kv_dtype=kv_dtype)
    # built on first use (engine.tokenizer): token-id callers never pay for it, text callers pay once
    engine.tokenizer = LazyTokenizer(partial(_load_tokenizer, path), str(path))
    return engine


def _load_tokenizer(path):
    from kestrel_stream.text.tokenizer import load_tokenizer      # the tokenizers library: only when built
    return load_tokenizer(path)
