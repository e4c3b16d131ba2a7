"""GGUF files (llama.cpp's format) for the ``llama`` and ``qwen3`` architectures.

Reading maps llama.cpp tensor names and metadata keys onto our HF-named
layout and reuses the loader's assembly.  Q8_0 tensors are split into
qs/scales losslessly (no requantization); F16/F32 linear weights are
quantized on load; norms become float32.

llama.cpp's converter reorders the rows of attn_q/attn_k for arch ``llama``
(and only llama) so that its rope rotates adjacent pairs instead of HF's
rotate_half halves; within each head, rows [0..hd/2) and [hd/2..hd) are
interleaved.  We use HF's rope, so the reader undoes that permutation and the
writer applies it.  A row permutation commutes with row-wise Q8_0, so it is
applied to qs and scales directly, still bit-exact.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGML_QUANT_VERSION, GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType

from kestrel_stream.model.config import ConfigError, ModelConfig
from kestrel_stream.loading.loader import LoadError, Progress, assemble_weights
from kestrel_stream.model.quant import QTensor, quantize
from kestrel_stream.obs.load_stages import stage
from kestrel_stream.model.weights import HF_GLOBAL_NAMES, HF_LAYER_NAMES, ModelWeights, hf_tensor_shapes

SUPPORTED_ARCHS = ("llama", "qwen3")
GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
    "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "mlp_norm": "ffn_norm",
    "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down",
}
GGUF_GLOBAL_NAMES = {"embed": "token_embd", "final_norm": "output_norm", "lm_head": "output"}
LINEAR_TYPES = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.F16, GGMLQuantizationType.F32)
NORM_TYPES = (GGMLQuantizationType.F16, GGMLQuantizationType.F32)


class CheckedReader(GGUFReader):
    """GGUFReader that names the tensor whose data runs past the end of a truncated file.

    The stock reader fails there with a bare numpy reshape error; the tensor
    infos (name, dims, type, offset) are parsed by then, so check them first.
    """

    def _build_tensors(self, start_offs, fields):
        file_bytes = len(self.data)
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            block_size, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
            end = start_offs + int(offset[0]) + int(np.prod(dims, dtype=np.int64)) * type_bytes // block_size
            if end > file_bytes:
                raise LoadError(f"{self.data.filename}: tensor {bytes(name).decode()!r} ends at byte {end} but "
                                f"the file has only {file_bytes} bytes (truncated)")
        super()._build_tensors(start_offs, fields)


def gguf_names(cfg: ModelConfig) -> dict[str, str]:
    """HF tensor name → llama.cpp tensor name, for every tensor of ``cfg``."""
    names = {HF_GLOBAL_NAMES[k]: f"{v}.weight" for k, v in GGUF_GLOBAL_NAMES.items()}
    for i in range(cfg.num_hidden_layers):
        for key, gguf_key in GGUF_LAYER_NAMES.items():
            names[f"model.layers.{i}.{HF_LAYER_NAMES[key]}"] = f"blk.{i}.{gguf_key}.weight"
    return names


def rope_row_order(rows: int, n_head: int, to_gguf: bool) -> np.ndarray:
    """Row index for llama.cpp's q/k permutation (to_gguf) or its inverse: out = w[order]."""
    half = rows // n_head // 2
    if to_gguf:
        return np.arange(rows).reshape(n_head, 2, half).swapaxes(1, 2).reshape(rows)
    return np.arange(rows).reshape(n_head, half, 2).swapaxes(1, 2).reshape(rows)


def permute_rows(q: QTensor, order: np.ndarray) -> QTensor:
    return QTensor(q.qs[order], q.scales[order])


def _metadata(reader: GGUFReader, path: Path, key: str, default=None):
    field = reader.get_field(key)
    if field is None:
        if default is None:
            raise LoadError(f"{path}: GGUF metadata key {key!r} is missing")
        return default
    value = field.contents()
    # float32 metadata (eps, theta): the shortest decimal that round-trips, e.g. 1e-05, not 9.99e-06
    return float(str(np.float32(value))) if isinstance(value, float) else value


