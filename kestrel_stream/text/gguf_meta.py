"""A GGUF file's metadata key/values, read straight from the header.

gguf.GGUFReader builds numpy views of every array element, which takes
seconds to tens of seconds for a vocabulary of 100k+ tokens and merges; the
tokenizer needs only the values, so this reads the key/value section with
plain struct unpacking (GGUF v2/v3: little-endian, u64 lengths and counts).
"""
from __future__ import annotations

import struct
from pathlib import Path

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
ARRAY_DTYPES = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
                12: "<f8"}


class GGUFMetadataError(ValueError):
    pass


def read_metadata(path: str | Path, prefix: str = "") -> dict:
    """Every metadata key (starting with `prefix`) -> its value: int/float/bool/str, or a list."""
    import numpy as np
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise GGUFMetadataError(f"{path}: not a GGUF file (bad magic)")
        version, _tensors, count = struct.unpack_from("<IQQ", head, 4)
        if version < 2:
            raise GGUFMetadataError(f"{path}: GGUF version {version} is not supported (2 or 3 are)")
        data = f.read()      # the metadata precedes the tensor data; mmap would not be cheaper for a scan
    pos = 0

    def take(fmt: str):
        nonlocal pos
        value = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return value[0]

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        s = data[pos:pos + n].decode("utf-8", errors="replace")
        pos += n
        return s

    def value(kind: int, keep: bool):
        nonlocal pos
        if kind in SCALARS:
            return take(SCALARS[kind])
        if kind == STRING:
            return string()
        if kind != ARRAY:
            raise GGUFMetadataError(f"{path}: unknown metadata type {kind} at byte {pos + 24}")
        item, n = take("<I"), take("<Q")
        if item in ARRAY_DTYPES:
            width = np.dtype(ARRAY_DTYPES[item]).itemsize
            arr = np.frombuffer(data, ARRAY_DTYPES[item], n, pos) if keep else None
            pos += n * width
            return arr.tolist() if keep else None
        return [value(item, keep) for _ in range(n)]

    out = {}
    try:
        for _ in range(count):
            key = string()
            out_value = value(take("<I"), key.startswith(prefix))
            if key.startswith(prefix):
                out[key] = out_value
    except struct.error:
        raise GGUFMetadataError(f"{path}: metadata is truncated") from None
    return out
