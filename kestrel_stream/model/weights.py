"""The weights of one model as the executors see them.

Linear weights are Q8_0 (``QTensor``) or, from a GGUF file, kept in its 4-bit
block formats (``BlockTensor`` / ``RowStack``, model/quant4.py); norms stay float32.  Projections that
share an input are fused when the weights load (gpt-fast's ``wqkv`` hook), so
every executor sees one QKV weight and one gate+up weight; the fusion is a
row-wise concatenation and changes no element's arithmetic.  A mixture-of-experts
layer keeps its experts as two stacked weights in their blocks (``MoeWeights``:
every expert's gate+up rows, every expert's down rows; an expert is a row range)
and its router in float32.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kestrel_stream.model.config import ModelConfig
from kestrel_stream.model.quant import QTensor
from kestrel_stream.model.quant4 import fuse_rows
from scheduler.moe import expert_names, expert_shapes, router_name


@dataclass
class MoeWeights:
    """A routed MLP: the router and E experts, each expert a row range of the two stacked weights."""
    router: np.ndarray             # [E, H] float32
    gate_up: QTensor               # [E * 2I, H]: per expert, its gate rows then its up rows (any linear type)
    down: QTensor                  # [E * H, I]: per expert, its down rows

    @property
    def experts(self) -> int:
        return self.router.shape[0]

    def gate_up_rows(self, expert: int) -> tuple[int, int]:
        rows = self.gate_up.shape[0] // self.experts
        return expert * rows, (expert + 1) * rows

    def down_rows(self, expert: int) -> tuple[int, int]:
        rows = self.down.shape[0] // self.experts
        return expert * rows, (expert + 1) * rows

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


@dataclass
class LayerWeights:
    attn_norm: np.ndarray          # [H] float32
    wqkv: QTensor                  # [q_size + 2*kv_size, H]: rows q, then k, then v (any linear weight type)
    wo: QTensor                    # [H, q_size]
    mlp_norm: np.ndarray           # [H] float32
    w_gate_up: QTensor | None      # [2*I, H]: rows gate, then up (None in a routed layer)
    w_down: QTensor | None         # [H, I]
    q_norm: np.ndarray | None = None   # [D] float32 (Qwen3 only)
    k_norm: np.ndarray | None = None   # [D] float32 (Qwen3 only)
    qkv_bias: np.ndarray | None = None  # [q_size + 2*kv_size] float32 (Qwen2 only): rows q, k, v
    moe: MoeWeights | None = None       # the router and experts of a routed layer (for gate_up and down)


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
            total += layer.wqkv.nbytes + layer.wo.nbytes
            total += layer.moe.nbytes if layer.moe else layer.w_gate_up.nbytes + layer.w_down.nbytes
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


DENSE_MLP_KEYS = ("gate", "up", "down")      # a routed layer has experts instead


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
        routed = cfg.moe_layer(i)
        for key, shape in per_layer.items():
            if not (routed and key in DENSE_MLP_KEYS):
                shapes[f"model.layers.{i}.{HF_LAYER_NAMES[key]}"] = shape
        if routed:
            shapes[router_name(cfg, i)] = (cfg.num_experts, H)
            for e in range(cfg.num_experts):
                shapes.update(zip(expert_names(cfg, i, e), expert_shapes(cfg)))
    return shapes


def assemble_weights(cfg: ModelConfig, linear: Callable[[str], QTensor], norm: Callable[[str], np.ndarray],
                     source: str) -> ModelWeights:
    """Build ModelWeights from per-tensor getters keyed by HF name, fusing QKV and gate/up rows."""
    embed = linear(HF_GLOBAL_NAMES["embed"])
    layers = []
    for i in range(cfg.num_hidden_layers):
        def hf(key: str) -> str:
            return f"model.layers.{i}.{HF_LAYER_NAMES[key]}"
        routed = cfg.moe_layer(i)
        layers.append(LayerWeights(
            attn_norm=norm(hf("attn_norm")),
            wqkv=fuse_rows([linear(hf("q")), linear(hf("k")), linear(hf("v"))]),
            wo=linear(hf("o")),
            mlp_norm=norm(hf("mlp_norm")),
            w_gate_up=None if routed else fuse_rows([linear(hf("gate")), linear(hf("up"))], allow_stack=False),
            w_down=None if routed else linear(hf("down")),
            moe=assemble_experts(cfg, i, linear, norm) if routed else None,
            q_norm=norm(hf("q_norm")) if cfg.qk_norm else None,
            k_norm=norm(hf("k_norm")) if cfg.qk_norm else None,
            qkv_bias=np.concatenate([norm(hf("q_bias")), norm(hf("k_bias")), norm(hf("v_bias"))])
            if cfg.qkv_bias else None,
        ))
    final_norm = norm(HF_GLOBAL_NAMES["final_norm"])
    lm_head = embed if cfg.tie_word_embeddings else linear(HF_GLOBAL_NAMES["lm_head"])
    return ModelWeights(config=cfg, embed=embed, layers=layers, final_norm=final_norm,
                        lm_head=lm_head, source=source)


def assemble_experts(cfg: ModelConfig, layer: int, linear: Callable[[str], QTensor],
                     norm: Callable[[str], np.ndarray]) -> MoeWeights:
    """One routed layer's weights: each expert's tensors (by HF name) stacked into gate+up and down, exact."""
    names = [expert_names(cfg, layer, e) for e in range(cfg.num_experts)]
    gate_up = fuse_rows([linear(n) for gate, up, _ in names for n in (gate, up)], allow_stack=False)
    down = fuse_rows([linear(down) for _, _, down in names], allow_stack=False)
    return MoeWeights(router=np.asarray(norm(router_name(cfg, layer)), np.float32), gate_up=gate_up, down=down)
