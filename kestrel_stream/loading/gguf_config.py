"""A GGUF's metadata as a ModelConfig: llama.cpp's ``{arch}.*`` keys onto config.json's fields, the
experts of Mixtral (arch ``llama``) and qwen3moe, Mistral's sliding window, rope scaling and llama3's
per-frequency factors (the ``rope_freqs`` tensor).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from kestrel_stream.errors import LoadError
from kestrel_stream.loading.gguf_file import GGUFFile
from kestrel_stream.loading.gguf_layout import ROPE_FREQS, ROUTER, VECTOR_TYPES, read_vector
from kestrel_stream.model.config import ConfigError, ModelConfig
from kestrel_stream.model.rope import RopeScaling

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe")
MODEL_TYPES = {"qwen3moe": "qwen3_moe"}      # GGUF arch -> config.json model_type, where they differ


def _metadata(f: GGUFFile, key: str, default=None):
    value = f.metadata(key, default)
    if value is None:
        raise LoadError(f"{f.path}: GGUF metadata key {key!r} is missing")
    # float32 metadata (eps, theta): the shortest decimal that round-trips, e.g. 1e-05, not 9.99e-06
    return float(str(np.float32(value))) if isinstance(value, float) else value


def _rope_scaling(f: GGUFFile, arch: str, max_positions: int) -> RopeScaling | None:
    kind = f.metadata(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    factor = float(_metadata(f, f"{arch}.rope.scaling.factor"))
    original = int(f.metadata(f"{arch}.rope.scaling.original_context_length", max_positions))
    if kind == "linear":
        return RopeScaling("linear", factor)
    if kind == "yarn":
        attention = f.metadata(f"{arch}.rope.scaling.attn_factor", None)
        return RopeScaling("yarn", factor, original,
                           beta_fast=float(f.metadata(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                           beta_slow=float(f.metadata(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
                           attention_factor=None if attention is None else float(attention))
    raise LoadError(f"{f.path}: GGUF rope scaling type {kind!r} is not supported (linear, yarn, or "
                    f"llama3 through {ROPE_FREQS})")


def config_from_metadata(f: GGUFFile, path: Path | None = None) -> ModelConfig:
    path = f.path
    arch = _metadata(f, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise LoadError(f"{path}: GGUF architecture {arch!r} is not supported (only {', '.join(SUPPORTED_ARCHS)})")
    tensors = f.tensors
    if "token_embd.weight" not in tensors:
        raise LoadError(f"{path}: missing tensor 'token_embd.weight'")
    vocab_size = int(tensors["token_embd.weight"].shape[0])

    def meta(key, default=None):
        return _metadata(f, f"{arch}.{key}", default)

    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    max_positions = meta("context_length", 4096)
    d = {
        "model_type": MODEL_TYPES.get(arch, arch), "hidden_size": hidden, "num_hidden_layers": meta("block_count"),
        "intermediate_size": meta("feed_forward_length"), "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": meta("attention.key_length", hidden // heads if isinstance(heads, int) and heads else 0),
        "vocab_size": vocab_size, "rms_norm_eps": meta("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta("rope.freq_base", 10000.0), "max_position_embeddings": max_positions,
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    experts = f.metadata(f"{arch}.expert_count", 0) or 0
    if experts and arch == "llama":         # llama.cpp writes Mixtral as arch llama, with expert tensors
        d.update(model_type="mixtral", num_local_experts=experts, num_experts_per_tok=meta("expert_used_count"))
    elif experts and arch == "qwen3moe":
        layers = d["num_hidden_layers"] if isinstance(d["num_hidden_layers"], int) else 0
        d.update(num_experts=experts, num_experts_per_tok=meta("expert_used_count"),
                 moe_intermediate_size=meta("expert_feed_forward_length"),
                 norm_topk_prob=bool(f.metadata(f"{arch}.expert_weights_norm", True)),   # llama.cpp's default
                 mlp_only_layers=[i for i in range(layers) if f"blk.{i}.{ROUTER}" not in tensors])
    elif experts or arch == "qwen3moe":
        raise LoadError(f"{path}: GGUF architecture {arch!r} with {arch}.expert_count={experts} is not supported")
    window = f.metadata(f"{arch}.attention.sliding_window", None)
    if window and arch == "llama":          # llama.cpp writes Mistral as arch llama
        d["sliding_window"] = int(window)
        d["model_type"] = "mixtral" if experts else "mistral"
    try:
        cfg = ModelConfig.from_dict(d, where=f"{path} (GGUF metadata)")
    except ConfigError as e:
        raise LoadError(str(e)) from None
    scaling = _rope_scaling(f, arch, max_positions)
    factors = None
    if ROPE_FREQS in tensors:
        info = tensors[ROPE_FREQS]
        if info.shape != (cfg.head_dim // 2,) or info.qtype not in VECTOR_TYPES:
            raise LoadError(f"{path}: tensor {ROPE_FREQS!r} has shape {list(info.shape)} and type "
                            f"{info.qtype.name}; expected [{cfg.head_dim // 2}] F32")
        factors = tuple(float(x) for x in read_vector(f, ROPE_FREQS))
    return dataclasses.replace(cfg, rope_scaling=scaling, rope_freq_factors=factors)
