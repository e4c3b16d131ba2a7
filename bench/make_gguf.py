"""Write a random Q8_0 GGUF of a preset's shapes that both kestrel-stream and llama.cpp load.

    python3 -m bench.make_gguf --preset qwen3-1.7b --vocab PATH/ggml-vocab-qwen2.gguf -o /tmp/q17.gguf

The tokenizer fields come from a llama.cpp vocab file (models/ggml-vocab-qwen2.gguf in its source), so
llama.cpp accepts the file; the weights are random int8 blocks with small fp16 scales (speed, not text).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

from kestrel_stream.loading.presets import PRESETS

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


def write(preset: str, vocab_path: str, out: str, seed: int = 0) -> None:
    cfg = PRESETS[preset]
    rng = np.random.default_rng(seed)
    pool = rng.integers(-127, 128, size=1 << 28, dtype=np.int8)
    w = GGUFWriter(out, cfg.arch)
    w.add_name(f"random-{preset}")
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
    w.add_file_type(LlamaFileType.MOSTLY_Q8_0)
    w.add_quantization_version(2)
    copy_tokenizer_fields(w, vocab_path)
    h, q, kv, ffn, v = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.vocab_size
    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    q8 = lambda name, rows, cols: w.add_tensor(name, random_q8(pool, rng, rows, cols),  # noqa: E731
                                               raw_dtype=GGMLQuantizationType.Q8_0)
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
        if cfg.arch == "qwen3":
            w.add_tensor(f"{b}.attn_q_norm.weight", ones(cfg.head_dim))
            w.add_tensor(f"{b}.attn_k_norm.weight", ones(cfg.head_dim))
        w.add_tensor(f"{b}.ffn_norm.weight", ones(h))
        q8(f"{b}.ffn_gate.weight", ffn, h)
        q8(f"{b}.ffn_up.weight", ffn, h)
        q8(f"{b}.ffn_down.weight", h, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-1.7b", choices=sorted(PRESETS))
    p.add_argument("--vocab", required=True, help="a llama.cpp vocab GGUF whose tokenizer fields are copied")
    p.add_argument("-o", "--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    t0 = time.perf_counter()
    write(args.preset, args.vocab, args.out, args.seed)
    print(f"wrote {args.out} ({args.preset}) in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
