"""The host backend: numpy arithmetic, the numerical reference for every GPU kernel.

cpu mode's executor (step_executor.py) hands each step to HostBackend.forward whole; gated and
layers=N run its functions one op at a time (hybrid_host.py); KESTREL_VERIFY recomputes the GPU's
steps on it (verify.py).

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

Dequantized weights are built once per weight on first use and kept (one
float copy of the model); the embedding is never dequantized whole unless it is
also the (tied) lm_head.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from kestrel_stream.obs import trace
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.model import rope as rope_math
from kestrel_stream.model.quant import QTensor
from kestrel_stream.model.quant4 import tensor_key
from kestrel_stream.model.weights import ModelWeights
from kestrel_stream.run.executor import StepCounters


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


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, window: int | None = None) -> np.ndarray:
    """q: [n, n_heads, D] at positions start..start+n-1; k, v: [S, n_kv, D] with S = start + n.

    Returns [n, n_heads * D].  Query i sees keys 0..start+i (causal), only the last ``window`` of them
    when a sliding window is set.
    """
    n, n_heads, d = q.shape
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


@functools.cache
def attention_scale(d: int) -> np.float32:
    return np.float32(1.0 / np.sqrt(d))


@dataclass
class CpuKV:
    """One session's KV cache on the host: k, v [L, max_seq_len, n_kv, D] float32."""
    k: np.ndarray
    v: np.ndarray

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


