"""A GGUF file's header, read lazily: metadata scalars at once, arrays only when asked for.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata
array when the file opens; a tokenizer's vocabulary and merges are ~100k
strings, which makes opening a small model take seconds.  This reader walks
the same header (the GGUF v2/v3 layout: magic, version, tensor count, KV
count, KVs, tensor infos, aligned data) with ``struct`` over one mmap,
records where each array lies and skips it, and decodes an array the first
time its key is read.  The type codes, block sizes and the alignment key come
from the ``gguf`` package's public constants.

Other parts of kestrel-stream (the tokenizer's ``tokenizer.ggml.*`` fields)
read metadata through ``gguf_metadata(path, key)`` or ``GGUFFile.metadata``.
"""
from __future__ import annotations

import mmap
import struct
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
NUMPY_DTYPES = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}
_MISSING = object()
_U64 = struct.Struct("<Q")


def _walk_strings(buf, pos: int, count: int, decode: bool) -> tuple[list[str] | None, int]:
    """`count` length-prefixed strings from byte `pos`: (the strings, or None when only skipping; the
    end).  One tight loop, since a vocabulary's tokens and merges are 100k+ strings each."""
    unpack, end, out = _U64.unpack_from, len(buf), [] if decode else None
    for _ in range(count):
        (n,) = unpack(buf, pos)
        pos += 8
        if pos + n > end:
            raise struct.error(f"a string of {n} bytes at byte {pos} runs past the end")
        if decode:
            out.append(str(buf[pos:pos + n], "utf-8"))
        pos += n
    return out, pos


class GGUFFormatError(ValueError):
    """The file is not a GGUF file, or its header is truncated or corrupt; the message says where."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's descriptor: ``shape`` in PyTorch order (ggml's dims reversed), bytes in the file."""
    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int                # absolute byte offset of the data
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class _LazyArray:
    item_type: GGUFValueType
    count: int
    offset: int                # where the first element starts


