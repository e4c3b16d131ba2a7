"""`ks.load`: a Hugging Face checkpoint directory or a .gguf file in, an engine with its tokenizer out.

The package's top level re-exports it (`ks.load`); modules inside the package import it from here.
"""
from __future__ import annotations

from functools import partial

from kestrel_stream.run.device_choice import check_ordinal, split_device
from kestrel_stream.run.engine import Engine, resolve_device

DRAFT_SESSIONS = 4      # a draft model's KV pool on a GPU: sessions of max_seq_len (one per generation)
KV_BLOCK = 16           # gpu mode's KV block (positions)


def load(path, device: str = "auto", mode: str = "auto", vram_budget=None, max_seq_len: int | None = None,
         max_batch: int = 32, max_sessions: int | None = None, cache: bool = True, progress=None,
         kv_dtype: str = "f16", cpu_threads: int | None = None, gguf_blocks: str = "native",
         hf_file: str | None = None, draft=None, spec: str | None = None, draft_max: int = 8,
         spec_policy: str = "auto", blas_threads: int | None = None) -> Engine:
    """Load a Hugging Face checkpoint directory or a .gguf file and build an engine for it.

    path may also name a model on the Hugging Face Hub (loading/hub.py): "org/repo" (a safetensors
    checkpoint), "org/repo:FILE.gguf" or "org/repo:Q4_K_M" (a GGUF; or hf_file="FILE"), downloaded once into
    huggingface_hub's cache; a local path wins over a name it could also be.

    device: "auto", "cpu", "cuda" (GPU 0) or "cuda:N" (GPU N; the daemon's replicas, one engine per GPU).
    kv_dtype: gpu mode's KV cache, "f16" (default) or "f32" (the reference arithmetic).
    cpu_threads: the host's threads, process-wide: the native host kernels' and BLAS's (None: the
    physical cores, BLAS's default; 1 where other processes share the cores, see run/blas_threads.py).
    blas_threads: numpy's BLAS threads alone (None: KESTREL_BLAS_THREADS, else 1 on the CPU engine over the
    native host kernels, whose pool runs the projections, and cpu_threads in the other modes).
    gguf_blocks: "native" runs a GGUF's Q4_0 / Q4_K / Q6_K tensors in their own blocks (default),
    "q8_0" converts them to Q8_0 at load.

    draft: a draft model for speculative decoding (a path or a hub name, as `path`), whose tokenizer must be
    the target's: loaded first, on the same device, every weight resident (gpu mode) with its own KV.  On a
    GPU it takes its share of the VRAM first (its weights and a KV pool of DRAFT_SESSIONS sessions): a byte
    `vram_budget` is the pair's (the target gets what the draft leaves), a fraction or no budget applies
    to the VRAM the draft left free.  spec="lookup": prompt
    lookup instead (no model).  draft_max: the longest drafted chain.  spec_policy: "auto" (the cost model
    sets each round's length from the target's measured pass times and the acceptance, and turns speculation
    off where it would not pay) or "always" (every round drafts, its length following the acceptance alone);
    engine.generate speculates by default once the engine has a draft."""
    from kestrel_stream.loading.hub import resolve_model
    from kestrel_stream.loading.loader import load_weights
    from kestrel_stream.obs import prof
    from kestrel_stream.obs.load_stages import stage
    from kestrel_stream.options import Options
    from kestrel_stream.run.host.backend import native_kernels
    from kestrel_stream.run.blas_threads import check_threads, engine_blas_threads, set_cpu_threads
    from kestrel_stream.text.lazy_tokenizer import LazyTokenizer
    check_threads(blas_threads, "blas_threads")
    given = {} if blas_threads is None else {"blas_threads": blas_threads}
    options = Options.from_env(vram_budget=vram_budget, host_threads=cpu_threads, **given)   # every setting, once
    path = resolve_model(path, hf_file)
    set_cpu_threads(cpu_threads)
    with stage("resolve device"):
        _, ordinal = split_device(device)
        device, mode = resolve_device(device, mode)
        if ordinal:
            check_ordinal(ordinal)
            options = options.with_(device_ordinal=ordinal)
    if options.prof:
        prof.enable()               # before loading: the table has the load's stage times too
    with stage("weights: read, split, fuse"):
        weights = load_weights(path, cache=cache, progress=progress, gguf_blocks=gguf_blocks)
    # built on first use (engine.tokenizer): token-id callers never pay for it, text callers pay once
    tokenizer = LazyTokenizer(partial(_load_tokenizer, path), str(path))
    speculation = None
    if draft is not None or spec is not None:
        with stage("draft"):
            speculation = _speculation(draft, spec, draft_max, spec_policy, weights, tokenizer, path, device,
                                       options, max_seq_len, kv_dtype, cache, gguf_blocks)
        options = options.with_(vram_budget=_target_budget(speculation, options.vram_budget, device))
    try:
        with stage("engine: executor"):
            engine = Engine(weights, device=device, mode=mode, max_seq_len=max_seq_len, max_batch=max_batch,
                            max_sessions=max_sessions, options=options, kv_dtype=kv_dtype)
    except BaseException:
        if speculation is not None:
            speculation.close()
        raise
    engine.tokenizer = tokenizer
    engine.speculation = speculation
    native = engine.mode == "cpu" and native_kernels(options) is not None     # built by the engine: cached
    set_cpu_threads(engine_blas_threads(options, engine.mode, native))
    return engine


