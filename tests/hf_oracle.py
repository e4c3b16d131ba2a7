"""Put kestrel-stream's dequantized weights into a transformers model (the oracle)."""
from __future__ import annotations

import numpy as np


def hf_model_with_weights(model_dir, weights):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    c = weights.config
    state = model.state_dict()

    def put(name, value):
        # a writable copy where the value is a view of a read-only mmap (torch warns on those)
        state[name].copy_(torch.from_numpy(np.require(value, requirements=("C", "W"))))

    with torch.no_grad():
        put("model.embed_tokens.weight", weights.embed.dequantize())
        if not c.tie_word_embeddings:
            put("lm_head.weight", weights.lm_head.dequantize())
        put("model.norm.weight", weights.final_norm)
        for i, layer in enumerate(weights.layers):
            prefix = f"model.layers.{i}."
            qkv = layer.wqkv.dequantize()
            put(prefix + "self_attn.q_proj.weight", qkv[: c.q_size])
            put(prefix + "self_attn.k_proj.weight", qkv[c.q_size: c.q_size + c.kv_size])
            put(prefix + "self_attn.v_proj.weight", qkv[c.q_size + c.kv_size:])
            put(prefix + "self_attn.o_proj.weight", layer.wo.dequantize())
            if layer.moe is not None:           # transformers keeps the experts stacked: [E, 2I, H], [E, H, I]
                E = layer.moe.experts
                put(prefix + "mlp.gate.weight", layer.moe.router)
                put(prefix + "mlp.experts.gate_up_proj", layer.moe.gate_up.dequantize().reshape(E, -1, c.hidden_size))
                put(prefix + "mlp.experts.down_proj", layer.moe.down.dequantize().reshape(E, c.hidden_size, -1))
            else:
                gate_up = layer.w_gate_up.dequantize()
                put(prefix + "mlp.gate_proj.weight", gate_up[: c.intermediate_size])
                put(prefix + "mlp.up_proj.weight", gate_up[c.intermediate_size:])
                put(prefix + "mlp.down_proj.weight", layer.w_down.dequantize())
            put(prefix + "input_layernorm.weight", layer.attn_norm)
            put(prefix + "post_attention_layernorm.weight", layer.mlp_norm)
            if c.qkv_bias:
                bias = layer.qkv_bias
                put(prefix + "self_attn.q_proj.bias", bias[: c.q_size])
                put(prefix + "self_attn.k_proj.bias", bias[c.q_size: c.q_size + c.kv_size])
                put(prefix + "self_attn.v_proj.bias", bias[c.q_size + c.kv_size:])
            if c.qk_norm:
                put(prefix + "self_attn.q_norm.weight", layer.q_norm)
                put(prefix + "self_attn.k_norm.weight", layer.k_norm)
    return model


def hf_logits(model, token_ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].numpy()


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    """max |ours - reference| / max |reference|: the tolerance measure used throughout."""
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def assert_logits_match(ours: np.ndarray, reference: np.ndarray, tolerance: float = 2e-3, label: str = "") -> None:
    """Every position's logits within `tolerance` (relative_error) of the reference's, and the same argmax
    at every position: the oracle tests' bar.  Where the reference's two best tokens lie within twice that
    tolerance of each other (a tie at the precision the logits are held to: a random tiny model has them,
    e.g. 1.4183 against 1.4193), ours may pick either, and must pick one of them."""
    assert len(ours) == len(reference), (len(ours), len(reference))
    for position in range(len(ours)):
        assert relative_error(ours[position], reference[position]) < tolerance, f"{label}position {position}"
    rows = np.arange(len(reference))
    best, picked = reference.argmax(axis=1), ours.argmax(axis=1)
    tie = reference[rows, picked] >= reference[rows, best] - 2 * tolerance * np.abs(reference).max(axis=1)
    np.testing.assert_array_equal(np.where(tie, best, picked), best)
