"""The on-disk Q8_0 cache of a quantized Hugging Face checkpoint.

Quantizing a large checkpoint takes far longer than reading its int8 bytes,
so the first load writes the quantized weights to one file and later loads
memory-map it.  File layout (little-endian):

    MAGIC (8 bytes) | header_bytes u64 | header_crc32 u32 | 4 zero bytes
    header JSON: format_version, key, tied, data_bytes,
                 tensors [{name, dtype, shape, offset, crc32}]
    zero padding to ALIGN_BYTES, then each array at an ALIGN_BYTES-aligned offset

A routed layer stores its router and its two stacked expert weights instead of
gate_up and down (the config in the key says which layers route, so the layout
of dense models is unchanged and needs no new version).
The key hashes the format version, the config and every shard's (name, size,
mtime_ns): editing or touching a shard makes the cache stale.  A stale,
truncated or corrupt file is reported in the log and rebuilt by the caller.
Writes go to a temporary file that is renamed into place, so a crash mid-write
never leaves a half-written cache where a reader would find it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from kestrel_stream.model.config import ModelConfig
from kestrel_stream.options import default_cache_root
from kestrel_stream.model.quant import QTensor
from kestrel_stream.model.weights import LayerWeights, ModelWeights, MoeWeights

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"KSQ8C\x00\x00\x01"
PREFIX = struct.Struct("<8sQI4x")
ALIGN_BYTES = 64
CACHE_NAME = "q8_0.kcache"


def cache_key(cfg: ModelConfig, shard_files: list[Path]) -> str:
    """A hash that changes whenever the config, a shard, or this file format changes."""
    shards = []
    for file in shard_files:
        st = file.stat()
        shards.append([file.name, st.st_size, st.st_mtime_ns])
    blob = json.dumps({"format_version": FORMAT_VERSION, "config": cfg.to_dict(), "shards": shards},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def default_cache_dir() -> Path:
    return default_cache_root() / "qcache"


def cache_path(ckpt_dir: Path, cache_dir: str | Path | None = None, stem: str | None = None) -> Path:
    """Where the cache of ``ckpt_dir`` (or of its file ``stem``, a GGUF) lives.

    An explicit ``cache_dir`` wins; otherwise ``<ckpt_dir>/.kestrel/`` when the
    checkpoint directory is writable, else the user cache directory.  Outside
    the checkpoint the file name carries a hash of the checkpoint's path so
    that many checkpoints can share one cache directory.
    """
    ckpt_dir = Path(ckpt_dir).resolve()
    local_dir = ckpt_dir / ".kestrel"
    writable = os.access(local_dir if local_dir.exists() else ckpt_dir, os.W_OK)
    name = f"{stem}.{CACHE_NAME}" if stem else CACHE_NAME
    if cache_dir is None and writable:
        return local_dir / name
    source = ckpt_dir / stem if stem else ckpt_dir
    path_id = hashlib.sha256(str(source).encode()).hexdigest()[:16]
    return Path(cache_dir or default_cache_dir()) / f"{source.name}-{path_id}.{CACHE_NAME}"


def flatten(weights: ModelWeights) -> list[tuple[str, np.ndarray]]:
    """Every array of the model under a stable name; a tied lm_head is stored once (as embed)."""
    arrays = [("embed.qs", weights.embed.qs), ("embed.scales", weights.embed.scales),
              ("final_norm", weights.final_norm)]
    if not weights.tied:
        arrays += [("lm_head.qs", weights.lm_head.qs), ("lm_head.scales", weights.lm_head.scales)]
    for i, layer in enumerate(weights.layers):
        for field in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "qkv_bias"):
            if getattr(layer, field) is not None:
                arrays.append((f"layers.{i}.{field}", getattr(layer, field)))
        for field in ("wqkv", "wo", "w_gate_up", "w_down"):
            q = getattr(layer, field)
            if q is not None:           # None: a routed layer's MLP, its experts below
                arrays += [(f"layers.{i}.{field}.qs", q.qs), (f"layers.{i}.{field}.scales", q.scales)]
        if layer.moe is not None:
            moe = layer.moe
            arrays += [(f"layers.{i}.router", moe.router),
                       (f"layers.{i}.experts_gate_up.qs", moe.gate_up.qs),
                       (f"layers.{i}.experts_gate_up.scales", moe.gate_up.scales),
                       (f"layers.{i}.experts_down.qs", moe.down.qs),
                       (f"layers.{i}.experts_down.scales", moe.down.scales)]
    return arrays


def unflatten(arrays: dict[str, np.ndarray], cfg: ModelConfig, tied: bool, source: str) -> ModelWeights:
    def q(name: str) -> QTensor | None:
        return QTensor(arrays[f"{name}.qs"], arrays[f"{name}.scales"]) if f"{name}.qs" in arrays else None

    def experts(i: int) -> MoeWeights | None:
        if not cfg.moe_layer(i):
            return None
        return MoeWeights(arrays[f"layers.{i}.router"], q(f"layers.{i}.experts_gate_up"), q(f"layers.{i}.experts_down"))

    layers = [LayerWeights(
        attn_norm=arrays[f"layers.{i}.attn_norm"], wqkv=q(f"layers.{i}.wqkv"), wo=q(f"layers.{i}.wo"),
        mlp_norm=arrays[f"layers.{i}.mlp_norm"], w_gate_up=q(f"layers.{i}.w_gate_up"),
        w_down=q(f"layers.{i}.w_down"), q_norm=arrays.get(f"layers.{i}.q_norm"),
        k_norm=arrays.get(f"layers.{i}.k_norm"), qkv_bias=arrays.get(f"layers.{i}.qkv_bias"), moe=experts(i),
    ) for i in range(cfg.num_hidden_layers)]
    embed = q("embed")
    return ModelWeights(config=cfg, embed=embed, layers=layers, final_norm=arrays["final_norm"],
                        lm_head=embed if tied else q("lm_head"), source=source)


def _aligned(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def write(path: Path, key: str, weights: ModelWeights) -> bool:
    """Atomically write the cache; on failure log a warning and return False (loading still succeeds)."""
    arrays = flatten(weights)
    entries, offset = [], 0
    for name, a in arrays:
        entries.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset,
                        "crc32": zlib.crc32(memoryview(np.ascontiguousarray(a)).cast("B"))})
        offset = _aligned(offset + a.nbytes)
    header = json.dumps({"format_version": FORMAT_VERSION, "key": key, "tied": weights.tied,
                         "data_bytes": offset, "tensors": entries}).encode()
    data_start = _aligned(PREFIX.size + len(header))
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(PREFIX.pack(MAGIC, len(header), zlib.crc32(header)))
            f.write(header)
            f.write(b"\0" * (data_start - f.tell()))
            for (_, a), entry in zip(arrays, entries):
                f.seek(data_start + entry["offset"])
                f.write(memoryview(np.ascontiguousarray(a)).cast("B"))
            f.truncate(data_start + offset)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not write quantized cache %s (%s); the next load will quantize again", path, e)
        tmp.unlink(missing_ok=True)
        return False
    log.info("wrote quantized cache %s (%.1f MB)", path, (data_start + offset) / 1e6)
    return True


class CorruptCache(Exception):
    pass


def read(path: Path, key: str, cfg: ModelConfig, source: str, progress=None) -> ModelWeights | None:
    """Memory-map a valid cache for ``key``; None (with a logged note) when missing, stale or corrupt."""
    if not path.exists():
        log.info("no quantized cache at %s; quantizing", path)
        return None
    try:
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        header = _read_header(mapped)
        if header["format_version"] != FORMAT_VERSION or header["key"] != key:
            log.warning("quantized cache %s is stale (checkpoint or format changed); rebuilding", path)
            return None
        data_start = _aligned(PREFIX.size + PREFIX.unpack(bytes(mapped[:PREFIX.size]))[1])
        if len(mapped) != data_start + header["data_bytes"]:
            raise CorruptCache(f"size {len(mapped)} bytes, expected {data_start + header['data_bytes']}")
        arrays = {}
        total = header["data_bytes"]
        for entry in header["tensors"]:
            dtype = np.dtype(entry["dtype"])
            nbytes = int(np.prod(entry["shape"], dtype=np.int64)) * dtype.itemsize
            start = data_start + entry["offset"]
            raw = mapped[start:start + nbytes]
            if zlib.crc32(raw) != entry["crc32"]:
                raise CorruptCache(f"checksum mismatch in {entry['name']}")
            arrays[entry["name"]] = raw.view(dtype).reshape(entry["shape"])
            if progress:
                progress(entry["offset"] + nbytes, total, f"verify cache {entry['name']}")
        return unflatten(arrays, cfg, bool(header["tied"]), source)
    except (CorruptCache, ValueError, KeyError, TypeError, struct.error, AssertionError) as e:
        log.warning("quantized cache %s is corrupt (%s); rebuilding", path, e)
        return None


def _read_header(mapped: np.ndarray) -> dict:
    if len(mapped) < PREFIX.size:
        raise CorruptCache("shorter than its fixed prefix")
    magic, header_bytes, header_crc = PREFIX.unpack(bytes(mapped[:PREFIX.size]))
    if magic != MAGIC:
        raise CorruptCache("bad magic")
    blob = bytes(mapped[PREFIX.size:PREFIX.size + header_bytes])
    if len(blob) != header_bytes or zlib.crc32(blob) != header_crc:
        raise CorruptCache("header checksum mismatch")
    return json.loads(blob)
