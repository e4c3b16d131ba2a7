"""Load a model's weights: a Hugging Face checkpoint directory or a .gguf file.

Safetensors files are memory-mapped and their headers parsed here (the
format is 8 bytes of header length, a JSON header, then raw tensor bytes), so
every tensor is a view into the page cache and is quantized one at a time:
the loader never holds more than one tensor's float32 copy (and only row
chunks of it for bf16).  Every name, dtype, shape and byte range is checked
against config.json before any quantization starts, so a broken checkpoint
fails in milliseconds with a message that names the tensor and the file.
"""
from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kestrel_stream.errors import LoadError  # noqa: F401  (re-exported: loaders raise it)
from kestrel_stream.loading import Progress, qcache
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.model.quant import QTensor, quantize
from kestrel_stream.model.weights import HF_GLOBAL_NAMES, ModelWeights, assemble_weights, hf_tensor_shapes

log = logging.getLogger(__name__)


SAFETENSORS_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}   # BF16 read as its bit patterns
INDEX_NAME = "model.safetensors.index.json"
# Harmless extras real checkpoints carry: a copy of a tied lm_head, and the rope table old
# Llama exports stored; both are recomputed or shared, so they are skipped, not rejected.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class TensorSource:
    """Where one tensor's bytes live inside a safetensors file."""
    name: str
    file: Path
    dtype: str                 # safetensors dtype: F32 | F16 | BF16
    shape: tuple[int, ...]
    offset: int                # absolute byte offset of the data in ``file``
    nbytes: int


def load_weights(path: str | Path, *, cache: bool = True, cache_dir: str | Path | None = None,
                 progress: Progress | None = None, gguf_blocks: str = "native") -> ModelWeights:
    """Load a HF checkpoint directory or a .gguf file (either cached as Q8_0 once converted).

    gguf_blocks: "native" keeps a GGUF's Q4_0 / Q4_K / Q6_K tensors in their blocks, "q8_0" converts them."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from kestrel_stream.loading.gguf import read_gguf
        return read_gguf(path, progress=progress, cache=cache, cache_dir=cache_dir, blocks=gguf_blocks)
    if path.is_dir():
        return _load_hf_dir(path, cache, cache_dir, progress)
    if not path.exists():
        raise LoadError(f"{path}: no such file or directory")
    raise LoadError(f"{path}: expected a checkpoint directory (config.json + *.safetensors) or a .gguf file")


def _load_hf_dir(ckpt_dir: Path, cache: bool, cache_dir, progress: Progress | None) -> ModelWeights:
    cfg = ModelConfig.from_file(ckpt_dir / "config.json")
    shard_files = find_shards(ckpt_dir)
    sources = index_tensors(shard_files, ckpt_dir)
    check_against_config(sources, cfg, ckpt_dir)
    cache_path = None
    if cache:
        key = qcache.cache_key(cfg, shard_files)
        cache_path = qcache.cache_path(ckpt_dir, cache_dir)
        weights = qcache.read(cache_path, key, cfg, source=str(ckpt_dir), progress=progress)
        if weights is not None:
            log.info("loaded quantized weights from cache %s", cache_path)
            weights.extra["qcache"] = {"hit": True, "path": str(cache_path)}
            return weights
    weights = quantize_checkpoint(cfg, sources, str(ckpt_dir), progress)
    stored = cache and qcache.write(cache_path, key, weights)
    weights.extra["qcache"] = {"hit": False, "path": str(cache_path) if stored else None}
    return weights


def find_shards(ckpt_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or the single model.safetensors."""
    index_path = ckpt_dir / INDEX_NAME
    if not index_path.exists():
        single = ckpt_dir / "model.safetensors"
        if not single.exists():
            raise LoadError(f"{ckpt_dir}: neither model.safetensors nor {INDEX_NAME} found")
        return [single]
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise LoadError(f"{index_path}: not a valid safetensors index ({type(e).__name__}: {e})") from None
    shards: list[Path] = []
    for tensor_name, shard_name in weight_map.items():
        shard = ckpt_dir / str(shard_name)
        if not shard.is_file():
            raise LoadError(f"{index_path}: tensor {tensor_name!r} points at shard {shard}, which does not exist")
        if shard not in shards:
            shards.append(shard)
    return sorted(shards)


