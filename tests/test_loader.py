"""Loading Hugging Face checkpoints: dtypes, shards, error messages, and the quantized cache."""
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kestrel_stream.loading.loader as loader
import kestrel_stream.loading.qcache as qcache
from kestrel_stream.loading.checkpoint_writer import to_bf16_bits, write_checkpoint
from kestrel_stream.loading.loader import LoadError, load_weights
from kestrel_stream.loading.presets import PRESETS, make_model, random_weights
from kestrel_stream.model.quant import quantize
from kestrel_stream.model.weights import hf_tensor_shapes


def assert_same_q8(a, b):
    """Bit-for-bit equal ModelWeights (qs, scale bits, norms, tying)."""
    assert a.config == b.config and a.tied == b.tied
    for x, y in zip(qcache.flatten(a), qcache.flatten(b), strict=True):
        assert x[0] == y[0]
        assert np.array_equal(x[1].view(np.uint8), y[1].view(np.uint8)), x[0]


def exact_in_all_dtypes(preset, seed=0):
    """Random tensors whose values are exact in bf16 and f16 alike, so every dtype stores the same numbers."""
    produce = random_weights(PRESETS[preset], seed)

    def exact(name, shape):
        x = (to_bf16_bits(produce(name, shape)).astype(np.uint32) << 16).view(np.float32)
        x[np.abs(x) < 2.0 ** -14] = 0      # below f16's normal range bf16 keeps bits f16 would lose
        return x
    return exact


def write_exact(out_dir, preset, dtype, max_shard_bytes=2 << 30):
    cfg = PRESETS[preset]
    write_checkpoint(Path(out_dir), cfg.to_hf_dict(), list(hf_tensor_shapes(cfg).items()),
                     exact_in_all_dtypes(preset), dtype=dtype, max_shard_bytes=max_shard_bytes)
    return Path(out_dir)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_dtypes_and_shards_load_to_identical_q8(tmp_path, preset):
    reference = load_weights(write_exact(tmp_path / "f32", preset, "f32"), cache=False)
    for dtype in ("f16", "bf16"):
        assert_same_q8(load_weights(write_exact(tmp_path / dtype, preset, dtype), cache=False), reference)
    sharded = write_exact(tmp_path / "sharded", preset, "bf16", max_shard_bytes=20_000)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    assert_same_q8(load_weights(sharded, cache=False), reference)