def _load_tokenizer(path):
    from kestrel_stream.text.tokenizer import load_tokenizer      # the tokenizers library: only when built
    return load_tokenizer(path)


def _speculation(draft, spec, draft_max, policy, target_weights, target_tokenizer, target_path, device, options,
                 max_seq_len, kv_dtype, cache, gguf_blocks):
    """The Speculation of ks.load's draft= / spec=: prompt lookup, or a draft model loaded and checked."""
    from kestrel_stream.loading.hub import resolve_model
    from kestrel_stream.loading.loader import load_weights
    from kestrel_stream.run.engine import DEFAULT_MAX_SEQ_LEN
    from kestrel_stream.spec.speculation import SPEC_KINDS, Speculation
    from kestrel_stream.spec.vocab_check import check_same_vocabulary
    if spec is not None and spec not in SPEC_KINDS:
        raise ValueError(f"spec={spec!r}: expected one of {', '.join(SPEC_KINDS)} (a draft model goes in draft=)")
    if spec is not None and draft is not None:
        raise ValueError(f"draft={draft!r} and spec={spec!r}: give one draft, a model or prompt lookup")
    Speculation.check_policy(policy)
    if spec == "lookup":
        return Speculation.lookup(draft_max, policy)
    Speculation.check_draft_max(draft_max)
    draft_path = resolve_model(draft)
    draft_weights = load_weights(draft_path, cache=cache, gguf_blocks=gguf_blocks)
    target_len = max_seq_len or min(DEFAULT_MAX_SEQ_LEN, target_weights.config.max_position_embeddings)
    check_same_vocabulary(target_tokenizer.get(), _load_tokenizer(draft_path), target_weights.config.vocab_size,
                          draft_weights.config.vocab_size, target_path, draft_path)
    draft_len = min(target_len, draft_weights.config.max_position_embeddings)
    kv_pool_bytes = _draft_kv_pool_bytes(draft_weights.config, draft_len, kv_dtype) if device == "cuda" else None
    # one session a step (a generation's); every weight resident where it fits, the KV pool fixed
    draft_engine = Engine(draft_weights, device=device, mode="gpu" if device == "cuda" else "cpu",
                          max_seq_len=draft_len, max_batch=1, options=options.with_(vram_budget=None),
                          kv_dtype=kv_dtype, kv_pool_bytes=kv_pool_bytes)
    draft_engine.tokenizer = None           # its tokens are the target's (checked above)
    return Speculation.model(draft_engine, target_weights.config.vocab_size, draft_max, policy)


def _draft_kv_pool_bytes(config, max_seq_len: int, kv_dtype: str) -> int:
    """A draft's KV pool on a GPU: DRAFT_SESSIONS sessions of max_seq_len and the scratch block, fixed."""
    from scheduler.kv_pool import kv_bytes_per_position
    per_position = kv_bytes_per_position(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                                         kv_dtype)
    return (DRAFT_SESSIONS * -(-max_seq_len // KV_BLOCK) + 1) * KV_BLOCK * per_position


def _target_budget(speculation, budget, device: str):
    """The target's VRAM budget once a draft model took its share of a byte budget (gpu)."""
    share = speculation.device_bytes()
    if device != "cuda" or not isinstance(budget, int) or not share:
        return budget
    if share >= budget:
        speculation.close()
        from kestrel_stream.errors import DeviceError
        raise DeviceError(f"--vram-budget {budget / 2**20:.0f} MiB: the draft model alone takes "
                          f"{share / 2**20:.0f} MiB (weights, KV and buffers, all resident); give a larger budget "
                          f"or a smaller draft")
    return budget - share
