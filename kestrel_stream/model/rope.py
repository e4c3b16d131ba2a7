"""Rotary position embedding: every scaling type as one inverse-frequency table.

Each backend rotates with ``angle = pos * inv_freq[i]`` (HF rotate_half
layout), so default, linear, Llama 3 and YaRN scaling differ only in the
[D/2] table built here, once per model, with Hugging Face's float32
arithmetic (transformers.modeling_rope_utils).  YaRN also scales cos and sin
by ``attention_factor``; the CPU engine multiplies its tables as HF does, and
the GPU folds the factor's square into the attention scale (q and k are both
rotated, so the logits carry it twice).  A GGUF's ``rope_freqs.weight`` holds
llama.cpp's per-frequency divisors, applied to the default table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    type: str                                   # linear | llama3 | yarn
    factor: float
    original_max_position_embeddings: int = 0   # llama3 and yarn
    low_freq_factor: float = 1.0                # llama3
    high_freq_factor: float = 4.0               # llama3
    beta_fast: float = 32.0                     # yarn
    beta_slow: float = 1.0                      # yarn
    attention_factor: float | None = None       # yarn: None → 0.1 ln(factor) + 1
    truncate: bool = True                       # yarn


def parse_rope_scaling(rope: dict, max_position_embeddings: int, where: str) -> RopeScaling | None:
    """A config.json ``rope_scaling`` / ``rope_parameters`` object; None for the default rope."""
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type == "default":
        return None
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{where}: rope scaling type {rope_type!r} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    factor = rope.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise ValueError(f"{where}: rope scaling {rope_type!r} needs a positive 'factor', got {factor!r}")
    original = int(rope.get("original_max_position_embeddings") or max_position_embeddings)
    if rope_type == "linear":
        return RopeScaling("linear", float(factor))
    if rope_type == "llama3":
        low, high = rope.get("low_freq_factor"), rope.get("high_freq_factor")
        if not all(isinstance(v, (int, float)) for v in (low, high)) or low >= high:
            raise ValueError(f"{where}: llama3 rope scaling needs low_freq_factor < high_freq_factor, "
                             f"got {low!r} and {high!r}")
        return RopeScaling("llama3", float(factor), original, float(low), float(high))
    if rope.get("mscale") or rope.get("mscale_all_dim"):
        raise ValueError(f"{where}: yarn rope scaling with mscale/mscale_all_dim is not supported")
    attention = rope.get("attention_factor")
    return RopeScaling("yarn", float(factor), original, beta_fast=float(rope.get("beta_fast") or 32),
                       beta_slow=float(rope.get("beta_slow") or 1),
                       attention_factor=None if attention is None else float(attention),
                       truncate=bool(rope.get("truncate", True)))


def default_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """[D/2] float32: 1 / theta^(2i/D), as HF computes it."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)


def inv_freq(cfg) -> np.ndarray:
    """The model's [D/2] float32 inverse frequencies, scaling applied."""
    base = default_inv_freq(cfg.head_dim, cfg.rope_theta)
    if cfg.rope_freq_factors is not None:
        return (base / np.asarray(cfg.rope_freq_factors, np.float32)).astype(np.float32)
    s = cfg.rope_scaling
    if s is None:
        return base
    if s.type == "linear":
        return (base / np.float32(s.factor)).astype(np.float32)
    if s.type == "llama3":
        return _llama3(base, s)
    return _yarn(cfg.head_dim, cfg.rope_theta, s)


def attention_factor(cfg) -> float:
    """What cos and sin are multiplied by (YaRN's mscale; 1 for every other type)."""
    s = cfg.rope_scaling
    if s is None or s.type != "yarn":
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor
    return 1.0 if s.factor <= 1 else 0.1 * math.log(s.factor) + 1.0


def softmax_scale(cfg) -> float:
    """The GPU's attention scale: 1/sqrt(D), times attention_factor^2 (cos and sin unscaled there)."""
    return attention_factor(cfg) ** 2 / math.sqrt(cfg.head_dim)


def _llama3(base: np.ndarray, s: RopeScaling) -> np.ndarray:
    factor = np.float32(s.factor)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = (np.float32(2 * math.pi) / base).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, base / factor, base).astype(np.float32)
    smooth = ((np.float32(s.original_max_position_embeddings) / wavelen - np.float32(s.low_freq_factor))
              / np.float32(s.high_freq_factor - s.low_freq_factor)).astype(np.float32)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(head_dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_weight = (1 - ramp).astype(np.float32)
    pos_freqs = (np.float32(theta) ** (np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim))
                 ).astype(np.float32)
    extrapolation = (1.0 / pos_freqs).astype(np.float32)
    interpolation = (1.0 / (np.float32(s.factor) * pos_freqs)).astype(np.float32)
    return (interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight).astype(np.float32)


def cos_sin(positions: np.ndarray, freqs: np.ndarray, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: [T, D] float32 for integer positions [T] (HF's float32 computation, times ``scale``)."""
    angles = positions.astype(np.float32)[:, None] * freqs[None, :]
    emb = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    if scale != 1.0:
        cos, sin = cos * np.float32(scale), sin * np.float32(scale)
    return cos, sin
