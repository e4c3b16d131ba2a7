"""GGUF files (llama.cpp's format) for the ``llama``, ``qwen2``, ``qwen3`` and ``qwen3moe`` architectures
(and Mixtral: arch ``llama`` with ``ffn_*_exps`` tensors).

Reading maps llama.cpp metadata keys onto a config (gguf_config.py) and its
tensor names onto our HF-named layout (gguf_layout.py: the names, the experts'
3-D tensors and the llama q/k row permutation), and reuses the loader's assembly.  Q8_0 tensors stay in the file's
blocks, views of its mmap (model/q8_blocks.py: split into qs/scales by the
one copy each consumer makes); Q4_0, Q4_K and Q6_K tensors stay in their
blocks (model/quant4.py: the kernels run them natively) unless the load asks
for ``blocks="q8_0"``; Q5_0 and IQ4_NL (and Q4_0 converted) become the Q8_0
of the same values, a byte shuffle (model/exact_q8.py); every other type
``gguf.quants`` dequantizes (F32, F16, BF16, Q4_1, Q5_1, Q2_K, Q3_K, Q5_K,
IQ4_XS) is converted to Q8_0, row chunk by row chunk.
A file that needed conversion is cached like a Hugging Face checkpoint
(qcache), so the conversion runs once; the load prints one line saying what
was converted.  Norms, biases and rope_freqs become float32.

The pages of the file the load read stay mapped (RssFile) though most of them were only copied (the parts
of a fused QKV or gate+up, the norms): the load hands every tensor's pages back at its end (MADV_DONTNEED,
model/mapped.py); a weight that is a view of the file maps its pages again when it is read.

One concern, reading a GGUF into the model's weights: its config (gguf_config.py) and tensor types
checked, each tensor kept in its blocks or converted, and the whole assembled.
"""
from __future__ import annotations

import dataclasses
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from kestrel_stream.errors import LoadError
from kestrel_stream.loading import Progress, qcache
from kestrel_stream.loading.gguf_file import GGUFFile, GGUFFormatError, open_shared
from kestrel_stream.loading.gguf_config import config_from_metadata
from kestrel_stream.loading.gguf_layout import (PERMUTED_ARCHS, ROPE_FREQS, VECTOR_TYPES, expert_slices, gguf_names,
                                                gguf_shapes, is_linear, permute_rows, read_vector, rope_row_order)
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.model.exact_q8 import EXACT_TYPES, exact_q8_0
from kestrel_stream.model.mapped import release_file_pages
from kestrel_stream.model.q8_blocks import Q8Blocks
from kestrel_stream.model.quant import QTensor, quantize
from kestrel_stream.model.quant4 import BLOCK_TYPES, BlockTensor, RowStack
from kestrel_stream.model.weights import HF_GLOBAL_NAMES, HF_LAYER_NAMES, ModelWeights, assemble_weights
from kestrel_stream.obs.load_stages import stage
from scheduler.moe import expert_names

T = GGMLQuantizationType
NATIVE_TYPES = (T.Q8_0,)
BLOCK_NATIVE_TYPES = tuple(T[name] for name in BLOCK_TYPES)   # kept as blocks unless blocks="q8_0"
GGUF_BLOCKS = ("native", "q8_0")
# Types converted to Q8_0 at load (gguf.quants dequantizes each of them).
CONVERTED_TYPES = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
                   T.IQ4_NL, T.IQ4_XS)
LINEAR_TYPES = NATIVE_TYPES + CONVERTED_TYPES
CONVERT_ROWS = 1024          # rows dequantized at once: bounds the float32 temporary