def read_header(file: Path) -> dict[str, TensorSource]:
    """Parse and validate one safetensors header; every tensor's bytes must lie inside the file."""
    file_bytes = file.stat().st_size
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise LoadError(f"{file}: truncated ({file_bytes} bytes, no safetensors header)")
        (header_bytes,) = struct.unpack("<Q", prefix)
        if 8 + header_bytes > file_bytes:
            raise LoadError(f"{file}: truncated (header of {header_bytes} bytes, file of {file_bytes})")
        raw = f.read(header_bytes)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise LoadError(f"{file}: bad safetensors header JSON ({e})") from None
    data_start = 8 + header_bytes
    sources = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            if not all(isinstance(v, int) and v >= 0 for v in (*shape, start, end)):
                raise ValueError("negative or non-integer shape or offsets")
        except (KeyError, TypeError, ValueError):
            raise LoadError(f"{file}: tensor {name!r} has a malformed header entry {entry!r}") from None
        if dtype not in SAFETENSORS_DTYPES:
            raise LoadError(f"{file}: tensor {name!r} has dtype {dtype}; supported: "
                            f"{', '.join(SAFETENSORS_DTYPES)}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(SAFETENSORS_DTYPES[dtype]).itemsize
        if end - start != nbytes:
            raise LoadError(f"{file}: tensor {name!r} spans {end - start} bytes but dtype {dtype} "
                            f"shape {list(shape)} needs {nbytes}")
        if data_start + end > file_bytes:
            raise LoadError(f"{file}: tensor {name!r} ends at byte {data_start + end} but the file has "
                            f"only {file_bytes} bytes (truncated)")
        sources[name] = TensorSource(name, file, dtype, shape, data_start + start, nbytes)
    return sources


def index_tensors(shard_files: list[Path], ckpt_dir: Path) -> dict[str, TensorSource]:
    """Every tensor of every shard by name; a tensor stored twice is an error."""
    sources: dict[str, TensorSource] = {}
    for file in shard_files:
        for name, src in read_header(file).items():
            if name in sources:
                raise LoadError(f"{ckpt_dir}: tensor {name!r} is stored in both {sources[name].file} and {file}")
            sources[name] = src
    index_path = ckpt_dir / INDEX_NAME
    if index_path.exists():
        for name, shard_name in json.loads(index_path.read_text())["weight_map"].items():
            if name not in sources or sources[name].file.name != shard_name:
                raise LoadError(f"{index_path}: tensor {name!r} is listed in {ckpt_dir / shard_name} "
                                "but that file does not hold it")
    return sources


def check_against_config(sources: dict[str, TensorSource], cfg: ModelConfig, ckpt_dir: Path) -> None:
    """Missing, unexpected and mis-shaped tensors, reported with their file before any work starts."""
    expected = hf_tensor_shapes(cfg)
    for name in list(sources):
        tied_copy = cfg.tie_word_embeddings and name == HF_GLOBAL_NAMES["lm_head"]
        if name not in expected and (tied_copy or name.endswith(IGNORED_SUFFIXES)):
            del sources[name]
    extra = [n for n in sources if n not in expected]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise LoadError(f"{sources[extra[0]].file}: unexpected tensor {extra[0]!r}{more}; not part of a "
                        f"{cfg.arch} model as described by {ckpt_dir / 'config.json'}")
    missing = [n for n in expected if n not in sources]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        files = sorted({str(s.file) for s in sources.values()})
        raise LoadError(f"{ckpt_dir}: missing tensor {missing[0]!r}{more} in {', '.join(files)}")
    for name, shape in expected.items():
        if sources[name].shape != shape:
            raise LoadError(f"{sources[name].file}: tensor {name!r} has shape {list(sources[name].shape)}, "
                            f"config.json implies {list(shape)}")


class Bf16Rows:
    """A [N, K] bf16 tensor seen as float32 row slices, converted only when sliced.

    ``quantize`` reads its input one row chunk at a time, so a bf16 weight is
    never widened whole: bf16 is the top half of a float32, hence bits << 16.
    """

    def __init__(self, bits: np.ndarray):
        self.bits = bits
        self.shape = bits.shape

    def __getitem__(self, rows: slice) -> np.ndarray:
        return (self.bits[rows].astype(np.uint32) << 16).view(np.float32)


def tensor_view(src: TensorSource):
    """The memory-mapped tensor: an ndarray for F32/F16, a ``Bf16Rows`` (or float32 copy if 1-D) for BF16."""
    raw = np.memmap(src.file, dtype=np.uint8, mode="r", offset=src.offset, shape=(src.nbytes,))
    data = raw.view(SAFETENSORS_DTYPES[src.dtype]).reshape(src.shape)
    if src.dtype != "BF16":
        return data
    if data.ndim == 1:
        return (data.astype(np.uint32) << 16).view(np.float32)
    return Bf16Rows(data)


def quantize_checkpoint(cfg: ModelConfig, sources: dict[str, TensorSource], source: str,
                        progress: Progress | None) -> ModelWeights:
    """Quantize a validated checkpoint tensor by tensor into ModelWeights."""
    total_bytes = sum(s.nbytes for s in sources.values())
    done_bytes = 0

    def advance(name: str, what: str):
        nonlocal done_bytes
        done_bytes += sources[name].nbytes
        if progress:
            progress(done_bytes, total_bytes, f"{what} {name}")

    def linear(name: str) -> QTensor:
        q = quantize(tensor_view(sources[name]))
        advance(name, "quantize")
        return q

    def norm(name: str) -> np.ndarray:     # a norm, a bias or a router: float32
        view = tensor_view(sources[name])
        w = np.array(view[:] if isinstance(view, Bf16Rows) else view, dtype=np.float32)
        advance(name, "read")
        return w

    return assemble_weights(cfg, linear, norm, source)