def config_from_metadata(reader: GGUFReader, path: Path) -> ModelConfig:
    arch = _metadata(reader, path, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise LoadError(f"{path}: GGUF architecture {arch!r} is not supported (only {', '.join(SUPPORTED_ARCHS)})")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise LoadError(f"{path}: missing tensor 'token_embd.weight'")
    vocab_size = int(tensors["token_embd.weight"].shape[1])   # ggml order: [H, V]

    def meta(key, default=None):
        return _metadata(reader, path, f"{arch}.{key}", default)

    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    d = {
        "model_type": arch, "hidden_size": hidden, "num_hidden_layers": meta("block_count"),
        "intermediate_size": meta("feed_forward_length"), "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": meta("attention.key_length", hidden // heads if isinstance(heads, int) and heads else 0),
        "vocab_size": vocab_size, "rms_norm_eps": meta("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta("rope.freq_base", 10000.0), "max_position_embeddings": meta("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    try:
        return ModelConfig.from_dict(d, where=f"{path} (GGUF metadata)")
    except ConfigError as e:
        raise LoadError(str(e)) from None


def read_gguf(path: str | Path, progress: Progress | None = None) -> ModelWeights:
    """Load a llama/qwen3 .gguf file with Q8_0, F16 or F32 tensors."""
    path = Path(path)
    try:
        with stage("  GGUF metadata and mmap"):
            reader = CheckedReader(path)
    except LoadError:
        raise
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise LoadError(f"{path}: not a readable GGUF file, truncated or corrupt ({e})") from None
    cfg = config_from_metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    to_gguf = gguf_names(cfg)
    expected = {to_gguf[hf]: shape for hf, shape in hf_tensor_shapes(cfg).items()}
    for name in tensors:
        if name not in expected:
            raise LoadError(f"{path}: unexpected tensor {name!r} for a {cfg.arch} model of "
                            f"{cfg.num_hidden_layers} layers")
    for name, shape in expected.items():
        if name not in tensors:
            raise LoadError(f"{path}: missing tensor {name!r}")
        t = tensors[name]
        got = tuple(int(d) for d in reversed(t.shape.tolist()))
        if got != shape:
            raise LoadError(f"{path}: tensor {name!r} has shape {list(got)}, the metadata implies {list(shape)}")
        allowed = LINEAR_TYPES if len(shape) == 2 else NORM_TYPES
        if t.tensor_type not in allowed:
            raise LoadError(f"{path}: tensor {name!r} has type {t.tensor_type.name}; supported here: "
                            f"{', '.join(a.name for a in allowed)}")

    total_bytes = sum(int(tensors[n].n_bytes) for n in expected)
    done_bytes = 0

    def advance(name: str, what: str):
        nonlocal done_bytes
        done_bytes += int(tensors[name].n_bytes)
        if progress:
            progress(done_bytes, total_bytes, f"{what} {name}")

    def linear(hf_name: str) -> QTensor:
        name = to_gguf[hf_name]
        t = tensors[name]
        shape = expected[name]
        if t.tensor_type == GGMLQuantizationType.Q8_0:
            q = QTensor.from_blocks(t.data, shape)
        else:
            q = quantize(t.data.reshape(shape))
        if cfg.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            n_head = cfg.num_attention_heads if name.endswith("attn_q.weight") else cfg.num_key_value_heads
            q = permute_rows(q, rope_row_order(shape[0], n_head, to_gguf=False))
        advance(name, "read" if t.tensor_type == GGMLQuantizationType.Q8_0 else "quantize")
        return q

    def norm(hf_name: str) -> np.ndarray:
        name = to_gguf[hf_name]
        w = np.array(tensors[name].data, dtype=np.float32).reshape(expected[name])
        advance(name, "read")
        return w

    weights = assemble_weights(cfg, linear, norm, str(path))
    weights.extra["format"] = "gguf"
    return weights


def export_gguf(weights: ModelWeights, path: str | Path) -> Path:
    """Write ``weights`` as a GGUF file: Q8_0 linear weights and embedding, F32 norms.

    The file holds the model metadata and tensors llama.cpp names, but no
    tokenizer; kestrel-stream reads it back bit for bit.
    """
    cfg, path = weights.config, Path(path)
    tmp = path.with_name(path.name + ".tmp")
    writer = GGUFWriter(str(tmp), cfg.arch)
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
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(LlamaFileType.MOSTLY_Q8_0)
    writer.add_quantization_version(GGML_QUANT_VERSION)

    def add_q8(name: str, q: QTensor):
        writer.add_tensor(name, q.to_blocks(), raw_dtype=GGMLQuantizationType.Q8_0)

    add_q8("token_embd.weight", weights.embed)
    writer.add_tensor("output_norm.weight", np.asarray(weights.final_norm, dtype=np.float32))
    if not weights.tied:
        add_q8("output.weight", weights.lm_head)
    q_rows, kv_rows, ffn_rows = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    for i, layer in enumerate(weights.layers):
        wq = layer.wqkv.rows(0, q_rows)
        wk = layer.wqkv.rows(q_rows, q_rows + kv_rows)
        if cfg.arch == "llama":
            wq = permute_rows(wq, rope_row_order(q_rows, cfg.num_attention_heads, to_gguf=True))
            wk = permute_rows(wk, rope_row_order(kv_rows, cfg.num_key_value_heads, to_gguf=True))
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", np.asarray(layer.attn_norm, dtype=np.float32))
        add_q8(f"{blk}.attn_q.weight", wq)
        add_q8(f"{blk}.attn_k.weight", wk)
        add_q8(f"{blk}.attn_v.weight", layer.wqkv.rows(q_rows + kv_rows, q_rows + 2 * kv_rows))
        add_q8(f"{blk}.attn_output.weight", layer.wo)
        if layer.q_norm is not None:
            writer.add_tensor(f"{blk}.attn_q_norm.weight", np.asarray(layer.q_norm, dtype=np.float32))
            writer.add_tensor(f"{blk}.attn_k_norm.weight", np.asarray(layer.k_norm, dtype=np.float32))
        writer.add_tensor(f"{blk}.ffn_norm.weight", np.asarray(layer.mlp_norm, dtype=np.float32))
        add_q8(f"{blk}.ffn_gate.weight", layer.w_gate_up.rows(0, ffn_rows))
        add_q8(f"{blk}.ffn_up.weight", layer.w_gate_up.rows(ffn_rows, 2 * ffn_rows))
        add_q8(f"{blk}.ffn_down.weight", layer.w_down)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path