def planned_weight_formats(f: GGUFFile, cfg: ModelConfig) -> tuple[tuple[str, str], ...]:
    """weight_formats_of the weights this file loads to (blocks="native"), from its tensor types alone:
    the fusion rules of quant4.fuse_rows applied to the types instead of the tensors."""
    to_gguf, experts, out = gguf_names(cfg), expert_slices(cfg), []

    def kind(hf_name: str) -> str:
        qtype = f.tensors[experts[hf_name][0] if hf_name in experts else to_gguf[hf_name]].qtype
        return qtype.name if qtype in BLOCK_NATIVE_TYPES else "Q8_0"

    def group(names: list[str], allow_stack: bool) -> None:
        kinds = [kind(n) for n in names]
        runs = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
        exact = "Q8_0" not in kinds and (len(runs) == 1 or (allow_stack and len(runs) == 2))
        if exact:
            out.extend(zip(names, kinds))

    group([HF_GLOBAL_NAMES["embed"]], True)
    if not cfg.tie_word_embeddings:
        group([HF_GLOBAL_NAMES["lm_head"]], True)
    for i in range(cfg.num_hidden_layers):
        def hf(key: str) -> str:
            return f"model.layers.{i}.{HF_LAYER_NAMES[key]}"
        group([hf("q"), hf("k"), hf("v")], True)
        group([hf("o")], True)
        if cfg.moe_layer(i):             # assemble_experts' stacks: every expert's gate+up, every down
            names = [expert_names(cfg, i, e) for e in range(cfg.num_experts)]
            group([n for gate, up, _ in names for n in (gate, up)], False)
            group([down for _, _, down in names], False)
            continue
        group([hf("gate"), hf("up")], False)
        group([hf("down")], True)
    return tuple((n, k) for n, k in out if k != "Q8_0")


def weight_formats_of(weights: ModelWeights) -> tuple[tuple[str, str], ...]:
    """(HF name, block format) of every linear weight the assembled weights keep in a block format
    (a fused part that fell back to Q8_0 is Q8_0 whatever its file type)."""
    cfg, out = weights.config, []

    def add(names_rows: list[tuple[str, int]], w) -> None:
        parts = [(w.fmt, w.shape[0])] if isinstance(w, BlockTensor) else \
            [(p.fmt, p.shape[0]) for p in w.parts] if isinstance(w, RowStack) else []
        at, bounds = 0, []
        for fmt, rows in parts:
            bounds.append((at, at + rows, fmt))
            at += rows
        at = 0
        for name, rows in names_rows:
            fmt = next((f for lo, hi, f in bounds if lo <= at < hi), None)
            if fmt is not None:
                out.append((name, fmt))
            at += rows

    add([(HF_GLOBAL_NAMES["embed"], cfg.vocab_size)], weights.embed)
    if not weights.tied:
        add([(HF_GLOBAL_NAMES["lm_head"], cfg.vocab_size)], weights.lm_head)
    for i, lw in enumerate(weights.layers):
        def hf(key: str) -> str:
            return f"model.layers.{i}.{HF_LAYER_NAMES[key]}"
        add([(hf("q"), cfg.q_size), (hf("k"), cfg.kv_size), (hf("v"), cfg.kv_size)], lw.wqkv)
        add([(hf("o"), cfg.hidden_size)], lw.wo)
        if lw.moe is not None:
            names = [expert_names(cfg, i, e) for e in range(cfg.num_experts)]
            inter = cfg.moe_intermediate_size
            add([(n, inter) for gate, up, _ in names for n in (gate, up)], lw.moe.gate_up)
            add([(down, cfg.hidden_size) for _, _, down in names], lw.moe.down)
            continue
        add([(hf("gate"), cfg.intermediate_size), (hf("up"), cfg.intermediate_size)], lw.w_gate_up)
        add([(hf("down"), cfg.hidden_size)], lw.w_down)
    return tuple(out)


def open_gguf(path: str | Path) -> GGUFFile:
    """The file's header (tensor descriptors, lazily decoded metadata), or a LoadError naming the file."""
    try:
        return open_shared(path)
    except GGUFFormatError as e:
        raise LoadError(str(e)) from None
    except OSError as e:
        raise LoadError(f"{path}: cannot read ({e})") from None


