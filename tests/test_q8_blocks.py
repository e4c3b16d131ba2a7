"""A GGUF Q8_0 load copies nothing: the weights are views of the file's blocks (model/q8_blocks.py), and
every consumer's one copy (the CPU engine's float32 weights, the device images, the split on demand)
gives exactly what the split layout gives."""
import os

import numpy as np
import pytest

import fake_cuda
import kestrel_stream as ks
from gguf_export import export_gguf
from kestrel_stream.errors import LoadError
from kestrel_stream.loading.loader import load_weights
from kestrel_stream.loading.presets import PRESETS
from bench.synthetic import random_q8_weights
from kestrel_stream.model.q8_blocks import Q8Blocks
from kestrel_stream.model.quant import QTensor
from kestrel_stream.obs import load_stages
from kestrel_stream.run.device import image_writer
from kestrel_stream.run.device.image_writer import ImageWriter, write_image
from kestrel_stream.run.device.budget import image_bytes


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    weights = random_q8_weights(PRESETS["tiny"], seed=3)
    return weights, export_gguf(weights, tmp_path_factory.mktemp("q8b") / "tiny.gguf")


def split_of(w: QTensor) -> QTensor:
    return QTensor(np.array(w.qs), np.array(w.scales))


def test_a_q8_0_gguf_loads_as_read_only_views_of_the_file(tiny_gguf):
    source, path = tiny_gguf
    weights = load_weights(path)
    layer = weights.layers[0]
    assert isinstance(layer.wqkv, Q8Blocks) and len(layer.wqkv.segments) == 3      # q, k, v: no fusion copy
    assert len(layer.w_gate_up.segments) == 2
    for segment in layer.wqkv.segments + layer.w_gate_up.segments + weights.embed.segments:
        assert not segment.flags.owndata and not segment.flags.writeable          # the read-only mmap itself
    assert layer.wqkv._split is None
    # the same values as the weights that were written
    np.testing.assert_array_equal(layer.wqkv.qs, np.concatenate([source.layers[0].wqkv.qs]))
    np.testing.assert_array_equal(layer.w_down.scales.view(np.uint16), source.layers[0].w_down.scales.view(np.uint16))


