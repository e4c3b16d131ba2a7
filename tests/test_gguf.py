"""GGUF files written the way llama.cpp's converter writes them load bit for bit like the safetensors path."""
import json
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf import quants as gguf_quants
from safetensors.numpy import load_file, save_file

from gguf_export import export_gguf
from kestrel_stream.loading.loader import LoadError, load_weights
from kestrel_stream.loading.presets import make_model
from kestrel_stream.loading.qcache import flatten

LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llama_cpp_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, i, rest = hf.split(".", 3)
        return f"blk.{i}.{LAYER[rest.removesuffix('.weight')]}.weight"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf.py LlamaModel.permute: HF rotate_half rows → llama.cpp's interleaved rope."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_like_llama_cpp(hf_dir, out, linear_type=GGMLQuantizationType.Q8_0, arch=None, skip=(), extra=None):
    """Convert an f32 HF checkpoint with the gguf package only (independent of kestrel_stream's writer)."""
    tensors = load_file(hf_dir / "model.safetensors")
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    arch = arch or hf_cfg["model_type"]
    w = GGUFWriter(str(out), arch)
    w.add_block_count(hf_cfg["num_hidden_layers"])
    w.add_context_length(hf_cfg["max_position_embeddings"])
    w.add_embedding_length(hf_cfg["hidden_size"])
    w.add_feed_forward_length(hf_cfg["intermediate_size"])
    w.add_head_count(hf_cfg["num_attention_heads"])
    w.add_head_count_kv(hf_cfg["num_key_value_heads"])
    w.add_key_length(hf_cfg["head_dim"])
    w.add_value_length(hf_cfg["head_dim"])
    w.add_layer_norm_rms_eps(hf_cfg["rms_norm_eps"])
    w.add_rope_freq_base(hf_cfg["rope_theta"])
    for hf_name, x in tensors.items():
        name = llama_cpp_name(hf_name)
        if name in skip:
            continue
        if hf_cfg["model_type"] == "llama" and name.endswith("attn_q.weight"):
            x = llama_cpp_permute(x, hf_cfg["num_attention_heads"])
        if hf_cfg["model_type"] == "llama" and name.endswith("attn_k.weight"):
            x = llama_cpp_permute(x, hf_cfg["num_key_value_heads"])
        if x.ndim == 1:
            w.add_tensor(name, x.astype(np.float32))
        elif linear_type == GGMLQuantizationType.IQ2_XXS:     # a type gguf.quants cannot write: zero blocks
            shape = gguf_quants.quant_shape_to_byte_shape(x.shape, linear_type) if x.shape[1] % 256 == 0 else None
            if shape is None:
                w.add_tensor(name, x.astype(np.float32))
            else:
                w.add_tensor(name, np.zeros(shape, np.uint8), raw_dtype=linear_type)
        else:
            w.add_tensor(name, gguf_quants.quantize(x, linear_type), raw_dtype=linear_type)
    for name, x in (extra or {}).items():
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def assert_same_q8(a, b):
    assert a.config == b.config and a.tied == b.tied
    for x, y in zip(flatten(a), flatten(b), strict=True):
        assert x[0] == y[0]
        assert np.array_equal(x[1].view(np.uint8), y[1].view(np.uint8)), x[0]


@pytest.fixture(params=["tiny", "llama-tiny"])
def hf_ckpt(request, tmp_path):
    return make_model(tmp_path / request.param, request.param, dtype="f32")


def test_q8_0_gguf_matches_safetensors_bit_for_bit(hf_ckpt, tmp_path):
    gguf_path = write_like_llama_cpp(hf_ckpt, tmp_path / "model.gguf")
    from_gguf = load_weights(gguf_path)
    from_hf = load_weights(hf_ckpt, cache=False)
    assert_same_q8(from_gguf, from_hf)
    assert from_gguf.extra["format"] == "gguf"


@pytest.mark.parametrize("linear_type", [GGMLQuantizationType.F32, GGMLQuantizationType.F16])
def test_float_gguf_is_quantized_on_load(tmp_path, linear_type):
    hf = make_model(tmp_path / "llama", "llama-tiny", dtype="f16")     # values exact in f16
    f32_dir = make_model(tmp_path / "llama-f32", "llama-tiny", dtype="f32")
    tensors = load_file(hf / "model.safetensors")
    save_file({k: v.astype(np.float32) for k, v in tensors.items()}, f32_dir / "model.safetensors")
    gguf_path = write_like_llama_cpp(f32_dir, tmp_path / "model.gguf", linear_type=linear_type)
    assert_same_q8(load_weights(gguf_path), load_weights(hf, cache=False))


