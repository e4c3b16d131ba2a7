"""Where each of the model's tensors lies in a GGUF file: llama.cpp's tensor names for our HF-named
layout, the shapes a file of a config holds, which tensors are kept in blocks and which are read as
float32 vectors, and the llama q/k row permutation.

llama.cpp's converter reorders the rows of attn_q/attn_k for arch ``llama``
(and only llama) so that its rope rotates adjacent pairs instead of HF's
rotate_half halves; within each head, rows [0..hd/2) and [hd/2..hd) are
interleaved.  We use HF's rope, so the reader undoes that permutation and the
writer applies it.  A row permutation commutes with row-wise Q8_0, so it is
applied to qs and scales directly, still bit-exact.

A routed layer's experts are 3-D tensors, [E, rows, cols] (``blk.N.ffn_{gate,up,down}_exps``): expert e
of the HF layout is rows [e*rows, (e+1)*rows) of the tensor seen as [E*rows, cols], in the file's own
blocks (``expert_slices``); the router ``blk.N.ffn_gate_inp`` is read as float32.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from kestrel_stream.loading.gguf_file import GGUFFile
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.model.quant import QTensor
from kestrel_stream.model.quant4 import BlockTensor
from kestrel_stream.model.weights import DENSE_MLP_KEYS, HF_GLOBAL_NAMES, HF_LAYER_NAMES, hf_tensor_shapes
from scheduler.moe import expert_names, expert_shapes, router_name

ROUTER = "ffn_gate_inp.weight"
EXPERT_TENSORS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")   # gate, up, down
GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight", "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight",
    "o": "attn_output.weight", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "mlp_norm": "ffn_norm.weight", "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight",
    "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
}
PERMUTED_ARCHS = ("llama", "mistral", "mixtral")   # written as GGUF arch llama, q/k rows permuted
GGUF_GLOBAL_NAMES = {"embed": "token_embd", "final_norm": "output_norm", "lm_head": "output"}
ROPE_FREQS = "rope_freqs.weight"
VECTOR_TYPES = (T.F32, T.F16, T.BF16)           # the types a vector (norm, bias, rope_freqs) may have


def gguf_names(cfg: ModelConfig) -> dict[str, str]:
    """HF tensor name → llama.cpp tensor name, for every tensor of ``cfg``."""
    names = {HF_GLOBAL_NAMES[k]: f"{v}.weight" for k, v in GGUF_GLOBAL_NAMES.items()}
    for i in range(cfg.num_hidden_layers):
        routed = cfg.moe_layer(i)
        for key, gguf_key in GGUF_LAYER_NAMES.items():
            if not (routed and key in DENSE_MLP_KEYS):
                names[f"model.layers.{i}.{HF_LAYER_NAMES[key]}"] = f"blk.{i}.{gguf_key}"
        if routed:
            names[router_name(cfg, i)] = f"blk.{i}.{ROUTER}"
    return names


def expert_slices(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """HF name of every expert tensor → (the GGUF 3-D tensor holding it, first row, end row) of that tensor
    seen as [E * rows, cols]."""
    out = {}
    for i in range(cfg.num_hidden_layers):
        if cfg.moe_layer(i):
            for e in range(cfg.num_experts):
                for hf, tensor, (rows, _) in zip(expert_names(cfg, i, e), EXPERT_TENSORS, expert_shapes(cfg)):
                    out[hf] = (f"blk.{i}.{tensor}", e * rows, (e + 1) * rows)
    return out


def gguf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a GGUF file of ``cfg`` holds (rope_freqs aside), llama.cpp name → shape: experts 3-D."""
    to_gguf, experts, shapes = gguf_names(cfg), expert_slices(cfg), {}
    for hf, shape in hf_tensor_shapes(cfg).items():
        if hf in experts:
            shapes[experts[hf][0]] = (cfg.num_experts, *shape)
        else:
            shapes[to_gguf[hf]] = shape
    return shapes


def is_linear(name: str, shape: tuple[int, ...]) -> bool:
    """A weight kept in blocks (a matrix or a stack of experts); the router and vectors are read as float32."""
    return len(shape) >= 2 and not name.endswith(ROUTER)


def read_vector(f: GGUFFile, name: str) -> np.ndarray:
    """A tensor read as float32 (a vector, or the router), in its own shape."""
    info = f.tensors[name]
    return np.asarray(gguf_quants.dequantize(f.tensor_bytes(name), info.qtype), np.float32).reshape(info.shape)


def rope_row_order(rows: int, n_head: int, to_gguf: bool) -> np.ndarray:
    """Row index for llama.cpp's q/k permutation (to_gguf) or its inverse: out = w[order]."""
    half = rows // n_head // 2
    if to_gguf:
        return np.arange(rows).reshape(n_head, 2, half).swapaxes(1, 2).reshape(rows)
    return np.arange(rows).reshape(n_head, half, 2).swapaxes(1, 2).reshape(rows)


def permute_rows(q, order: np.ndarray):
    if isinstance(q, BlockTensor):
        return q.take(order)
    return QTensor(q.qs[order], q.scales[order])
