"""The device backend: one op of the step program (scheduler/ops.py) as its prepared launches.

Every mode builds its launches here: gpu mode's whole step (launches.py)
and the GPU segments of gated and layers=N (run/mixed.py), over the buffers of
the one device backend (backend.py).  What differs between them is
handed in: where each op's weight lives, and the paged KV pool's layers and
dtype (gpu mode's f16 or float32, layers=N's float32 for its first N layers).

RMSNorm never costs a launch or a re-read: the kernel that writes the residual
stream x (embedding, o and down epilogues) also writes xn = x * the weight of
the norm the op `prepares` and, from its last block, 1/rms(x) per token; the
projection whose `prologue` is that norm multiplies its dot products by the
scale.  SiLU·mul is gate_up's epilogue (gate and up rows interleaved at load).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from kestrel_stream.cuda.block_kernels import embed_kernel, qweight_rows, weight_bytes
from kestrel_stream.cuda import driver, mma_variants
from kestrel_stream.cuda.kernels import (ATTENTION_MIN_KEYS, ATTENTION_WARPS, ROPE_PAGED_SIGNATURE, Launch,
                                         QWeight, gemv_launch, paged_attention_launch, rope_attention_launch)
from kestrel_stream.cuda.flash_attention import (StepChoice, attention_choice, partial_floats as attention_partials,
                                                 split_count)
from kestrel_stream.model import rope
from kestrel_stream.model.op_tensors import fused_tensor, norm_weight  # noqa: F401  (importable from here too)
from kestrel_stream.run.device.moe_ops import MoeBuffers, MoeOps
from kestrel_stream.run.device.step_io import TREE_BYTES_PER_TOKEN


def q8_bytes(w: QWeight, rows: int | None = None) -> int:
    """Weight bytes of `rows` rows (default all) of a device weight in its format: for Q8_0 int8 values and
    a half scale per 32; the block formats by their blocks (a table's rows are all of one format)."""
    if w.fmt != "Q8_0" or w.tail is not None:
        return weight_bytes(w) if rows is None else weight_bytes(w) * rows // w.rows
    return (w.rows if rows is None else rows) * (w.cols + w.cols // 16)


@dataclass
class DeviceState:
    """Device addresses of the step's state (rows = tokens of the step)."""
    x: int             # [T, H] the residual stream
    xn: int            # [T, H] x * the prepared norm's weight
    inv_rms: int       # [T] that norm's 1/rms per token
    qkv: int           # [T, q + 2 kv]
    q: int             # [T, q] after norm + rope
    attn: int          # [T, q]
    act: int           # [T, I] silu(gate) * up
    logits: int        # [rows, V]
    counter: int       # the GEMV epilogue's last-block ticket
    partials: int      # split attention's partial results
    attention_counters: int   # its last-split tickets
    split_scratch: mma_variants.SplitScratch   # split-K q8_mma launches' partial tiles and tickets
    dense: object = None      # cuda/dense_gemm.DenseScratch: steps of many tokens on cuBLAS (None: off)
    moe: object = None        # moe_ops.MoeBuffers: a mixture-of-experts model's routed layers (None: none)

    @classmethod
    def allocate(cls, arena, config, tokens: int, logits_rows: int, splits: int) -> tuple["DeviceState", dict]:
        """The buffers in `arena` for steps of up to `tokens` tokens (logits for `logits_rows` of them), the
        tickets zeroed: the state, and the arrays by name."""
        c, T = config, tokens
        shapes = {"x": (T, c.hidden_size), "xn": (T, c.hidden_size), "qkv": (T, c.q_size + 2 * c.kv_size),
                  "q": (T, c.q_size), "attn": (T, c.q_size), "act": (T, c.intermediate_size),
                  "logits": (logits_rows, c.vocab_size), "inv_rms": (T,),
                  "partials": (attention_partials(T, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                                  splits),)}
        arrays = {name: arena.array(shape, np.float32) for name, shape in shapes.items()}
        partial_floats, ticket_count = mma_variants.scratch_bound(T)
        arrays["split_partials"] = arena.array((max(partial_floats, 4),), np.float32)
        for name, count in (("counter", 64), ("attention_counters", T * c.num_key_value_heads),
                            ("split_tickets", max(ticket_count, 1))):
            arrays[name] = arena.array((count,), np.uint32)
            driver.h2d_sync(arrays[name].ptr, np.zeros(count, np.uint32))
        scratch = mma_variants.SplitScratch(arrays["split_partials"].ptr, partial_floats, arrays["split_tickets"].ptr,
                                            ticket_count)
        pointers = {name: array.ptr for name, array in arrays.items() if not name.startswith("split_")}
        moe = None
        if c.is_moe:              # route and moe_out move between the sides by name (mixed.py): in `arrays`
            moe, moe_arrays = MoeBuffers.allocate(arena, c, T)
            arrays.update(moe_arrays)
        return cls(**pointers, split_scratch=scratch, moe=moe), arrays


@dataclass
class KVCaches:
    """Where rope appends keys and values and attention reads them: the paged pool (kv_paged.py)."""
    base: int                  # the block tables (0: no pool, attention runs on the host)
    layers: int                # layers the caches hold
    block_shift: int           # log2 positions per block
    dtype: str = "f32"
    splits: int = 16           # split-key attention's most splits (a step's: flash_attention.split_count)
    min_keys: int = ATTENTION_MIN_KEYS   # its fewest keys per split block
    warps: int = ATTENTION_WARPS         # a block's warps in the kernel with the rope prologue


class DeviceOps:
    """weight(op) -> QWeight of a projection; vector(array or None) -> its device address (0 for None);
    experts: the expert store of a mixture-of-experts model whose router and experts run here (None: none)."""

    def __init__(self, kernels, weights, state: DeviceState, kv: KVCaches, params, inv_freq: int,
                 weight: Callable, vector: Callable, experts=None):
        self.kernels, self.weights, self.config = kernels, weights, weights.config
        self.state, self.kv, self.params, self.inv_freq = state, kv, params, inv_freq
        self.weight, self.vector = weight, vector
        self.moe = MoeOps(kernels, weights, experts, state.moe, state, vector) if experts is not None else None
        self._step_choices: dict[int, StepChoice] = {}

    def launches(self, op, tokens: int, lm_rows: tuple[int, int] | None = None,
                 weight: QWeight | None = None, expert_slot: int | None = None) -> list[Launch]:
        """The launches of `op` over `tokens` tokens, labelled with the role, layer and weight bytes they
        read.  lm_rows = (first, count): lm_head on token rows first..first+count-1 only, into logits rows
        0..count-1.  weight: where the op's weight is this step (mode offload's ring slot), if not where
        `self.weight` says; expert_slot: a routed layer's experts' ring slot (moe_ops.MoeOps.launches)."""
        role = op.group or op.kind
        if role in ("router", "experts"):
            assert self.moe is not None, f"{op.name}: no expert store on the device"
            return self.moe.launches(op, tokens, expert_slot)
        if role in ("rope", "attention"):
            if role == "attention" and op.prologue:      # the rope op as its prologue (ops.fuse_rope)
                launch = self._rope_attention(op.layer, tokens)
            else:
                launch = (self._rope if role == "rope" else self._attention)(op.layer, tokens)
            return [launch.label(op=role, layer=op.layer, bytes=0)]
        c, k, s, eps = self.config, self.kernels, self.state, self.config.rms_norm_eps
        H = c.hidden_size
        w = weight if weight is not None else self.weight(op)
        if role == "embed":
            _, ids, _ = self.params.pointers(tokens)
            launch = k.launch(embed_kernel(w), (tokens,), (256,), "pppppppfi",
                              [w.qs, w.scales, ids, s.x, s.xn, self.vector(norm_weight(self.weights, op.prepares)),
                               s.inv_rms, eps, H])
            return [launch.label(op=role, bytes=tokens * q8_bytes(w, 1))]
        if role in ("o", "down"):
            x_in, width = (s.attn, c.q_size) if role == "o" else (s.act, c.intermediate_size)
            out = [gemv_launch(k, w, x_in, width, s.x, H, tokens, res=s.x,
                               normw_out=self.vector(norm_weight(self.weights, op.prepares)), xn_out=s.xn,
                               inv_rms_out=s.inv_rms, counter=s.counter, eps=eps,
                               split_scratch=s.split_scratch, dense=s.dense).label(bytes=q8_bytes(w))]
        elif role == "gate_up":
            out = [gemv_launch(k, w, s.xn, H, s.act, c.intermediate_size, tokens, silu_pairs=True,
                               inv_rms_in=s.inv_rms, split_scratch=s.split_scratch,
                               dense=s.dense).label(bytes=q8_bytes(w))]
        else:                                   # qkv, lm_head: a split part runs its rows in place
            first, count = lm_rows if lm_rows is not None and role == "lm_head" else (0, tokens)
            y, ldy = (s.logits, c.vocab_size) if role == "lm_head" else (s.qkv, c.q_size + 2 * c.kv_size)
            out = []
            for lo, hi in op.row_ranges:
                part = qweight_rows(w, lo, hi)
                out.append(gemv_launch(k, part, s.xn + 4 * H * first, H, y + 4 * lo, ldy, count,
                                       inv_rms_in=s.inv_rms + 4 * first,
                                       split_scratch=s.split_scratch, dense=s.dense).label(bytes=q8_bytes(part)))
        for launch in out:       # weight: the residency window's item the launch reads
            launch.label(op=role, layer=op.layer, weight=op.name)
        return out

    def _layer_vectors(self, li: int) -> list[int]:
        layer = self.weights.layers[li]
        return [self.vector(layer.q_norm), self.vector(layer.k_norm), self.inv_freq, self.vector(layer.qkv_bias)]

    def _rope(self, li: int, tokens: int) -> Launch:
        """q/k norm + RoPE + KV append (+ Qwen2's qkv bias), one kernel."""
        c, kv, s = self.config, self.kv, self.state
        kvbase, _, pos = self.params.pointers(tokens)
        args = ([s.qkv, s.q, kv.base, kvbase, pos, *self._layer_vectors(li), c.rms_norm_eps, li, kv.layers,
                 c.num_attention_heads, c.num_key_value_heads, c.head_dim])
        grid = (c.num_attention_heads + 2 * c.num_key_value_heads, tokens)
        return self.kernels.launch(f"qkv_rope_append_paged_{kv.dtype}", grid, (32,), ROPE_PAGED_SIGNATURE,
                                   args + [kv.block_shift, self.params.tree.ptr])

    def _rope_attention(self, li: int, tokens: int) -> Launch:
        """Split-key attention with the rope op as its prologue, on the paged pool (one row per session)."""
        c, kv, s = self.config, self.kv, self.state
        kvbase, _, pos = self.params.pointers(tokens)
        return rope_attention_launch(self.kernels, s.qkv, self._layer_vectors(li), c.rms_norm_eps, kv.base, kvbase,
                                     pos, s.attn, s.partials, s.attention_counters, tokens, li, kv.layers,
                                     c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                     split_count(tokens, c.num_key_value_heads, kv.splits), kv.block_shift, kv.dtype,
                                     window=c.sliding_window or 0, scale=rope.softmax_scale(c), min_keys=kv.min_keys,
                                     warps=kv.warps)

    def _attention(self, li: int, tokens: int) -> Launch:
        """Split-key attention over each token's session cache, merged by its last split, or the flash
        kernel where it serves the step (cuda/flash_attention.py)."""
        c, kv, s = self.config, self.kv, self.state
        kvbase, _, pos = self.params.pointers(tokens)
        common = (s.q, kv.base, kvbase, pos, s.attn, s.partials, s.attention_counters, tokens, li, kv.layers,
                  c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                  split_count(tokens, c.num_key_value_heads, kv.splits))
        window, scale = c.sliding_window or 0, rope.softmax_scale(c)
        tree = self.params.tree.ptr         # token trees' masks (run/token_tree.py), staged per step
        split = paged_attention_launch(self.kernels, *common, kv.block_shift, kv.dtype, window=window, scale=scale,
                                       min_keys=kv.min_keys, tree=tree)

        def split_rows(d: int) -> Launch:        # the same launch over the step's first d rows (its decodes)
            return paged_attention_launch(self.kernels, s.q, kv.base, kvbase, pos, s.attn, s.partials,
                                          s.attention_counters, d, li, kv.layers, c.num_attention_heads,
                                          c.num_key_value_heads, c.head_dim,
                                          split_count(d, c.num_key_value_heads, kv.splits), kv.block_shift, kv.dtype,
                                          window=window, scale=scale, min_keys=kv.min_keys, tree=tree)
        if tokens not in self._step_choices:     # flash or split: decided once per step, by its first layer
            self._step_choices[tokens] = StepChoice(lambda: self.params.views(tokens)[0], c.head_dim)
        # prefill chunks: the tensor-core flash kernel, picked per step from the staged rows (beside decodes:
        # the decodes' rows on the split kernel, the chunks' on the flash kernel)
        return attention_choice(self.kernels, split, self._step_choices[tokens], q=s.q, tables=kv.base,
                                table_row=kvbase, pos=pos, out=s.attn, tokens=tokens, layer=li, n_layers=kv.layers,
                                n_heads=c.num_attention_heads, n_kv=c.num_key_value_heads, head_dim=c.head_dim,
                                block_shift=kv.block_shift, kv_dtype=kv.dtype, window=window, scale=scale, tree=tree,
                                split_rows=split_rows, tree_row_bytes=TREE_BYTES_PER_TOKEN)