class HostBackend:
    """Runs whole steps (any mix of sessions and token counts) with numpy; counts into `counters`
    (the executor's; default: its own)."""

    def __init__(self, weights: ModelWeights, counters: StepCounters | None = None):
        self.weights = weights
        self.config: ModelConfig = weights.config
        self._dequantized: dict[int, np.ndarray] = {}
        self._by_object: dict[int, tuple] = {}
        # Norm weights as plain float32 arrays (a memory-mapped one would make every result it touches a
        # memmap, each with a Python-level finalizer); q_norm and k_norm stacked per head, [q + kv heads, D].
        plain = lambda a: np.array(a, np.float32)   # noqa: E731
        c = self.config
        self.norms = [(plain(lw.attn_norm), plain(lw.mlp_norm),
                       np.concatenate([np.broadcast_to(plain(lw.q_norm), (c.num_attention_heads, c.head_dim)),
                                       np.broadcast_to(plain(lw.k_norm), (c.num_key_value_heads, c.head_dim))])
                       if c.qk_norm else None) for lw in weights.layers]
        self.final_norm = plain(weights.final_norm)
        self.qkv_bias = [plain(lw.qkv_bias) if lw.qkv_bias is not None else None for lw in weights.layers]
        self._cos = self._sin = np.zeros((0, 1, c.head_dim), np.float32)
        self._swap = np.zeros(0, np.int64)
        self.counters = StepCounters.counting("cpu_weight_read_bytes") if counters is None else counters

    def plan(self, tokens: int):
        import scheduler
        return scheduler.build_plan(self.config, tokens, "cpu")

    def dense(self, w: QTensor) -> np.ndarray:
        """float32 copy of a linear weight (Q8_0 or a block format), built on first use."""
        return self._weight(w)[1]

    def _weight(self, w) -> tuple:
        """(w, its float32 copy, its stored bytes), looked up by the object first: a step's projections
        skip tensor_key and nbytes (the entry keeps `w`, so its id is not reused)."""
        entry = self._by_object.get(id(w))
        if entry is None:
            key = tensor_key(w)
            if key not in self._dequantized:
                self._dequantized[key] = w.dequantize()
            entry = self._by_object[id(w)] = (w, self._dequantized[key], w.nbytes)
        return entry

    def linear(self, x: np.ndarray, w: QTensor, op: str = "linear", layer: int = -1) -> np.ndarray:
        _, dense, nbytes = self._weight(w)
        self.counters.cpu_weight_read_bytes += nbytes
        if trace.active is None:
            return x @ dense.T
        rows, cols = w.shape
        with trace.span(op, op=op, layer=layer, flops=2 * x.shape[0] * rows * cols, bytes=nbytes):
            return x @ dense.T

    def alloc_kv(self, max_seq_len: int) -> CpuKV:
        c = self.config
        shape = (c.num_hidden_layers, max_seq_len, c.num_key_value_heads, c.head_dim)
        return CpuKV(np.zeros(shape, np.float32), np.zeros(shape, np.float32))

    def free_kv(self, kv: CpuKV) -> None:
        pass

    def close(self) -> None:
        pass        # numpy arrays only

    def kv_stats(self) -> dict:
        return {}        # one float32 cache per session, no pool

    def truncate_kv(self, kv: CpuKV, length: int) -> None:
        pass        # positions past `length` are written again before any step reads them

    def fork_kv(self, kv: CpuKV, length: int, capacity: int | None = None) -> CpuKV:
        """A new cache of `capacity` positions (default kv's) holding the first `length` of `kv`."""
        new = self.alloc_kv(capacity or kv.capacity)
        new.k[:, :length] = kv.k[:, :length]
        new.v[:, :length] = kv.v[:, :length]
        return new

    def forward_greedy(self, batch: list[tuple[CpuKV, np.ndarray, int]]) -> np.ndarray:
        """Each session's greedy next token (argmax of its last logits row): int64 [len(batch)]."""
        return np.array([int(np.argmax(rows[-1])) for rows in self.forward(batch, logits="last")], np.int64)

    def rope(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, signed sin [T, 1, D] for positions [T] (rope_rotation's form): rows of tables built once for
        every position so far (each row's arithmetic is rope_tables' own), so a step indexes them."""
        need = int(positions.max()) + 1
        if need > len(self._cos):
            size = max(need, 2 * len(self._cos), 64)
            self._cos, self._sin, self._swap = rope_rotation(*model_rope_tables(np.arange(size), self.config))
        return self._cos[positions], self._sin[positions]

    def forward(self, batch: list[tuple[CpuKV, np.ndarray, int]], logits: str = "all") -> list[np.ndarray]:
        """batch: (kv, token ids [n_i], start position) per session → logits [n_i, V] each, or with
        logits="last" each session's last row only, [1, V] (lm_head runs on those rows alone).

        All sessions' tokens go through every projection as one [T, K] matmul
        (T = Σ n_i); attention runs per session over its own cache.  Q and K
        heads are normed and rotated together, one [T, q + kv heads, D] array.
        """
        c, w, eps = self.config, self.weights, self.config.rms_norm_eps
        if len(batch) == 1:
            ids = np.asarray(batch[0][1], np.int64)
            positions = np.arange(batch[0][2], batch[0][2] + len(ids))
        else:
            ids = np.concatenate([np.asarray(t, np.int64) for _, t, _ in batch])
            positions = np.concatenate([np.arange(p, p + len(t)) for _, t, p in batch])
        bounds = [0]
        for _, t, _ in batch:
            bounds.append(bounds[-1] + len(t))
        cos, sin = self.rope(positions)
        heads, qk_size = c.num_attention_heads + c.num_key_value_heads, c.q_size + c.kv_size
        with trace.span("embed", op="embed"):
            dense_embed = self._dequantized.get(tensor_key(w.embed))             # built when it is the tied lm_head
            x = dense_embed[ids] if dense_embed is not None else w.embed.dequantize_rows(ids)    # [T, H]
        self.counters.cpu_weight_read_bytes += len(ids) * w.embed.nbytes // w.embed.shape[0]
        window = c.sliding_window
        for li, (layer, norms, bias) in enumerate(zip(w.layers, self.norms, self.qkv_bias)):
            attn_norm, mlp_norm, qk_norm = norms
            qkv = self.linear(rmsnorm(x, attn_norm, eps), layer.wqkv, "qkv", li)    # [T, q + 2kv]
            if bias is not None:
                qkv += bias
            qk = qkv[:, :qk_size].reshape(-1, heads, c.head_dim)
            if qk_norm is not None:
                qk = rmsnorm(qk, qk_norm, eps)
            qk = rotate(qk, cos, sin, self._swap)
            q, k = qk[:, :c.num_attention_heads], qk[:, c.num_attention_heads:]
            v = qkv[:, qk_size:].reshape(-1, c.num_key_value_heads, c.head_dim)
            with trace.span("attention", op="attention", layer=li):
                if len(batch) == 1:                 # one session: no slicing by session, no copy into attn
                    kv, _, start = batch[0]
                    end = start + len(ids)
                    kv.k[li, start:end] = k
                    kv.v[li, start:end] = v
                    attn = attention(q, kv.k[li, :end], kv.v[li, :end], start, window)
                else:
                    attn = np.empty((len(ids), c.q_size), np.float32)
                    for (kv, _, start), lo, hi in zip(batch, bounds[:-1], bounds[1:]):
                        end = start + (hi - lo)
                        kv.k[li, start:end] = k[lo:hi]
                        kv.v[li, start:end] = v[lo:hi]
                        attn[lo:hi] = attention(q[lo:hi], kv.k[li, :end], kv.v[li, :end], start, window)
            x = x + self.linear(attn, layer.wo, "wo", li)
            gu = self.linear(rmsnorm(x, mlp_norm, eps), layer.w_gate_up, "gate_up", li)
            x = x + self.linear(silu_mul(gu[:, :c.intermediate_size], gu[:, c.intermediate_size:]), layer.w_down,
                                "down", li)
        if logits == "last":
            x, bounds = x[np.asarray(bounds[1:]) - 1], list(range(len(batch) + 1))
        out = self.linear(rmsnorm(x, self.final_norm, eps), w.lm_head, "lm_head")
        self.counters.steps += 1
        self.counters.tokens += len(ids)
        return [out[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
