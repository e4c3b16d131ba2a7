"""The host backend's arithmetic: numpy, the numerical reference for every GPU kernel.

The host program (program.py) binds the step program's op kinds to these functions.

Arithmetic, all float32 (matching Hugging Face transformers run in float32 on
the same dequantized weights):
    rmsnorm(x, w)   = w * x / sqrt(mean(x^2) + eps)
    linear(x, W)    = x @ dequant(W).T          (BLAS sgemm; M = tokens in the step)
    rope (HF rotate_half / NeoX style): inv_freq[i] = theta^(-2i/D), angle = pos * inv_freq,
                      x' = x * cos(cat(a, a)) + cat(-x2, x1) * sin(cat(a, a))
    attention       = softmax(q k^T / sqrt(D) + causal mask) v, GQA: q head h reads kv head h // group
    mlp             = down(silu(gate(x)) * up(x)),  silu(g) = g / (1 + exp(-g))
Qwen3 additionally rmsnorms every q and k head over D (q_norm, k_norm) before RoPE; Qwen2 adds its
q/k/v bias to the projection; rope scaling (linear, llama3, yarn) is the inverse-frequency table of
model/rope.py; a sliding window (Mistral) lets query position p see keys p - window + 1 .. p.
A routed MLP (Qwen3-MoE, Mixtral) sends each token to k experts chosen by `route` and sums their mlp outputs
weighted by the router's probabilities.
"""
from __future__ import annotations

import functools

import numpy as np

from kestrel_stream.model.config import ModelConfig
from kestrel_stream.model import rope as rope_math


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    # x: [..., n] float32.  np.mean's own arithmetic (a pairwise float32 sum, then a division by the count
    # as an intp, rounded back to float32), without its Python-level argument handling.
    var = np.add.reduce(np.square(x), axis=-1, keepdims=True)
    np.true_divide(var, np.intp(x.shape[-1]), out=var, casting="unsafe")
    var += np.float32(eps)
    return (x / np.sqrt(var, out=var)) * w


def rope_tables(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: [T, D] float32 for integer positions [T] (HF's float32 computation), unscaled rope."""
    return rope_math.cos_sin(positions, rope_math.default_inv_freq(head_dim, theta))


def model_rope_tables(positions: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: [T, D] float32 with the model's rope scaling (and YaRN's attention factor) applied."""
    return rope_math.cos_sin(positions, rope_math.inv_freq(cfg), rope_math.attention_factor(cfg))


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    # x: [T, heads, D]; cos, sin: [T, D]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_rotation(cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """apply_rope's tables in the form ``rotate`` takes: cos and sin with the second half's sign folded
    into the first half of sin, both [T, 1, D], and the index that swaps the halves of the last axis."""
    half = cos.shape[-1] // 2
    signed = sin.copy()
    signed[:, :half] = -signed[:, :half]
    swap = np.concatenate([np.arange(half, 2 * half), np.arange(half)])
    return cos[:, None, :], signed[:, None, :], swap


def rotate(x: np.ndarray, cos: np.ndarray, signed_sin: np.ndarray, swap: np.ndarray) -> np.ndarray:
    """apply_rope in four calls, the same numbers: cat(-x2, x1) * sin == cat(x2, x1) * cat(-s1, s2) exactly."""
    return x * cos + x.take(swap, axis=-1) * signed_sin


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return gate / (np.float32(1) + np.exp(-gate)) * up


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, window: int | None = None,
              visible: np.ndarray | None = None) -> np.ndarray:
    """q: [n, n_heads, D] at positions start..start+n-1; k, v: [S, n_kv, D] with S = start + n.

    Returns [n, n_heads * D].  Query i sees keys 0..start+i (causal), only the last ``window`` of them
    when a sliding window is set; a token tree's rows (run/token_tree.py) see the keys `visible` [n, S]
    marks instead (no sliding window: trees are refused for those models).
    """
    n, n_heads, d = q.shape
    if visible is not None:
        return _masked_attention(q, k, v, visible)
    if window is not None:
        first = max(0, k.shape[0] - n - window + 1)      # the oldest key this step's first query sees
        k, v, start = k[first:], v[first:], start - first
    s, n_kv, _ = k.shape
    group = n_heads // n_kv
    qg = q.reshape(n, n_kv, group, d).transpose(1, 2, 0, 3)          # [n_kv, g, n, D]
    kt = k.transpose(1, 2, 0)[:, None]                               # [n_kv, 1, D, S]
    scores = (qg @ kt) * attention_scale(d)                          # [n_kv, g, n, S]
    if n > 1:
        query_pos, key_pos = (start + np.arange(n))[:, None], np.arange(s)[None, :]
        visible = key_pos <= query_pos                                   # [n, S]
        if window is not None:
            visible &= key_pos > query_pos - window
        scores = np.where(visible, scores, np.float32(-np.inf))
    # ufunc reductions called directly: what ndarray.max / .sum run, without their Python-level wrappers
    scores -= np.maximum.reduce(scores, axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= np.add.reduce(probs, axis=-1, keepdims=True)
    out = probs @ v.transpose(1, 0, 2)[:, None]                      # [n_kv, g, n, D]
    return out.transpose(2, 0, 1, 3).reshape(n, n_heads * d)


def _masked_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray) -> np.ndarray:
    n, n_heads, d = q.shape
    s, n_kv, _ = k.shape
    group = n_heads // n_kv
    qg = q.reshape(n, n_kv, group, d).transpose(1, 2, 0, 3)
    scores = (qg @ k.transpose(1, 2, 0)[:, None]) * attention_scale(d)
    scores = np.where(visible, scores, np.float32(-np.inf))
    scores -= np.maximum.reduce(scores, axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= np.add.reduce(probs, axis=-1, keepdims=True)
    out = probs @ v.transpose(1, 0, 2)[:, None]
    return out.transpose(2, 0, 1, 3).reshape(n, n_heads * d)


@functools.cache
def attention_scale(d: int) -> np.float32:
    return np.float32(1.0 / np.sqrt(d))


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, float32 (the row max subtracted first)."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def route(logits: np.ndarray, k: int, softmax_first: bool, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """The k experts each token uses and their weights, from the router's logits [T, E] float32:
    (ids [T, k] int64, weights [T, k] float32), the highest first.

    softmax_first (Qwen3-MoE): softmax over every expert, the top k, renormalized to sum to 1 when
    `normalize`; else (Mixtral) the top k logits, softmax over them.  Ties go to the lowest expert id (a
    stable sort), so the choice is the same on every run and every machine."""
    scores = softmax(logits) if softmax_first else logits
    ids = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    chosen = np.take_along_axis(scores, ids, axis=-1)
    if not softmax_first:
        return ids, softmax(chosen)
    if normalize:
        chosen = chosen / chosen.sum(axis=-1, keepdims=True)
    return ids, chosen
