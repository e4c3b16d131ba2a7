"""Write Hugging Face-layout checkpoints tensor by tensor.

The safetensors header (names, dtypes, shapes, byte offsets) is known before
any data exists, so a shard is written as header + tensors streamed one at a
time: a qwen3-8b checkpoint never needs more memory than its largest tensor.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

DTYPES = {"f32": ("F32", 4), "f16": ("F16", 2), "bf16": ("BF16", 2)}


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bit patterns (uint16), round to nearest even (as torch does)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    return ((bits + rounding) >> 16).astype(np.uint16)


def encode(x: np.ndarray, dtype: str) -> bytes:
    if dtype == "f32":
        return np.ascontiguousarray(x, dtype="<f4").tobytes()
    if dtype == "f16":
        return np.ascontiguousarray(x, dtype="<f2").tobytes()
    return to_bf16_bits(x).astype("<u2").tobytes()


def write_shard(path: Path, specs: list[tuple[str, tuple[int, ...]]], dtype: str,
                produce: Callable[[str, tuple[int, ...]], np.ndarray]) -> None:
    """Write one .safetensors file; ``produce(name, shape)`` returns each float32 tensor in turn."""
    st_dtype, itemsize = DTYPES[dtype]
    header, offset = {}, 0
    for name, shape in specs:
        size = int(np.prod(shape)) * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape in specs:
            data = produce(name, shape)
            assert data.shape == tuple(shape), (name, data.shape, shape)
            f.write(encode(data, dtype))
    tmp.replace(path)


def write_checkpoint(out_dir: Path, config_json: dict, specs: Iterable[tuple[str, tuple[int, ...]]],
                     produce: Callable[[str, tuple[int, ...]], np.ndarray], dtype: str = "bf16",
                     max_shard_bytes: int = 2 << 30, on_tensor: Callable[[str], None] | None = None) -> list[Path]:
    """Write config.json and one or more shards (with model.safetensors.index.json when sharded)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    itemsize = DTYPES[dtype][1]
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    shard_bytes = 0
    for name, shape in specs:
        size = int(np.prod(shape)) * itemsize
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, shape))
        shard_bytes += size

    def produce_and_report(name, shape):
        data = produce(name, shape)
        if on_tensor:
            on_tensor(name)
        return data

    if len(shards) == 1:
        files = [out_dir / "model.safetensors"]
    else:
        files = [out_dir / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for stale in list(out_dir.glob("model*.safetensors")) + [out_dir / "model.safetensors.index.json"]:
        if stale.exists() and stale not in files:
            stale.unlink()
    for path, shard in zip(files, shards):
        write_shard(path, shard, dtype, produce_and_report)
    if len(files) > 1:
        weight_map = {name: path.name for path, shard in zip(files, shards) for name, _ in shard}
        total = sum(int(np.prod(s)) * itemsize for shard in shards for _, s in shard)
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config_json = dict(config_json, torch_dtype={"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype])
    (out_dir / "config.json").write_text(json.dumps(config_json, indent=2))
    return files