def test_load_matches_safetensors_library_and_fuses_rows(tmp_path):
    ckpt = make_model(tmp_path / "m", "llama-tiny", dtype="f32")
    tensors = load_file(ckpt / "model.safetensors")
    w = load_weights(ckpt, cache=False)
    layer = "model.layers.1."
    qkv = np.concatenate([tensors[layer + f"self_attn.{p}_proj.weight"] for p in "qkv"])
    assert np.array_equal(w.layers[1].wqkv.qs, quantize(qkv).qs)
    gate_up = np.concatenate([tensors[layer + f"mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert np.array_equal(w.layers[1].w_gate_up.scales, quantize(gate_up).scales)
    assert np.array_equal(w.lm_head.qs, quantize(tensors["lm_head.weight"]).qs)
    assert np.array_equal(w.layers[0].attn_norm, tensors[layer.replace("1", "0") + "input_layernorm.weight"])
    assert not w.tied
    tied = load_weights(make_model(tmp_path / "t", "tiny", dtype="f32"), cache=False)
    assert tied.tied and tied.lm_head is tied.embed


def test_progress_reports_bytes_up_to_total(tmp_path):
    calls = []
    load_weights(make_model(tmp_path / "m", "tiny"), cache=False, progress=lambda *a: calls.append(a))
    done = [c[0] for c in calls]
    assert done == sorted(done) and done[-1] == calls[-1][1] > 0
    assert any("embed_tokens" in c[2] for c in calls)


# --- errors: each names the tensor and the file ---------------------------------------------

@pytest.fixture
def f32_ckpt(tmp_path):
    ckpt = make_model(tmp_path / "m", "tiny", dtype="f32")
    return ckpt, load_file(ckpt / "model.safetensors")


def expect_error(ckpt, *fragments):
    with pytest.raises(LoadError) as info:
        load_weights(ckpt, cache=False)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    return str(info.value)


def test_missing_tensor(f32_ckpt):
    ckpt, tensors = f32_ckpt
    name = "model.layers.1.mlp.up_proj.weight"
    del tensors[name]
    save_file(tensors, ckpt / "model.safetensors")
    expect_error(ckpt, "missing", name, "model.safetensors")


def test_unexpected_tensor(f32_ckpt):
    ckpt, tensors = f32_ckpt
    tensors["model.layers.0.mlp.extra.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, ckpt / "model.safetensors")
    expect_error(ckpt, "unexpected", "model.layers.0.mlp.extra.weight", str(ckpt / "model.safetensors"))


def test_misshaped_tensor(f32_ckpt):
    ckpt, tensors = f32_ckpt
    name = "model.layers.0.self_attn.k_proj.weight"
    rows, cols = tensors[name].shape
    tensors[name] = tensors[name][:rows // 2]
    save_file(tensors, ckpt / "model.safetensors")
    expect_error(ckpt, name, f"[{rows // 2}, {cols}]", f"[{rows}, {cols}]", str(ckpt / "model.safetensors"))


def test_unsupported_dtype(f32_ckpt):
    ckpt, tensors = f32_ckpt
    name = "model.norm.weight"
    tensors[name] = tensors[name].astype(np.float64)
    save_file(tensors, ckpt / "model.safetensors")
    expect_error(ckpt, name, "F64", str(ckpt / "model.safetensors"))


def test_truncated_file(f32_ckpt):
    ckpt, _ = f32_ckpt
    path = ckpt / "model.safetensors"
    header_bytes = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8:8 + header_bytes])
    last = max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])
    os.truncate(path, path.stat().st_size - 10)
    expect_error(ckpt, "truncated", last, str(path))


def test_bad_header_json(f32_ckpt):
    ckpt, _ = f32_ckpt
    path = ckpt / "model.safetensors"
    path.write_bytes((20).to_bytes(8, "little") + b'{"not": json at all}' + b"\0" * 64)
    expect_error(ckpt, "header JSON", str(path))


def test_index_points_at_missing_shard(tmp_path):
    ckpt = make_model(tmp_path / "m", "tiny", max_shard_bytes=20_000)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    name, shard = next(iter(index["weight_map"].items()))
    (ckpt / shard).unlink()
    expect_error(ckpt, name, str(ckpt / shard), "does not exist")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(LoadError, match="no such file"):
        load_weights(tmp_path / "nowhere")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(LoadError, match="weights.bin"):
        load_weights(tmp_path / "weights.bin")


# --- the quantized cache ----------------------------------------------------------------------

@pytest.fixture
def quantize_calls(monkeypatch):
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return quantize(*args, **kwargs)
    monkeypatch.setattr(loader, "quantize", counting)
    return calls


def test_second_load_hits_the_cache(tmp_path, quantize_calls):
    ckpt = make_model(tmp_path / "m", "llama-tiny")
    first = load_weights(ckpt)
    assert quantize_calls and first.extra["qcache"] == {"hit": False, "path": str(
        ckpt.resolve() / ".kestrel" / qcache.CACHE_NAME)}
    quantize_calls.clear()
    second = load_weights(ckpt)
    assert quantize_calls == [] and second.extra["qcache"]["hit"] is True
    assert isinstance(second.layers[0].wqkv.qs.base, np.memmap) or isinstance(second.layers[0].wqkv.qs, np.memmap)
    assert_same_q8(second, first)


def test_touched_or_modified_shard_rebuilds(tmp_path, quantize_calls, caplog):
    ckpt = make_model(tmp_path / "m", "tiny")
    load_weights(ckpt)
    shard = ckpt / "model.safetensors"
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    quantize_calls.clear()
    with caplog.at_level(logging.WARNING):
        touched = load_weights(ckpt)
    assert quantize_calls and touched.extra["qcache"]["hit"] is False and "stale" in caplog.text

    make_model(ckpt, "tiny", seed=1)      # new values, same shapes
    changed = load_weights(ckpt)
    assert changed.extra["qcache"]["hit"] is False
    assert not np.array_equal(changed.embed.qs, touched.embed.qs)
    assert_same_q8(load_weights(ckpt, cache=False), changed)
    assert load_weights(ckpt).extra["qcache"]["hit"] is True


@pytest.mark.parametrize("damage", ["truncate", "flip_data_byte", "garbage_header", "empty"])
def test_corrupt_cache_is_rebuilt(tmp_path, quantize_calls, caplog, damage):
    ckpt = make_model(tmp_path / "m", "tiny")
    good = load_weights(ckpt)
    path = Path(good.extra["qcache"]["path"])
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:len(data) - 100]
    elif damage == "flip_data_byte":
        data[-200] ^= 0xFF
    elif damage == "garbage_header":
        data[30:40] = b"#" * 10
    else:
        data = b""
    path.write_bytes(bytes(data))
    quantize_calls.clear()
    with caplog.at_level(logging.WARNING):
        rebuilt = load_weights(ckpt)
    assert quantize_calls and rebuilt.extra["qcache"]["hit"] is False and "corrupt" in caplog.text
    assert_same_q8(rebuilt, good)
    assert load_weights(ckpt).extra["qcache"]["hit"] is True


def test_cache_dir_and_disabled_cache(tmp_path):
    ckpt = make_model(tmp_path / "m", "tiny")
    assert load_weights(ckpt, cache=False).extra["qcache"] == {"hit": False, "path": None}
    assert not (ckpt / ".kestrel").exists()
    cache_dir = tmp_path / "cache"
    w = load_weights(ckpt, cache_dir=cache_dir)
    assert Path(w.extra["qcache"]["path"]).parent == cache_dir
    assert load_weights(ckpt, cache_dir=cache_dir).extra["qcache"]["hit"] is True
    assert not (ckpt / ".kestrel").exists()


def test_failed_cache_write_leaves_nothing_behind(tmp_path, monkeypatch, caplog):
    ckpt = make_model(tmp_path / "m", "tiny")

    def crash(src, dst):
        raise OSError("simulated crash before rename")
    monkeypatch.setattr(qcache.os, "replace", crash)
    with caplog.at_level(logging.WARNING):
        w = load_weights(ckpt)
    assert w.extra["qcache"] == {"hit": False, "path": None} and "could not write" in caplog.text
    assert list((ckpt / ".kestrel").iterdir()) == []
