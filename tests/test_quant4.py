"""4/6-bit GGUF blocks kept as blocks (model/quant4.py): values, layouts, the loader, the cost model,
and the CPU engine on a model stored in each type against transformers on its dequantized weights."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

import kestrel_stream as ks
from bench.make_gguf import tensor_type, write as write_gguf
from kestrel_stream.errors import LoadError
from kestrel_stream.loading.loader import load_weights
from kestrel_stream.loading.presets import make_model
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.model.quant import QTensor, quantize
from bench.synthetic import random_blocks
from kestrel_stream.model.quant4 import BlockTensor, RowStack, fuse_rows, image_bytes_of, image_layout, write_image_parts
from quant4_reference import group_form, join_blocks
from scheduler.ops import format_bytes, step_ops

from hf_oracle import assert_logits_match, hf_logits, hf_model_with_weights

# awkward shapes: odd row counts, K of 5 / 3 / 7 blocks
SHAPES = {"Q4_0": (7, 160), "Q4_K": (5, 768), "Q6_K": (3, 1792)}
# every matrix K % 256 == 0 (the K-quants' block); 3 layers: Q4_K_M's use_more_bits picks layer 2 only
CFG = ModelConfig(arch="qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=320, rms_norm_eps=1e-6, rope_theta=1e6,
                  tie_word_embeddings=True, max_position_embeddings=128)
LLAMA = dataclasses.replace(CFG, arch="llama", tie_word_embeddings=False, num_key_value_heads=1)


@pytest.mark.parametrize("fmt", sorted(SHAPES))
def test_dequantize_equals_gguf_py_bit_for_bit(fmt):
    rows, cols = SHAPES[fmt]
    blocks = random_blocks(np.random.default_rng(1), fmt, rows, cols, 0.05)
    t = BlockTensor(fmt, blocks, cols)
    reference = gguf_quants.dequantize(blocks, T[fmt])
    assert np.array_equal(t.dequantize(), reference)
    assert np.array_equal(t.dequantize_rows(np.array([rows - 1, 0, rows - 1])), reference[[rows - 1, 0, rows - 1]])
    levels, s, o = group_form(blocks, fmt, cols)          # the kernels' groups of 16: s * level - o
    grouped = s[:, :, None] * levels.reshape(rows, -1, 16).astype(np.float32) - o[:, :, None]
    assert np.array_equal(grouped.reshape(rows, cols), reference)
    assert t.nbytes == format_bytes(rows, cols, fmt) == blocks.nbytes


@pytest.mark.parametrize("fmt", sorted(SHAPES))
def test_device_image_is_every_qs_then_every_meta_and_lossless(fmt):
    rows, cols = SHAPES[fmt]
    t = BlockTensor(fmt, random_blocks(np.random.default_rng(2), fmt, rows, cols, 0.05), cols)
    [(kind, n, qs_at, meta_at, end)] = image_layout(t)
    qs, meta = t.split()
    assert (kind, n, qs_at, meta_at % 256, end) == (fmt, rows, 0, 0, meta_at + meta.size)
    assert qs_at + qs.size <= meta_at < qs.size + 256
    image = np.zeros(image_bytes_of(t), np.uint8)
    write_image_parts(image, t)
    back = join_blocks(image[:qs.size].reshape(rows, -1), image[meta_at:end].reshape(rows, -1), fmt, cols)
    assert np.array_equal(back, t.blocks)


def test_fused_rows_keep_their_formats_or_fall_back_to_q8_0():
    rng = np.random.default_rng(3)
    q4k = lambda n: BlockTensor("Q4_K", random_blocks(rng, "Q4_K", n, 256, 0.05), 256)   # noqa: E731
    q6k = BlockTensor("Q6_K", random_blocks(rng, "Q6_K", 2, 256, 0.05), 256)
    same = fuse_rows([q4k(3), q4k(2)])
    assert isinstance(same, BlockTensor) and same.shape == (5, 256)
    a, b = q4k(3), q4k(1)
    stack = fuse_rows([a, b, q6k])
    assert isinstance(stack, RowStack) and stack.formats == ("Q4_K", "Q6_K") and stack.shape == (6, 256)
    assert np.array_equal(stack.dequantize(), np.concatenate([a.dequantize(), b.dequantize(), q6k.dequantize()]))
    # a stacked image: both parts' qs, then both metas, within one alignment of the bytes
    layout = image_layout(stack)
    assert [(k, n) for k, n, *_ in layout] == [("Q4_K", 4), ("Q6_K", 2)]
    assert layout[1][2] == 4 * 128 and layout[1][3] % 16 == 0 and image_bytes_of(stack) < stack.nbytes + 256
    # gate/up pairs must share one format; three runs or Q8_0 beside blocks: requantized to Q8_0
    assert isinstance(fuse_rows([a, q6k], allow_stack=False), QTensor)
    assert isinstance(fuse_rows([a, q6k, b]), QTensor)
    q8 = quantize(rng.standard_normal((2, 256)).astype(np.float32))
    mixed = fuse_rows([a, q8])
    assert isinstance(mixed, QTensor) and np.array_equal(mixed.qs[3:], q8.qs)


def test_cost_model_counts_each_weight_in_its_format(tmp_path):
    path = tmp_path / "m.gguf"
    types = write_gguf(CFG, None, str(path), seed=0, mix="q4_k_m")
    weights = load_weights(path)
    formats = dict(weights.config.weight_formats)
    assert formats["model.layers.2.self_attn.v_proj.weight"] == "Q6_K" == types["blk.2.attn_v.weight"]
    assert formats["model.layers.0.self_attn.v_proj.weight"] == "Q4_K"
    assert formats["model.embed_tokens.weight"] == "Q6_K"              # tied: llama.cpp's output type
    refs = {w.name: w for op in step_ops(weights.config, 1) for w in op.weights}
    assert refs["model.layers.2.mlp.down_proj.weight"].nbytes == format_bytes(256, 512, "Q6_K")
    assert refs["model.layers.1.mlp.down_proj.weight"].nbytes == format_bytes(256, 512, "Q4_K")
    projections = sum(w.nbytes for name, w in refs.items() if len(w.shape) == 2)
    assert projections == weights.quantized_bytes()                     # the bytes the window streams
    assert isinstance(weights.layers[2].wqkv, RowStack) and isinstance(weights.layers[0].wqkv, BlockTensor)


@pytest.mark.parametrize("mix,cfg", [("q4_0", LLAMA), ("q6_k", CFG), ("q4_k_m", CFG)],
                         ids=["q4_0-llama", "q6_k", "q4_k_m"])
def test_cpu_engine_on_blocks_matches_transformers(tmp_path, mix, cfg):
    path = tmp_path / f"{mix}.gguf"
    types = write_gguf(cfg, None, str(path), seed=5, mix=mix)
    engine = ks.load(path, device="cpu")
    assert {kind for _, kind in engine.config.weight_formats} == set(types.values())
    model = hf_model_with_weights(make_model(tmp_path / "hf", cfg, seed=0, dtype="f32"), engine.weights)
    prompt = [3, 17, 42, 5, 99, 1, 250]
    s = engine.new_session()
    steps = [s.prefill(prompt)]
    tokens = list(prompt)
    for _ in range(6):
        tokens.append(int(np.argmax(steps[-1][-1])))
        steps.append(s.decode(tokens[-1])[None])
    ours, reference = np.concatenate(steps), hf_logits(model, tokens)
    assert_logits_match(ours, reference)


def test_q8_0_option_converts_blocks_at_load(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(CFG, None, str(path), seed=0, mix="q4_k_m")
    native, converted = load_weights(path), load_weights(path, gguf_blocks="q8_0", cache=False)
    assert isinstance(converted.layers[0].w_down, QTensor) and converted.config.weight_formats == ()
    assert converted.quantized_bytes() > 1.6 * native.quantized_bytes()
    q8 = quantize(native.layers[1].w_down.dequantize())
    assert np.array_equal(converted.layers[1].w_down.qs, q8.qs)
    with pytest.raises(LoadError, match="blocks=.q4."):
        load_weights(path, gguf_blocks="q4")


def test_llama_mix_follows_llama_cpp():
    assert tensor_type("q4_k_m", "output.weight", 28, False) == "Q6_K"
    assert tensor_type("q4_k_m", "token_embd.weight", 28, False) == "Q4_K"
    assert tensor_type("q4_k_m", "blk.2.attn_v.weight", 28, True) == "Q6_K"
    assert tensor_type("q4_k_m", "blk.3.attn_v.weight", 28, True) == "Q4_K"
    assert tensor_type("q4_k_m", "blk.5.ffn_down.weight", 28, True) == "Q6_K"
    assert tensor_type("q4_k_m", "blk.5.ffn_up.weight", 28, True) == "Q4_K"


@pytest.mark.parametrize("mix,cfg", [("q4_k_m", CFG), ("q4_0", LLAMA)], ids=["q4_k_m", "q4_0-llama"])
def test_plan_counts_the_formats_the_file_loads_to(tmp_path, mix, cfg):
    from kestrel_stream.cli.plan import read_config
    path = tmp_path / "m.gguf"
    write_gguf(cfg, None, str(path), seed=0, mix=mix)
    assert read_config(str(path)).weight_formats == load_weights(path).config.weight_formats != ()
    assert read_config(str(path), "q8_0").weight_formats == ()
