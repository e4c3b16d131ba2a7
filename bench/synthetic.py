"""Synthetic weights for the tests and benches: a random Q8_0 model drawn directly, and random GGUF blocks.

Neither is a way to load a model; the library's own random checkpoints (the tiny demo preset) are
written and quantised by kestrel_stream.loading.presets.
"""
from __future__ import annotations

import numpy as np

from kestrel_stream.loading.presets import PRESETS
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.model.quant4 import BLOCK_FORMATS


def random_q8_weights(preset: str | ModelConfig, seed: int = 0):
    """ModelWeights with random Q8_0 values drawn directly: no float matrices, no quantization pass.

    For benchmarks of the large presets, where writing and quantizing a checkpoint
    would cost more than the measurement.  Scales keep activations finite as in
    ``random_tensor`` (int8 values ~ U[-127, 127] have std ~73).
    """
    from kestrel_stream.model.quant import QTensor
    from kestrel_stream.model.weights import LayerWeights, ModelWeights, MoeWeights
    cfg = PRESETS[preset] if isinstance(preset, str) else preset
    rng = np.random.default_rng(seed)

    def linear(rows: int, cols: int, scale: float) -> QTensor:
        return QTensor(rng.integers(-127, 128, (rows, cols), dtype=np.int8),
                       np.full((rows, cols // 32), scale / 73.0, np.float16))

    def norm(size: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(size, dtype=np.float32)).astype(np.float32)

    H, I, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    E, expert_I = cfg.num_experts, cfg.moe_intermediate_size
    residual_scale = 1.0 / np.sqrt(2 * L)

    def experts() -> MoeWeights:         # a routed layer: the router float32, the experts stacked
        router = (rng.standard_normal((E, H), dtype=np.float32) / np.float32(np.sqrt(H))).astype(np.float32)
        return MoeWeights(router, linear(E * 2 * expert_I, H, 1 / np.sqrt(H)),
                          linear(E * H, expert_I, residual_scale / np.sqrt(expert_I)))

    layers = [LayerWeights(norm(H), linear(cfg.q_size + 2 * cfg.kv_size, H, 1 / np.sqrt(H)),
                           linear(H, cfg.q_size, residual_scale / np.sqrt(cfg.q_size)), norm(H),
                           None if cfg.moe_layer(i) else linear(2 * I, H, 1 / np.sqrt(H)),
                           None if cfg.moe_layer(i) else linear(H, I, residual_scale / np.sqrt(I)),
                           norm(cfg.head_dim) if cfg.qk_norm else None, norm(cfg.head_dim) if cfg.qk_norm else None,
                           moe=experts() if cfg.moe_layer(i) else None)
              for i in range(L)]
    embed = linear(cfg.vocab_size, H, 0.02)
    lm_head = embed if cfg.tie_word_embeddings else linear(cfg.vocab_size, H, 1 / np.sqrt(H))
    return ModelWeights(cfg, embed, layers, norm(H), lm_head, source=f"random {cfg.arch} ({seed})")


def bias_router(weights, preferred: int = 2, strength: float = 2.0, seed: int = 0) -> dict:
    """Skew a random Q8_0 mixture-of-experts model's routing, in place: in each routed layer `preferred`
    experts (drawn per layer) get about `strength` added to their router logits whatever the token.  The
    residual stream is given a constant positive first value (every embedding row's the largest Q8_0 level,
    and no layer writes it: the first row of each o, down and expert down weight zeroed), which the routed
    layers' norm scales to about one; the preferred experts' router rows take `strength` there.
    Returns {layer: the preferred experts}."""
    from kestrel_stream.model.quant import QTensor

    from kestrel_stream.model.quant4 import BlockTensor

    def zero_rows(w, rows):
        if isinstance(w, BlockTensor):             # every block of those rows zero (its scale too)
            blocks = np.array(w.blocks)
            blocks[rows] = 0
            return BlockTensor(w.fmt, blocks, w.cols)
        qs = np.array(w.qs)
        qs[rows] = 0
        return QTensor(qs, np.array(w.scales))
    c = weights.config
    assert isinstance(weights.embed, QTensor), "bias_router: a Q8_0 embedding table"
    embed = np.array(weights.embed.qs)
    embed[:, 0] = 127
    weights.embed = QTensor(embed, np.array(weights.embed.scales))
    if c.tie_word_embeddings:
        weights.lm_head = weights.embed
    rng = np.random.default_rng(seed)
    chosen = {}
    for i, layer in enumerate(weights.layers):
        layer.wo = zero_rows(layer.wo, [0])
        if layer.moe is None:
            layer.w_down = zero_rows(layer.w_down, [0])
            continue
        E = layer.moe.experts
        layer.moe.down = zero_rows(layer.moe.down, np.arange(E) * c.hidden_size)
        # x[0] = 127 times the embedding's scale, against an rms of about one: the norm scales it to ~1
        scale = float(np.asarray(weights.embed.scales)[:, 0].astype(np.float32).mean()) * 127
        mlp_norm = np.array(layer.mlp_norm, np.float32)
        mlp_norm[0] = np.float32(1.0 / scale)
        layer.mlp_norm = mlp_norm
        chosen[i] = tuple(sorted(int(e) for e in rng.choice(E, size=min(preferred, E), replace=False)))
        router = np.array(layer.moe.router, np.float32)
        router[list(chosen[i]), 0] += np.float32(strength)
        layer.moe.router = router
    return chosen


def random_blocks(rng: np.random.Generator, fmt: str, rows: int, cols: int, std: float) -> np.ndarray:
    """Random GGUF blocks uint8 [rows, cols/QK * block_bytes] whose weights have about `std` spread around 0
    (random level and scale bytes; the fp16 fields set so)."""
    elements, nbytes = BLOCK_FORMATS[fmt]
    raw = rng.integers(0, 256, (rows, cols // elements, nbytes), dtype=np.uint8)

    def put(offset: int, value: float) -> None:
        jitter = rng.uniform(0.5, 1.5, raw.shape[:2])
        raw[:, :, offset:offset + 2] = (jitter * value).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)

    if fmt == "Q4_0":
        put(0, std / 4.6)                      # levels -8..7: spread ~4.6
    elif fmt == "Q4_K":
        d = std / (4.6 * 32)                   # levels 0..15 times scales 0..63 (~32)
        put(0, d)
        put(2, d * 7.5 * 32 / 32)              # mins ~32 x dmin recentre the levels' mean 7.5 x scale
    elif fmt == "Q6_K":
        raw[:, :, 192:208] = rng.integers(1, 64, (rows, cols // elements, 16), dtype=np.uint8)   # scales > 0
        put(208, std / (18.5 * 32))            # levels -32..31: spread ~18.5, scales ~32
    else:
        raise ValueError(f"not a block format: {fmt}")
    return raw.reshape(rows, -1)
