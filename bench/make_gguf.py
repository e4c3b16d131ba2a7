"""Write a random GGUF of a preset's shapes that both kestrel-stream and llama.cpp load.

    python3 -m bench.make_gguf --preset qwen3-1.7b --vocab PATH/ggml-vocab-qwen2.gguf -o /tmp/q17.gguf
    python3 -m bench.make_gguf --preset qwen3-8b --mix q4_k_m --vocab PATH/ggml-vocab-qwen2.gguf -o /tmp/q8b-q4km.gguf
    python3 -m bench.make_gguf --preset qwen3-30b-a3b --mix q8_0 --vocab PATH/ggml-vocab-qwen2.gguf -o /tmp/q30a3b.gguf

The tokenizer fields come from a llama.cpp vocab file (models/ggml-vocab-qwen2.gguf in its source), so
llama.cpp accepts the file; the weights are random blocks with small fp16 scales (speed, not text).
--mix picks each matrix's type: q8_0 (every matrix), q4_0 / q4_k / q6_k (every matrix, output Q6_K
for q4_0 and q4_k as llama.cpp does), or q4_k_m, llama.cpp's Q4_K_M: Q4_K, with Q6_K for output (the
embedding when tied) and for attn_v and ffn_down (the experts' too) in the layers use_more_bits picks.
A mixture-of-experts preset (Qwen3-MoE: GGUF arch qwen3moe; Mixtral: llama) is written as llama.cpp's
converter writes it: the router float32 (ffn_gate_inp) and each routed layer's experts as 3-D
ffn_{gate,up,down}_exps tensors [experts, rows, cols] in the mix's blocks.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

from kestrel_stream.loading.presets import PRESETS
from bench.synthetic import random_blocks

GGUF_ARCHS = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}     # the GGUF general.architecture of a config arch
MIXES = ("q8_0", "q4_0", "q4_k", "q6_k", "q4_k_m")
FILE_TYPES = {"q8_0": LlamaFileType.MOSTLY_Q8_0, "q4_0": LlamaFileType.MOSTLY_Q4_0,
              "q4_k": LlamaFileType.MOSTLY_Q4_K_S, "q6_k": LlamaFileType.MOSTLY_Q6_K,
              "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M}

Q8_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", 32)])


def copy_tokenizer_fields(writer: GGUFWriter, vocab_path: str) -> None:
    reader = GGUFReader(vocab_path)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            sub = field.types[1]
            if sub == GGUFValueType.STRING:
                values = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
            else:
                values = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_array(key, values)
        elif kind == GGUFValueType.STRING:
            writer.add_string(key, bytes(field.parts[field.data[0]]).decode())
        else:
            writer.add_key_value(key, field.parts[field.data[0]].tolist()[0], kind)


def random_q8(pool: np.ndarray, rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """[rows, cols/32] Q8_0 blocks as raw bytes: int8 values from a shared random pool, scales ~ 1/sqrt(cols)/64."""
    blocks = np.empty((rows, cols // 32), Q8_BLOCK)
    n = blocks.size * 32
    start = int(rng.integers(0, pool.size - n)) if pool.size > n else 0
    qs = pool[start:start + n] if pool.size >= n else np.resize(pool, n)
    blocks["qs"] = qs.reshape(rows, cols // 32, 32)
    blocks["d"] = np.float16(1.0 / np.sqrt(cols) / 64)
    return blocks.view(np.uint8).reshape(rows, -1)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down Q4_K_M keeps in Q6_K (C integer division)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(mix: str, name: str, layers: int, tied: bool) -> str:
    """The GGUF type of matrix `name` (llama.cpp's names) in a file of `mix`."""
    if mix in ("q8_0", "q6_k"):
        return mix.upper()
    output = name == "output.weight" or (tied and name == "token_embd.weight")
    if output:
        return "Q6_K"
    if mix != "q4_k_m":
        return mix.upper()
    if (name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight"))
            and use_more_bits(int(name.split(".")[1]), layers)):
        return "Q6_K"
    return "Q4_K"


def write(preset, vocab_path: str | None, out: str, seed: int = 0, mix: str = "q8_0") -> dict[str, str]:
    """Write the file; returns {tensor name: GGUF type} of its matrices.  preset: a name or a ModelConfig."""
    cfg = PRESETS[preset] if isinstance(preset, str) else preset
    rng = np.random.default_rng(seed)
    pool = rng.integers(-127, 128, size=1 << 28 if isinstance(preset, str) else 1 << 16, dtype=np.int8)
    w = GGUFWriter(out, GGUF_ARCHS.get(cfg.arch, cfg.arch))
    w.add_name(f"random-{preset if isinstance(preset, str) else cfg.arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.num_experts:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if cfg.arch == "qwen3_moe":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
            w.add_expert_weights_norm(cfg.norm_topk_prob)
    w.add_file_type(FILE_TYPES[mix])
    w.add_quantization_version(2)
    if vocab_path:
        copy_tokenizer_fields(w, vocab_path)
    h, q, kv, ffn, v = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.vocab_size
    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    types = {}

    def q8(name: str, rows: int, cols: int) -> None:
        kind = types[name] = tensor_type(mix, name, cfg.num_hidden_layers, cfg.tie_word_embeddings)
        std = 0.02 if name == "token_embd.weight" else 1.0 / np.sqrt(cols)
        data = (random_q8(pool, rng, rows, cols) if kind == "Q8_0"
                else random_blocks(rng, kind, rows, cols, std))
        w.add_tensor(name, data, raw_dtype=GGMLQuantizationType[kind])

    def experts(name: str, rows: int, cols: int) -> None:
        """[E, rows, cols] blocks of one routed layer's experts."""
        kind = types[name] = tensor_type(mix, name, cfg.num_hidden_layers, cfg.tie_word_embeddings)
        E = cfg.num_experts
        data = (random_q8(pool, rng, E * rows, cols) if kind == "Q8_0"
                else random_blocks(rng, kind, E * rows, cols, 1.0 / np.sqrt(cols)))
        w.add_tensor(name, data.reshape(E, rows, -1), raw_dtype=GGMLQuantizationType[kind])
    q8("token_embd.weight", v, h)
    w.add_tensor("output_norm.weight", ones(h))
    if not cfg.tie_word_embeddings:
        q8("output.weight", v, h)
    for i in range(cfg.num_hidden_layers):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", ones(h))
        q8(f"{b}.attn_q.weight", q, h)
        q8(f"{b}.attn_k.weight", kv, h)
        q8(f"{b}.attn_v.weight", kv, h)
        q8(f"{b}.attn_output.weight", h, q)
        if cfg.qk_norm:
            w.add_tensor(f"{b}.attn_q_norm.weight", ones(cfg.head_dim))
            w.add_tensor(f"{b}.attn_k_norm.weight", ones(cfg.head_dim))
        w.add_tensor(f"{b}.ffn_norm.weight", ones(h))
        if cfg.moe_layer(i):
            w.add_tensor(f"{b}.ffn_gate_inp.weight",
                         (rng.standard_normal((cfg.num_experts, h), dtype=np.float32) / np.sqrt(h)).astype(np.float32))
            experts(f"{b}.ffn_gate_exps.weight", cfg.moe_intermediate_size, h)
            experts(f"{b}.ffn_up_exps.weight", cfg.moe_intermediate_size, h)
            experts(f"{b}.ffn_down_exps.weight", h, cfg.moe_intermediate_size)
            continue
        q8(f"{b}.ffn_gate.weight", ffn, h)
        q8(f"{b}.ffn_up.weight", ffn, h)
        q8(f"{b}.ffn_down.weight", h, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-1.7b", choices=sorted(PRESETS))
    p.add_argument("--vocab", default=None,
                   help="a llama.cpp vocab GGUF whose tokenizer fields are copied (llama.cpp needs them; "
                        "kestrel-stream does not)")
    p.add_argument("-o", "--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mix", default="q8_0", choices=MIXES, help="the matrices' types (see above)")
    args = p.parse_args()
    t0 = time.perf_counter()
    types = write(args.preset, args.vocab, args.out, args.seed, args.mix)
    counts = {kind: list(types.values()).count(kind) for kind in sorted(set(types.values()))}
    print(f"wrote {args.out} ({args.preset}, {args.mix}: {counts}) in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