def test_export_round_trips_and_matches_llama_cpp_layout(hf_ckpt, tmp_path):
    weights = load_weights(hf_ckpt, cache=False)
    exported = export_gguf(weights, tmp_path / "exported.gguf")
    assert_same_q8(load_weights(exported), weights)
    converted = write_like_llama_cpp(hf_ckpt, tmp_path / "converted.gguf")
    ours = {t.name: t for t in GGUFReader(exported).tensors}
    theirs = {t.name: t for t in GGUFReader(converted).tensors}
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert ours[name].tensor_type == t.tensor_type, name
        assert np.array_equal(np.asarray(ours[name].data), np.asarray(t.data)), name


def test_gguf_errors_name_the_tensor_and_file(tmp_path):
    hf = make_model(tmp_path / "m", "tiny", dtype="f32")
    missing = write_like_llama_cpp(hf, tmp_path / "missing.gguf", skip={"blk.1.ffn_up.weight"})
    with pytest.raises(LoadError, match=r"missing tensor 'blk\.1\.ffn_up\.weight'") as info:
        load_weights(missing)
    assert str(missing) in str(info.value)

    extra = write_like_llama_cpp(hf, tmp_path / "extra.gguf", extra={"blk.9.attn_q.weight": np.zeros((32, 64), np.float32)})
    with pytest.raises(LoadError, match=r"unexpected tensor 'blk\.9\.attn_q\.weight'"):
        load_weights(extra)

    iq2 = write_like_llama_cpp(hf, tmp_path / "iq2.gguf", linear_type=GGMLQuantizationType.IQ2_XXS)
    with pytest.raises(LoadError, match=r"cannot load \(IQ2_XXS: blk\.0\..*llama-quantize") as info:
        load_weights(iq2)
    assert str(iq2) in str(info.value)

    other_arch = write_like_llama_cpp(hf, tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(LoadError, match="architecture 'gpt2'"):
        load_weights(other_arch)

    good = write_like_llama_cpp(hf, tmp_path / "truncated.gguf")
    ends = [(t.name, t.data_offset + t.n_bytes) for t in GGUFReader(good).tensors]   # read before cutting
    os.truncate(good, good.stat().st_size - 1000)
    first_cut = next(name for name, end in ends if end > good.stat().st_size)
    with pytest.raises(LoadError, match="truncated") as info:
        load_weights(good)
    assert str(good) in str(info.value) and repr(first_cut) in str(info.value)


@pytest.mark.parametrize("preset", ["llama3-tiny", "mistral-tiny", "qwen2-tiny"])
def test_architectures_round_trip_through_gguf(tmp_path, preset):
    """Qwen2's bias tensors, Mistral's sliding window (arch llama + attention.sliding_window) and every rope
    scaling type (llama3 as llama.cpp's rope_freqs.weight divisors, YaRN as rope.scaling.* metadata) survive a GGUF: the same logits and argmax."""
    import kestrel_stream as ks
    hf_dir = make_model(tmp_path / preset, preset, seed=2, dtype="f32")
    from_hf = ks.load(hf_dir, device="cpu", cache=False)
    path = export_gguf(from_hf.weights, tmp_path / f"{preset}.gguf")
    from_gguf = ks.load(path, device="cpu")
    c, g = from_hf.config, from_gguf.config
    assert (g.arch, g.sliding_window, g.qkv_bias, g.head_dim) == (c.arch, c.sliding_window, c.qkv_bias, c.head_dim)
    if c.rope_scaling is not None and c.rope_scaling.type == "llama3":
        assert g.rope_freq_factors is not None and g.rope_scaling is None
    else:
        assert g.rope_scaling == c.rope_scaling
    prompt = [3, 17, 42, 5, 99, 1, 250, 7, 64, 31]
    a, b = from_hf.new_session().prefill(prompt), from_gguf.new_session().prefill(prompt)
    assert float(np.abs(a - b).max() / np.abs(a).max()) < 2e-3
    np.testing.assert_array_equal(a.argmax(axis=1), b.argmax(axis=1))
