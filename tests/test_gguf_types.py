"""Every common GGUF type loads: converted to Q8_0 at load (Q8_0 kept), cached, reported in one line.
(Q4_0, Q4_K and Q6_K stay blocks by default, tests/test_quant4.py; here they load with gguf_blocks="q8_0".)

The check per type: a tensor of that type loads to exactly what our Q8_0
quantizer makes of the floats ``gguf.quants.dequantize`` gives for its bytes
(the same qs and scales, bit for bit), and those Q8_0 values lie within half a
Q8_0 step of the floats (plus the fp16 rounding of the step); the types whose
values are an int8 level times the block's scale (Q4_0, Q5_0, IQ4_NL:
model/exact_q8.py) load to those very floats, and are not cached.  Types gguf.quants can write (F32, F16, BF16, Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0) are written by ``gguf.quants.quantize``; for the K-quants and
IQ4 types (gguf.quants only reads them) the blocks are random bytes with
their fp16 scale fields set to small finite values.
"""
import time

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFWriter
from gguf import quants as gguf_quants

from kestrel_stream.loading.gguf import CONVERTED_TYPES, open_gguf
from kestrel_stream.loading.gguf_file import GGUFFile, gguf_metadata
from kestrel_stream.loading.loader import load_weights
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.model.exact_q8 import EXACT_TYPES
from kestrel_stream.model.quant import GROUP, quantize
from kestrel_stream.loading.presets import random_weights
from kestrel_stream.model.weights import hf_tensor_shapes

# byte offsets of the fp16 scale fields inside one block of the types gguf.quants cannot write
FP16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
               T.IQ4_NL: (0,), T.IQ4_XS: (0,)}
WRITABLE = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
# A Qwen3 (no llama q/k row permutation) whose every matrix has K % 256 == 0, so K-quants fit each one.
CFG = ModelConfig(arch="qwen3", hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=64, rms_norm_eps=1e-6, rope_theta=1e6,
                  tie_word_embeddings=False, max_position_embeddings=128)
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, i, rest = hf.split(".", 3)
        return f"blk.{i}.{LAYER[rest.removesuffix('.weight')]}.weight"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def blocks_of(qtype, x: np.ndarray, rng) -> np.ndarray:
    """uint8 [N, bytes per row] of ``qtype`` for the float matrix ``x``."""
    if qtype in WRITABLE:
        return gguf_quants.quantize(x, qtype).view(np.uint8).reshape(x.shape[0], -1)
    block_size, type_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (x.shape[0], x.shape[1] // block_size, type_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scale = rng.uniform(1e-3, 1e-2, raw.shape[:2]).astype(np.float16)
        raw[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(x.shape[0], -1)


def write_gguf(path, qtype, seed=0, tokens=None):
    """CFG as a GGUF with every matrix of ``qtype``; returns {gguf name: the bytes written}."""
    rng = np.random.default_rng(seed)
    produce = random_weights(CFG, seed)
    w = GGUFWriter(str(path), "qwen3")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(64)
    w.add_value_length(64)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    if tokens is not None:
        w.add_token_list(tokens)
    written = {}
    for hf_name, shape in hf_tensor_shapes(CFG).items():
        x = produce(hf_name, shape)
        name = gguf_name(hf_name)
        if x.ndim == 1:
            w.add_tensor(name, x)
            continue
        raw = blocks_of(qtype, x, rng)
        written[name] = raw
        if qtype == T.F32:
            w.add_tensor(name, raw.view(np.float32).reshape(shape))
        else:
            w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


@pytest.mark.parametrize("qtype", CONVERTED_TYPES + (T.Q8_0,), ids=lambda t: t.name)
def test_each_type_loads_to_its_dequantized_values_rounded_to_q8_0(tmp_path, qtype, capfd):
    path = tmp_path / f"model-{qtype.name}.gguf"
    written = write_gguf(path, qtype)
    weights = load_weights(path, cache=False, gguf_blocks="q8_0")    # Q4_0 / Q4_K / Q6_K converted too
    layer = weights.layers[0]
    loaded = {"token_embd.weight": weights.embed, "output.weight": weights.lm_head,
              "blk.0.attn_output.weight": layer.wo, "blk.0.ffn_down.weight": layer.w_down,
              "blk.0.attn_q.weight": layer.wqkv.rows(0, 256), "blk.0.ffn_up.weight": layer.w_gate_up.rows(256, 512)}
    exact = qtype.name in EXACT_TYPES
    for name, q in loaded.items():
        floats = gguf_quants.dequantize(written[name], qtype).astype(np.float32)
        assert np.isfinite(floats).all() and np.abs(floats).max() > 0, name
        if exact:               # the same values, bit for bit, where requantizing would round them
            assert np.array_equal(q.dequantize(), floats), name
            assert not np.array_equal(quantize(floats).dequantize(), floats), name
            continue
        expected = quantize(floats)
        assert np.array_equal(q.qs, expected.qs) and np.array_equal(q.scales, expected.scales), name
        # half a step, plus 127 steps' worth of the scale's own fp16 rounding (2^-11 relative)
        bound = np.repeat(q.scales.astype(np.float32), GROUP, axis=1) * (0.5 + 127 * 2.0 ** -11) * 1.001
        assert (np.abs(q.dequantize() - floats) <= bound + 1e-7).all(), name
    line = weights.extra.get("conversion_line")
    if qtype == T.Q8_0:
        assert line is None
    else:
        assert line.startswith(f"gguf: converted to Q8_0: {qtype.name} x9 (")
        assert line.endswith(" MB, exact)" if exact else " MB)")
        assert line in capfd.readouterr().err


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q5_K], ids=lambda t: t.name)
def test_only_rounding_conversions_are_cached(tmp_path, qtype):
    """An exact conversion is a byte shuffle each load; a rounding one is worth its cached Q8_0 copy."""
    path = tmp_path / "model.gguf"
    write_gguf(path, qtype)
    first = load_weights(path)
    assert (first.extra["qcache"]["path"] is None) == (qtype == T.Q5_0)
    assert load_weights(path).extra["qcache"]["hit"] is (qtype == T.Q5_K)


