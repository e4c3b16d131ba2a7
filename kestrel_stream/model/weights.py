"""The weights of one model as the executors see them.

Linear weights are Q8_0 (``QTensor``) or, from a GGUF file, kept in its 4-bit
block formats (``BlockTensor`` / ``RowStack``, model/quant4.py); norms stay float32.  Projections that
share an input are fused when the weights load (gpt-fast's ``wqkv`` hook), so
every executor sees one QKV weight and one gate+up weight; the fusion is a
row-wise concatenation and changes no element's arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kestrel_stream.model.config import ModelConfig
from kestrel_stream.model.quant import QTensor
from kestrel_stream.model.quant4 import fuse_rows


@dataclass
class LayerWeights:
    attn_norm: np.ndarray          # [H] float32
    wqkv: QTensor                  # [q_size + 2*kv_size, H]: rows q, then k, then v (any linear weight type)
    wo: QTensor                    # [H, q_size]
    mlp_norm: np.ndarray           # [H] float32
    w_gate_up: QTensor             # [2*I, H]: rows gate, then up
    w_down: QTensor                # [H, I]
    q_norm: np.ndarray | None = None   # [D] float32 (Qwen3 only)
    k_norm: np.ndarray | None = None   # [D] float32 (Qwen3 only)
    qkv_bias: np.ndarray | None = None  # [q_size + 2*kv_size] float32 (Qwen2 only): rows q, k, v


@dataclass
class ModelWeights:
    config: ModelConfig
    embed: QTensor                 # [V, H]
    layers: list[LayerWeights]
    final_norm: np.ndarray         # [H] float32
    lm_head: QTensor               # [V, H]; the same object as ``embed`` when tied
    source: str = ""               # where the weights came from (for messages)
    extra: dict = field(default_factory=dict)

    @property
    def tied(self) -> bool:
        return self.lm_head is self.embed

    def quantized_bytes(self) -> int:
        """Bytes of all linear weights in their formats, counting a tied embedding once."""
        total = self.embed.nbytes + (0 if self.tied else self.lm_head.nbytes)
        for layer in self.layers:
            total += layer.wqkv.nbytes + layer.wo.nbytes + layer.w_gate_up.nbytes + layer.w_down.nbytes
        return total


# Hugging Face tensor names of one layer, relative to "model.layers.{i}."
HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}
HF_GLOBAL_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of this config must hold, with its shape."""
    H, I, D, V = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
    shapes = {HF_GLOBAL_NAMES["embed"]: (V, H), HF_GLOBAL_NAMES["final_norm"]: (H,)}
    if not cfg.tie_word_embeddings:
        shapes[HF_GLOBAL_NAMES["lm_head"]] = (V, H)
    per_layer = {
        "attn_norm": (H,), "q": (cfg.q_size, H), "k": (cfg.kv_size, H), "v": (cfg.kv_size, H),
        "o": (H, cfg.q_size), "mlp_norm": (H,), "gate": (I, H), "up": (I, H), "down": (H, I),
    }
    if cfg.qk_norm:
        per_layer.update(q_norm=(D,), k_norm=(D,))
    if cfg.qkv_bias:
        per_layer.update(q_bias=(cfg.q_size,), k_bias=(cfg.kv_size,), v_bias=(cfg.kv_size,))
    for i in range(cfg.num_hidden_layers):
        for key, shape in per_layer.items():
            shapes[f"model.layers.{i}.{HF_LAYER_NAMES[key]}"] = shape
    return shapes


def assemble_weights(cfg: ModelConfig, linear: Callable[[str], QTensor], norm: Callable[[str], np.ndarray],
                     source: str) -> ModelWeights:
    """Build ModelWeights from per-tensor getters keyed by HF name, fusing QKV and gate/up rows."""
    embed = linear(HF_GLOBAL_NAMES["embed"])
    layers = []
    for i in range(cfg.num_hidden_layers):
        def hf(key: str) -> str:
            return f"model.layers.{i}.{HF_LAYER_NAMES[key]}"
        layers.append(LayerWeights(
            attn_norm=norm(hf("attn_norm")),
            wqkv=fuse_rows([linear(hf("q")), linear(hf("k")), linear(hf("v"))]),
            wo=linear(hf("o")),
            mlp_norm=norm(hf("mlp_norm")),
            w_gate_up=fuse_rows([linear(hf("gate")), linear(hf("up"))], allow_stack=False),
            w_down=linear(hf("down")),
            q_norm=norm(hf("q_norm")) if cfg.qk_norm else None,
            k_norm=norm(hf("k_norm")) if cfg.qk_norm else None,
            qkv_bias=np.concatenate([norm(hf("q_bias")), norm(hf("k_bias")), norm(hf("v_bias"))])
            if cfg.qkv_bias else None,
        ))
    final_norm = norm(HF_GLOBAL_NAMES["final_norm"])
    lm_head = embed if cfg.tie_word_embeddings else linear(HF_GLOBAL_NAMES["lm_head"])
    return ModelWeights(config=cfg, embed=embed, layers=layers, final_norm=final_norm,
                        lm_head=lm_head, source=source)
