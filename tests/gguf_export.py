"""Writing a model as a GGUF file (the tests' round trip: kestrel-stream reads it back bit for bit)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFWriter, LlamaFileType, RopeScalingType

from kestrel_stream.loading.gguf import PERMUTED_ARCHS, ROPE_FREQS, permute_rows, rope_row_order
from kestrel_stream.model.rope import default_inv_freq, inv_freq
from kestrel_stream.model.quant import QTensor
from kestrel_stream.model.weights import ModelWeights


def export_gguf(weights: ModelWeights, path: str | Path, byte_tokenizer: bool = False) -> Path:
    """Write ``weights`` as a GGUF file: Q8_0 linear weights and embedding, F32 norms.

    The file holds the model metadata and tensors llama.cpp names, and no
    tokenizer unless ``byte_tokenizer`` (a gpt2-type vocabulary of the 256
    bytes, for a vocab of 256 or more); kestrel-stream reads it back bit for bit.
    """
    cfg, path = weights.config, Path(path)
    tmp = path.with_name(path.name + ".tmp")
    writer = GGUFWriter(str(tmp), "llama" if cfg.arch in PERMUTED_ARCHS else cfg.arch.replace("_", ""))
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    if cfg.sliding_window:
        writer.add_sliding_window(cfg.sliding_window)
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.type in ("linear", "yarn"):     # as llama.cpp's converter writes them
        writer.add_rope_scaling_type(RopeScalingType(scaling.type))
        writer.add_rope_scaling_factor(scaling.factor)
        if scaling.type == "yarn":
            writer.add_rope_scaling_orig_ctx_len(scaling.original_max_position_embeddings)
            writer.add_rope_scaling_yarn_beta_fast(scaling.beta_fast)
            writer.add_rope_scaling_yarn_beta_slow(scaling.beta_slow)
            if scaling.attention_factor is not None:
                writer.add_rope_scaling_attn_factors(scaling.attention_factor)
    elif scaling is not None or cfg.rope_freq_factors:     # llama3: per-frequency divisors
        writer.add_tensor(ROPE_FREQS, (default_inv_freq(cfg.head_dim, cfg.rope_theta) / inv_freq(cfg))
                          .astype(np.float32))
    if cfg.num_experts:                     # as llama.cpp's converter writes Qwen3-MoE and Mixtral
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if cfg.arch == "qwen3_moe":
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
            writer.add_expert_weights_norm(cfg.norm_topk_prob)
    writer.add_vocab_size(cfg.vocab_size)
    if byte_tokenizer:
        add_byte_tokenizer(writer, cfg.vocab_size)
    writer.add_file_type(LlamaFileType.MOSTLY_Q8_0)
    writer.add_quantization_version(GGML_QUANT_VERSION)

    def add_q8(name: str, q: QTensor):
        writer.add_tensor(name, q.to_blocks(), raw_dtype=GGMLQuantizationType.Q8_0)

    def add_experts(name: str, experts: list):
        """[E, rows, cols] in the experts' own blocks (Q8_0, or a BlockTensor's format)."""
        fmt = "Q8_0" if isinstance(experts[0], QTensor) else experts[0].fmt
        blocks = [np.asarray(w.to_blocks() if fmt == "Q8_0" else w.blocks) for w in experts]
        writer.add_tensor(name, np.stack(blocks), raw_dtype=GGMLQuantizationType[fmt])

    add_q8("token_embd.weight", weights.embed)
    writer.add_tensor("output_norm.weight", np.asarray(weights.final_norm, dtype=np.float32))
    if not weights.tied:
        add_q8("output.weight", weights.lm_head)
    q_rows, kv_rows, ffn_rows = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    for i, layer in enumerate(weights.layers):
        wq = layer.wqkv.rows(0, q_rows)
        wk = layer.wqkv.rows(q_rows, q_rows + kv_rows)
        if cfg.arch in PERMUTED_ARCHS:
            wq = permute_rows(wq, rope_row_order(q_rows, cfg.num_attention_heads, to_gguf=True))
            wk = permute_rows(wk, rope_row_order(kv_rows, cfg.num_key_value_heads, to_gguf=True))
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", np.asarray(layer.attn_norm, dtype=np.float32))
        add_q8(f"{blk}.attn_q.weight", wq)
        add_q8(f"{blk}.attn_k.weight", wk)
        add_q8(f"{blk}.attn_v.weight", layer.wqkv.rows(q_rows + kv_rows, q_rows + 2 * kv_rows))
        if layer.qkv_bias is not None:
            bias = np.asarray(layer.qkv_bias, dtype=np.float32)
            writer.add_tensor(f"{blk}.attn_q.bias", bias[:q_rows])
            writer.add_tensor(f"{blk}.attn_k.bias", bias[q_rows:q_rows + kv_rows])
            writer.add_tensor(f"{blk}.attn_v.bias", bias[q_rows + kv_rows:])
        add_q8(f"{blk}.attn_output.weight", layer.wo)
        if layer.q_norm is not None:
            writer.add_tensor(f"{blk}.attn_q_norm.weight", np.asarray(layer.q_norm, dtype=np.float32))
            writer.add_tensor(f"{blk}.attn_k_norm.weight", np.asarray(layer.k_norm, dtype=np.float32))
        writer.add_tensor(f"{blk}.ffn_norm.weight", np.asarray(layer.mlp_norm, dtype=np.float32))
        if layer.moe is not None:           # 3-D [E, rows, cols] expert tensors, the router in float32
            moe, inter = layer.moe, cfg.moe_intermediate_size
            writer.add_tensor(f"{blk}.ffn_gate_inp.weight", np.asarray(moe.router, dtype=np.float32))
            gate_up = [moe.gate_up.rows(*moe.gate_up_rows(e)) for e in range(moe.experts)]
            for name, part in (("gate", lambda w: w.rows(0, inter)), ("up", lambda w: w.rows(inter, 2 * inter))):
                add_experts(f"{blk}.ffn_{name}_exps.weight", [part(w) for w in gate_up])
            add_experts(f"{blk}.ffn_down_exps.weight", [moe.down.rows(*moe.down_rows(e)) for e in range(moe.experts)])
            continue
        add_q8(f"{blk}.ffn_gate.weight", layer.w_gate_up.rows(0, ffn_rows))
        add_q8(f"{blk}.ffn_up.weight", layer.w_gate_up.rows(ffn_rows, 2 * ffn_rows))
        add_q8(f"{blk}.ffn_down.weight", layer.w_down)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path


def add_byte_tokenizer(writer: GGUFWriter, vocab_size: int) -> None:
    """tokenizer.ggml.* of a byte-level BPE: GPT-2's printable alphabet in byte order for bytes 0..254,
    then the one merge "Ġ t" (GGUF keeps no empty merges array) as id 255."""
    from tokenizers import pre_tokenizers
    from kestrel_stream.loading.presets import _byte_of
    assert vocab_size >= 256, "a byte tokenizer needs a vocabulary of at least 256"
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)[:255]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(alphabet + ["Ġt"] + [f"<extra_{i}>" for i in range(vocab_size - 256)])
    writer.add_token_merges(["Ġ t"])
    writer.add_eos_token_id(10)             # "\n"