def test_a_converted_gguf_is_cached_and_a_corrupt_cache_rebuilt(tmp_path, capfd):
    path = tmp_path / "model.gguf"
    write_gguf(path, T.Q5_K)
    first = load_weights(path)
    assert first.extra["qcache"]["hit"] is False
    cache_file = first.extra["qcache"]["path"]
    assert cache_file and cache_file.endswith("model.gguf.q8_0.kcache")
    second = load_weights(path)
    assert second.extra["qcache"] == {"hit": True, "path": cache_file}
    assert np.array_equal(second.layers[0].w_down.qs, first.layers[0].w_down.qs)
    with open(cache_file, "r+b") as f:              # flip one byte of the data
        f.seek(-10, 2)
        byte = f.read(1)
        f.seek(-10, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    third = load_weights(path)
    assert third.extra["qcache"]["hit"] is False
    assert np.array_equal(third.layers[0].w_down.qs, first.layers[0].w_down.qs)
    assert load_weights(path).extra["qcache"]["hit"] is True


def test_metadata_arrays_are_decoded_only_when_read(tmp_path):
    path = tmp_path / "model.gguf"
    tokens = [f"tok{i}" for i in range(64)]
    write_gguf(path, T.Q8_0, tokens=tokens)
    f = GGUFFile(path)
    assert "tokenizer.ggml.tokens" in f.keys()
    assert type(f._fields["tokenizer.ggml.tokens"]).__name__ == "_LazyArray"
    assert f.metadata("tokenizer.ggml.tokens") == tokens
    assert gguf_metadata(path, "tokenizer.ggml.tokens") == tokens
    assert gguf_metadata(path, "qwen3.block_count") == 1
    assert gguf_metadata(path, "no.such.key", None) is None
    with pytest.raises(KeyError, match="no.such.key"):
        gguf_metadata(path, "no.such.key")


def test_the_gguf_reader_agrees_with_gguf_packages_reader(tmp_path):
    from gguf import GGUFReader
    path = tmp_path / "model.gguf"
    write_gguf(path, T.Q4_1, tokens=["a", "bb", "ccc"])
    ours, theirs = open_gguf(path), GGUFReader(path)
    for t in theirs.tensors:
        info = ours.tensors[t.name]
        assert (info.offset, info.nbytes, info.qtype) == (t.data_offset, t.n_bytes, t.tensor_type)
        assert info.shape == tuple(reversed(t.shape.tolist()))
        assert np.array_equal(ours.tensor_bytes(t.name), np.asarray(t.data).view(np.uint8).reshape(-1))
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata(key) == field.contents(), key


def test_open_is_fast_when_the_tokenizer_is_not_read(tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(path, T.Q8_0, tokens=[f"token-{i}" for i in range(150_000)])
    start = time.perf_counter()
    f = open_gguf(path)
    assert f.metadata("qwen3.block_count") == 1
    assert time.perf_counter() - start < 0.5


def test_the_conversion_line_gives_each_type_and_with_several_the_totals():
    from kestrel_stream.loading.gguf import conversion_line
    assert conversion_line({"Q4_1": [210, 66_400_000, 112_800_000]}) == \
        "gguf: converted to Q8_0: Q4_1 x210 (66.4 MB -> 112.8 MB)"
    assert conversion_line({"Q5_K": [2, 3_000_000, 4_000_000], "Q4_1": [1, 1_000_000, 2_000_000]}) == \
        ("gguf: converted to Q8_0: Q4_1 x1 (1.0 MB -> 2.0 MB), Q5_K x2 (3.0 MB -> 4.0 MB); 3 tensors, "
         "4.0 MB -> 6.0 MB")