class DequantRows:
    """A [N, K] GGUF tensor of any converted type seen as float32 row chunks, for ``quantize``."""

    def __init__(self, raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]):
        self.rows = raw.reshape(shape[0], -1)
        self.qtype, self.shape = qtype, shape

    def __getitem__(self, rows: slice) -> np.ndarray:
        return np.asarray(gguf_quants.dequantize(self.rows[rows], self.qtype), np.float32)


def check_tensors(f: GGUFFile, cfg: ModelConfig, expected: dict[str, tuple[int, ...]]) -> None:
    """Missing, unexpected, mis-shaped and unloadable tensors, reported before any conversion starts."""
    path, tensors = f.path, f.tensors
    for name in tensors:
        if name not in expected and name != ROPE_FREQS:
            raise LoadError(f"{path}: unexpected tensor {name!r} for a {cfg.arch} model of "
                            f"{cfg.num_hidden_layers} layers")
    unloadable = defaultdict(list)
    for name, shape in expected.items():
        if name not in tensors:
            raise LoadError(f"{path}: missing tensor {name!r}")
        t = tensors[name]
        if t.shape != shape:
            raise LoadError(f"{path}: tensor {name!r} has shape {list(t.shape)}, the metadata implies {list(shape)}")
        if t.qtype not in (LINEAR_TYPES if is_linear(name, shape) else VECTOR_TYPES):
            unloadable[t.qtype.name].append(name)
    if unloadable:
        kinds = "; ".join(f"{kind}: {', '.join(names[:3])}{f' (and {len(names) - 3} more)' if len(names) > 3 else ''}"
                          for kind, names in unloadable.items())
        raise LoadError(f"{path}: tensors of types kestrel-stream cannot load ({kinds}). Loadable: "
                        f"{', '.join(t.name for t in LINEAR_TYPES)} (vectors: F32, F16, BF16). Re-quantize the "
                        f"original model with llama.cpp's llama-quantize to Q8_0 or Q4_K_M, or load the Hugging "
                        f"Face checkpoint directory instead")


def conversion_line(counts: dict[str, list[int]]) -> str:
    """counts: type name → [tensors, bytes in the file, Q8_0 bytes] for every converted linear tensor."""
    parts = ", ".join(f"{kind} x{n} ({before / 1e6:.1f} MB -> {after / 1e6:.1f} MB{', exact' if kind in EXACT_TYPES else ''})"
                      for kind, (n, before, after) in sorted(counts.items()))
    if len(counts) == 1:            # the one type's part is already the total
        return f"gguf: converted to Q8_0: {parts}"
    before = sum(v[1] for v in counts.values())
    after = sum(v[2] for v in counts.values())
    return (f"gguf: converted to Q8_0: {parts}; {sum(v[0] for v in counts.values())} tensors, "
            f"{before / 1e6:.1f} MB -> {after / 1e6:.1f} MB")