class GGUFFile:
    """The header of one GGUF file; tensor data stays in the page cache until ``tensor_bytes`` is read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:                      # an empty file cannot be mapped
                raise GGUFFormatError(f"{self.path}: empty file, not GGUF") from None
        self.file_bytes = len(self._map)
        self._decode_lock = threading.Lock()      # one array decoded at a time (open_shared's readers)
        self._fields: dict[str, object] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, OverflowError) as e:
            raise GGUFFormatError(f"{self.path}: GGUF header truncated or corrupt ({e})") from None

    # -- header --------------------------------------------------------------------------------------------
    def _read(self, fmt: str):
        value = struct.unpack_from(fmt, self._map, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._read("<Q")
        if self._pos + n > self.file_bytes:
            raise struct.error(f"a string of {n} bytes at byte {self._pos} runs past the end")
        s = self._map[self._pos:self._pos + n].decode("utf-8")
        self._pos += n
        return s

    def _skip_array(self, item_type: GGUFValueType, count: int) -> None:
        if item_type in SCALAR_FORMATS:
            self._pos += count * struct.calcsize(SCALAR_FORMATS[item_type])
        elif item_type == GGUFValueType.STRING:
            self._pos = _walk_strings(self._map, self._pos, count, decode=False)[1]
        else:                                       # nested arrays: rare, walked element by element
            for _ in range(count):
                self._value(GGUFValueType(self._read("<I")), lazy=True)
        if self._pos > self.file_bytes:
            raise struct.error("a metadata array runs past the end of the file")

    def _value(self, vtype: GGUFValueType, lazy: bool):
        if vtype in SCALAR_FORMATS:
            return self._read(SCALAR_FORMATS[vtype])
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype == GGUFValueType.ARRAY:
            item_type, count = GGUFValueType(self._read("<I")), self._read("<Q")
            array = _LazyArray(item_type, count, self._pos)
            self._skip_array(item_type, count)
            return array if lazy else self._decode(array)
        raise GGUFFormatError(f"{self.path}: unknown metadata value type {vtype}")

    def _parse(self) -> None:
        self._pos = 0
        if self._map[:4] != GGUF_MAGIC:
            raise GGUFFormatError(f"{self.path}: not a GGUF file (magic {bytes(self._map[:4])!r})")
        self._pos = 4
        version, n_tensors, n_kv = self._read("<I"), self._read("<Q"), self._read("<Q")
        if version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        for _ in range(n_kv):
            key = self._string()
            try:
                vtype = GGUFValueType(self._read("<I"))
            except ValueError as e:
                raise GGUFFormatError(f"{self.path}: metadata key {key!r} has an unknown type ({e})") from None
            self._fields[key] = self._value(vtype, lazy=True)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._read("<I")
            dims = [self._read("<Q") for _ in range(n_dims)]
            raw_type, offset = self._read("<I"), self._read("<Q")
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise GGUFFormatError(f"{self.path}: tensor {name!r} has unknown ggml type {raw_type}") from None
            infos.append((name, dims, qtype, offset))
        alignment = self.metadata(ALIGNMENT_KEY, DEFAULT_ALIGNMENT)
        data_start = -(-self._pos // alignment) * alignment
        if not isinstance(alignment, int) or alignment <= 0:
            raise GGUFFormatError(f"{self.path}: {ALIGNMENT_KEY} is {alignment!r}, not a positive integer")
        for name, dims, qtype, offset in infos:
            if offset % alignment:      # llama.cpp refuses these too; the blocks would be read off their grid
                raise GGUFFormatError(f"{self.path}: tensor {name!r} starts at data offset {offset}, not a "
                                      f"multiple of the file's alignment {alignment}")
            block_size, type_bytes = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims, dtype=np.int64))
            if dims and dims[0] % block_size:
                raise GGUFFormatError(f"{self.path}: tensor {name!r} rows of {dims[0]} are not whole "
                                      f"{qtype.name} blocks of {block_size}")
            info = TensorInfo(name, tuple(int(d) for d in reversed(dims)), qtype, data_start + offset,
                              n // block_size * type_bytes)
            if info.offset + info.nbytes > self.file_bytes:
                raise GGUFFormatError(f"{self.path}: tensor {name!r} ends at byte {info.offset + info.nbytes} "
                                      f"but the file has only {self.file_bytes} bytes (truncated)")
            if name in self.tensors:
                raise GGUFFormatError(f"{self.path}: tensor {name!r} is listed twice")
            self.tensors[name] = info

    # -- access --------------------------------------------------------------------------------------------
    def _decode(self, array: _LazyArray):
        if array.item_type in NUMPY_DTYPES:
            return np.frombuffer(self._map, dtype=NUMPY_DTYPES[array.item_type], count=array.count,
                                 offset=array.offset).tolist()
        saved, self._pos = getattr(self, "_pos", 0), array.offset
        try:
            if array.item_type == GGUFValueType.STRING:
                return _walk_strings(self._map, array.offset, array.count, decode=True)[0]
            return [self._value(GGUFValueType(self._read("<I")), lazy=False) for _ in range(array.count)]
        finally:
            self._pos = saved

    def keys(self) -> list[str]:
        return list(self._fields)

    def metadata(self, key: str, default=_MISSING):
        """The value of ``key`` (an array as a list, decoded on first read); ``default`` or KeyError if absent."""
        value = self._fields.get(key, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise KeyError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        if isinstance(value, _LazyArray):
            with self._decode_lock:
                value = self._fields[key]
                if isinstance(value, _LazyArray):
                    try:
                        value = self._fields[key] = self._decode(value)
                    except (struct.error, UnicodeDecodeError) as e:
                        raise GGUFFormatError(f"{self.path}: GGUF metadata array {key!r} is corrupt ({e})") from None
        return value

    def tensor_bytes(self, name: str) -> np.ndarray:
        """uint8 view of one tensor's data (no copy)."""
        info = self.tensors[name]
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)


_shared_lock = threading.Lock()
_shared: "weakref.WeakValueDictionary[tuple, GGUFFile]" = weakref.WeakValueDictionary()


def open_shared(path: str | Path) -> GGUFFile:
    """The parsed header of `path`, shared by everyone holding it (ks.load's weights and its tokenizer,
    on two threads, parse a vocabulary's 300k strings once); a file changed since is parsed again."""
    path = Path(path)
    status = path.stat()
    key = (str(path.resolve()), status.st_size, status.st_mtime_ns)
    with _shared_lock:
        f = _shared.get(key)
        if f is None:
            f = GGUFFile(path)
            _shared[key] = f
    return f


def gguf_metadata(path: str | Path, key: str, default=_MISSING):
    """One metadata value of a GGUF file (e.g. ``tokenizer.ggml.tokens``), parsing nothing else's arrays."""
    return GGUFFile(path).metadata(key, default)