def test_every_read_of_the_blocks_equals_the_split_layout_bit_for_bit(tiny_gguf):
    _, path = tiny_gguf
    weights = load_weights(path)
    w = weights.layers[1].w_gate_up                  # two segments
    split = split_of(Q8Blocks(list(w.segments)))
    np.testing.assert_array_equal(w.dequantize().view(np.uint32), split.dequantize().view(np.uint32))
    rows = np.array([0, 5, 63, 64, PRESETS["tiny"].vocab_size - 1, 5])
    embed = weights.embed
    np.testing.assert_array_equal(embed.dequantize_rows(rows), split_of(Q8Blocks(list(embed.segments)))
                                  .dequantize_rows(rows))
    # rows across the segment boundary, written into strided destinations
    n = w.shape[0]
    part = w.rows(n // 2 - 3, n // 2 + 5)
    assert part.shape == (8, w.shape[1]) and len(part.segments) == 2
    qs = np.zeros((8, 2, w.shape[1]), np.int8)[:, 1]
    scales = np.zeros((8, 3, w.shape[1] // 32), np.float16)[:, 0]
    part.copy_into(qs, scales)
    np.testing.assert_array_equal(qs, split.qs[n // 2 - 3:n // 2 + 5])
    np.testing.assert_array_equal(scales.view(np.uint16), split.scales[n // 2 - 3:n // 2 + 5].view(np.uint16))
    np.testing.assert_array_equal(w.to_blocks(), split.to_blocks())


@pytest.mark.parametrize("interleave", [False, True])
def test_the_device_image_written_from_the_blocks_is_the_split_layouts_image(tiny_gguf, interleave, monkeypatch):
    _, path = tiny_gguf
    w = load_weights(path).layers[0].w_gate_up
    nbytes = image_bytes(*w.shape)
    from_blocks, from_split = np.zeros(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    write_image(from_blocks, w, interleave)
    write_image(from_split, split_of(w), interleave)
    np.testing.assert_array_equal(from_blocks, from_split)
    # in pieces of a few rows on three threads (pieces cross the gate/up boundary): the same bytes
    monkeypatch.setattr(image_writer, "PIECE_BYTES", 7 * w.shape[1])
    threaded = np.zeros(nbytes, np.uint8)
    with ImageWriter(workers=3) as writer:
        writer.write_images([(threaded, w, interleave)])
    np.testing.assert_array_equal(threaded, from_split)


def test_gguf_in_gpu_mode_matches_the_cpu_engine_and_splits_nothing(tiny_gguf, monkeypatch):
    from hf_oracle import relative_error
    _, path = tiny_gguf
    fake_cuda.install(monkeypatch, mode="deferred")
    load_stages.reset()
    gpu = ks.load(path, device="cuda", mode="gpu", max_seq_len=32)
    with gpu.new_session() as s:
        got = s.prefill([3, 1, 4, 1, 5])
    assert not any("qs/scales" in name for name in load_stages.snapshot()), load_stages.snapshot()
    cpu = ks.load(path, device="cpu", max_seq_len=32)    # (the host kernels read a Q8_0 weight as qs / scales)
    with cpu.new_session() as ref:
        expected = ref.prefill([3, 1, 4, 1, 5])
    assert relative_error(got, expected) < 2e-3
    np.testing.assert_array_equal(got.argmax(axis=1), expected.argmax(axis=1))
    gpu.close()
    cpu.close()


def test_a_converted_gguf_cut_short_names_file_and_tensor_and_leaves_no_cache(tmp_path):
    from gguf import GGMLQuantizationType, GGUFReader
    from test_gguf import write_like_llama_cpp
    from kestrel_stream.loading.presets import make_model
    hf = make_model(tmp_path / "m", "tiny", dtype="f32")
    path = write_like_llama_cpp(hf, tmp_path / "f16.gguf", linear_type=GGMLQuantizationType.F16)
    last = max(GGUFReader(path).tensors, key=lambda t: t.data_offset)
    os.truncate(path, path.stat().st_size - 16)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(LoadError, match="truncated") as info:
        load_weights(path, cache_dir=tmp_path / "qcache")
    assert str(path) in str(info.value) and repr(last.name) in str(info.value)
    assert sorted(os.listdir(tmp_path)) == before                # no quantized cache, not even a partial one


def test_a_tensor_off_the_files_alignment_is_a_load_error_naming_it(tmp_path):
    from gguf import GGUFReader
    _, path = random_q8_weights(PRESETS["tiny"], seed=1), export_gguf(random_q8_weights(PRESETS["tiny"], seed=1),
                                                                     tmp_path / "tiny.gguf")
    reader = GGUFReader(path)
    tensor = reader.tensors[3]
    offset_field = tensor.field.parts[-1]           # the tensor info's data offset (u64), in the mmap
    data = bytearray(path.read_bytes())
    at = tensor.field.offset + sum(p.nbytes for p in tensor.field.parts[:-1])
    assert int.from_bytes(data[at:at + 8], "little") == int(offset_field[0])
    data[at:at + 8] = (int(offset_field[0]) + 2).to_bytes(8, "little")
    bad = tmp_path / "misaligned.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(LoadError, match=rf"{tensor.name!r}.*alignment") as info:
        load_weights(bad)
    assert str(bad) in str(info.value)


def test_the_weights_and_the_tokenizer_share_one_parsed_header_until_the_file_changes(tmp_path):
    from kestrel_stream.loading.gguf_file import open_shared
    path = export_gguf(random_q8_weights(PRESETS["tiny"], seed=2), tmp_path / "tiny.gguf")
    first = open_shared(path)
    assert open_shared(path) is first
    export_gguf(random_q8_weights(PRESETS["tiny"], seed=5), path)        # rewritten: parsed again
    os.utime(path, ns=(first_ns := path.stat().st_mtime_ns + 10**9, first_ns))
    assert open_shared(path) is not first