def read_gguf(path: str | Path, progress: Progress | None = None, cache: bool = True,
              cache_dir: str | Path | None = None, blocks: str = "native") -> ModelWeights:
    """Load a llama/qwen2/qwen3 .gguf file of any type ``gguf.quants`` reads (cached once converted).

    blocks: "native" keeps Q4_0 / Q4_K / Q6_K tensors as blocks; "q8_0" converts them to Q8_0 too."""
    if blocks not in GGUF_BLOCKS:
        raise LoadError(f"{path}: blocks={blocks!r}; expected one of {', '.join(GGUF_BLOCKS)}")
    kept = NATIVE_TYPES + (BLOCK_NATIVE_TYPES if blocks == "native" else ())
    path = Path(path)
    with stage("  GGUF metadata and mmap"):
        f = open_gguf(path)
    cfg = config_from_metadata(f)
    to_gguf, experts = gguf_names(cfg), expert_slices(cfg)
    expected = gguf_shapes(cfg)
    check_tensors(f, cfg, expected)
    linear_types = {f.tensors[n].qtype for n, s in expected.items() if is_linear(n, s)}
    # exact conversions are a byte shuffle: only rounding conversions are worth a cached copy of the model
    needs_conversion = any(t not in kept and t.name not in EXACT_TYPES for t in linear_types)
    cache_path = key = None
    # the quantized cache holds Q8_0 weights only: a file that keeps blocks converts its other tensors each load
    if cache and needs_conversion and not linear_types & set(kept) - set(NATIVE_TYPES):
        key = qcache.cache_key(cfg, [path])
        cache_path = qcache.cache_path(path.parent, cache_dir, stem=path.name)
        weights = qcache.read(cache_path, key, cfg, source=str(path), progress=progress)
        if weights is not None:
            weights.extra.update(format="gguf", qcache={"hit": True, "path": str(cache_path)})
            return weights

    total_bytes = sum(f.tensors[n].nbytes for n in expected)
    done_bytes = 0
    converted: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])

    def advance(name: str, what: str, share: int = 1):
        nonlocal done_bytes
        done_bytes += f.tensors[name].nbytes // share
        if progress:
            progress(done_bytes, total_bytes, f"{what} {name}")

    def linear(hf_name: str) -> QTensor:
        if hf_name in experts:              # rows of a 3-D tensor of experts: a view of the file's blocks
            name, lo, hi = experts[hf_name]
            t = f.tensors[name]
            raw = f.tensor_bytes(name).reshape(t.shape[0] * t.shape[1], -1)[lo:hi]
            t = dataclasses.replace(t, shape=(hi - lo, t.shape[2]), nbytes=raw.nbytes)
        else:
            name = to_gguf[hf_name]
            t = f.tensors[name]
            raw = f.tensor_bytes(name)
        order = None
        if cfg.arch in PERMUTED_ARCHS and name.endswith(("attn_q.weight", "attn_k.weight")):
            n_head = cfg.num_attention_heads if name.endswith("attn_q.weight") else cfg.num_key_value_heads
            order = rope_row_order(t.shape[0], n_head, to_gguf=False)
        if t.qtype == T.Q8_0:
            with stage("  Q8_0 blocks: views of the mmap"):
                if order is not None:       # the one Q8_0 copy at load: whole rows of blocks, reordered
                    raw = raw.reshape(t.shape[0], -1)[order]
                q = Q8Blocks.from_bytes(raw, t.shape)
        elif t.qtype in kept:
            q = BlockTensor(t.qtype.name, np.asarray(raw, np.uint8).reshape(t.shape[0], -1), t.shape[1])
            if order is not None:
                q = permute_rows(q, order)
        else:
            q = exact_q8_0(raw, t.qtype.name, t.shape) if t.qtype.name in EXACT_TYPES else \
                quantize(DequantRows(raw, t.qtype, t.shape), rows_per_chunk=CONVERT_ROWS)
            counts = converted[t.qtype.name]
            counts[0] += 1
            counts[1] += t.nbytes
            counts[2] += q.nbytes
            if order is not None:
                q = permute_rows(q, order)
        advance(name, "read" if t.qtype in kept else f"convert {t.qtype.name}",
                cfg.num_experts if hf_name in experts else 1)
        return q

    def norm(hf_name: str) -> np.ndarray:
        name = to_gguf[hf_name]
        w = read_vector(f, name)
        advance(name, "read")
        return w

    weights = assemble_weights(cfg, linear, norm, str(path))
    for name in expected:       # the pages the load read (parts now copied into fused weights) leave the RSS
        release_file_pages(f.tensor_bytes(name))
    formats = weight_formats_of(weights)
    if formats:
        weights.config = dataclasses.replace(cfg, weight_formats=formats)
    weights.extra["format"] = "gguf"
    if converted:
        line = conversion_line(converted)
        weights.extra["conversion_line"] = line
        print(f"kestrel-stream: {line}", file=sys.stderr)
    stored = cache_path is not None and qcache.write(cache_path, key, weights)
    weights.extra["qcache"] = {"hit": False, "path": str(cache_path) if stored else None}
    return weights
