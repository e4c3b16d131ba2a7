"""The step program: the ops of one Llama/Qwen3 step, in execution order, with their costs.

Nothing else knows this order: the plan places these ops (plan.py), the host
backend runs each with numpy and the device backend turns each into a launch
(kestrel_stream/run/).  Every op declares the state it reads and writes (the
buffers below, per token), the norm its projection folds in as a prologue and
the norm its epilogue prepares for the next projection on the device.  Every op
names the Hugging Face tensors it owns, so a plan built from these
ops can be audited to place every weight of the model exactly once (the
seed's lm_head lesson: a projection that silently never reached the offload
path). Costs are for M tokens in the step:

- projection FLOPs: 2·M·N·K for a weight of shape [N, K];
- weight bytes: the storage of the weight's block format (config.weight_formats,
  Q8_0 unless it names another): Q8_0 N·K·34/32, Q4_0 N·K·18/32, Q4_K N·K·144/256,
  Q6_K N·K·210/256; norm vectors are kept in float32 (4 bytes per element);
- activation bytes: float32, everything the op reads / writes besides weights.

In a mixture-of-experts layer (moe.py) gate_up, silu_mul and down become `router` (a float32 projection onto
the experts, softmax and top-k) and `experts` (the chosen experts' gate_up, SiLU·mul and down for each
token, weighted and added into the residual); the experts op owns every expert's weights, and its FLOPs
and read bytes are those of the experts a step of M tokens is expected to use (`read_fraction`).

The config is duck-typed: any object with the ModelConfig fields works
(hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
num_key_value_heads, head_dim, vocab_size, tie_word_embeddings, qk_norm,
qkv_bias, q_size, kv_size, weight_formats, num_experts, num_experts_per_tok,
moe_intermediate_size, moe_layer).

One concern, the step program: the ops, their order and their costs are read together.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .moe import ROUTE_FLOATS_PER_CHOICE, expected_experts, expert_names, expert_shapes, moe_weight_names, router_name

Q8_GROUP = 32
FLOAT32_BYTES = 4
TOKEN_ID_BYTES = 4  # int32 ids enter the step

# Fused groups: the projections of one layer that share an input run as one
# launch. These five names are also the on/off switches a bench searches.
PROJECTION_GROUPS = ("qkv", "o", "gate_up", "down", "lm_head")
# op kinds fused into a neighbouring projection's prologue / epilogue on either side: no launch of their own
FUSED_KINDS = ("norm", "elementwise")
# the step's state, float32 per token ("xn": x * the next norm's weight, then 1/rms: a device-side form of x;
# "params": token id, position and KV table row, 16 bytes, read by device ops of the KV cache and embed;
# "route": a routed layer's choices per token; "moe_out": the sum of the experts a device part computed)
STATE_FLOATS = {"x": lambda c: c.hidden_size, "xn": lambda c: c.hidden_size + 1,
                "qkv": lambda c: c.q_size + 2 * c.kv_size, "q": lambda c: c.q_size, "attn": lambda c: c.q_size,
                "act": lambda c: c.intermediate_size, "logits": lambda c: c.vocab_size,
                "route": lambda c: ROUTE_FLOATS_PER_CHOICE * c.num_experts_per_tok,
                "moe_out": lambda c: c.hidden_size}
PARAMS_BYTES_PER_TOKEN = 16
EXPERTS_LAUNCHES = 3          # an experts op on the device: gate_up, down, combine (kernels_ptx/moe.cu) ...
TOKEN_EXPERTS_LAUNCHES = 2    # ... and at one token: gate_up, down with the combine in its epilogue (moe_token_*)
DEVICE_IMAGE_ALIGN = 256      # a Q8 weight's device image: qs, then scales at the next such boundary


# block format → (elements per block, bytes per block); every block lies inside one row
BLOCK_FORMATS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (256, 144), "Q6_K": (256, 210)}


def q8_bytes(rows: int, cols: int) -> int:
    elements = rows * cols
    return elements + 2 * elements // Q8_GROUP


def image_bytes(rows: int, cols: int) -> int:
    """Device bytes of one Q8 weight laid out as qs [rows, cols] int8, then scales at the next aligned boundary."""
    qs = rows * cols
    return -(-qs // DEVICE_IMAGE_ALIGN) * DEVICE_IMAGE_ALIGN + qs // 16


def format_bytes(rows: int, cols: int, fmt: str = "Q8_0") -> int:
    """Storage bytes of a [rows, cols] weight in block format `fmt`."""
    elements, nbytes = BLOCK_FORMATS[fmt]
    return rows * (cols // elements) * nbytes


def weight_formats(config) -> dict:
    """HF weight name → block format, for the weights config.weight_formats names (the rest are Q8_0)."""
    return dict(config.weight_formats)


@dataclass(frozen=True)
class WeightRef:
    name: str            # Hugging Face tensor name
    shape: tuple         # [N, K] for projections, [N] for norms
    nbytes: int          # storage bytes (Q8_0 for matrices, float32 for vectors)
    flops: float         # FLOPs this weight costs in the step (2·M·N·K for projections)
    fmt: str = "Q8_0"    # block format of a matrix (config.weight_formats); vectors: float32


@dataclass(frozen=True)
class Op:
    name: str                 # "L3.qkv", "embed", "lm_head"
    kind: str                 # embed | norm | projection | rope | attention | elementwise | router | experts
    layer: int | None         # None for embed, final_norm, lm_head
    weights: tuple            # WeightRef owned by this op (each weight owned by exactly one op)
    input_bytes: int          # activations read (incl. the residual where the op adds it)
    output_bytes: int         # activations written
    group: str | None = None  # fused projection group, one of PROJECTION_GROUPS
    extra_flops: float = 0.0  # FLOPs not tied to a weight (attention, elementwise)
    gathers_from: str | None = None  # embed reads rows of this tensor (tied or not)
    reads: tuple = ()         # state read (STATE_FLOATS names), as the host reads it
    writes: tuple = ()        # state written
    prologue: str | None = None   # the op folded into this one's kernel: a projection's norm (on the device it
                                  # reads "xn" for "x"), or a one-token step's rope into attention (fuse_rope)
    prepares: str | None = None   # the norm op whose "xn" this op's epilogue writes when it runs on the device
    row_ranges: tuple = ()    # (first, end) rows of the fused weight this op computes: all, or a split part's
    full_rows: int = 0        # rows of the whole fused weight (a split part covers some of them)
    launches_per_range: int = 1   # kernels per row range: 1, or the library GEMM path's (scheduler/dense.py)
    fused_into: str | None = None  # the op whose kernel runs this one as its prologue (fuse_rope): no launch
    read_fraction: float = 1.0     # the share of its weights' bytes a step reads (experts: the expected
                                   # distinct experts of the step over all of them)
    gather_row_bytes: int = 0      # embed: bytes of one row of its table in the table's format (0: Q8_0's)

    def device_reads(self) -> tuple:
        """The state this op reads on the device."""
        reads = tuple("xn" if (name == "x" and self.prologue) else name for name in self.reads)
        return reads + (("params",) if self.kind in ("embed", "rope", "attention") else ())

    def read_weight_bytes(self, tokens: int) -> int:
        """Q8 matrix bytes the op reads in a step of `tokens` tokens: a projection all of its weights, embed
        the rows it gathers (norm vectors and biases are left out)."""
        if self.kind == "embed":
            return tokens * (self.gather_row_bytes or q8_bytes(1, self.output_bytes // (FLOAT32_BYTES * tokens)))
        return int(sum(w.nbytes for w in self.weights if len(w.shape) == 2) * self.read_fraction)

    def image_bytes(self) -> int:
        """The device image bytes of this op's fused Q8 weight (what the residency window streams)."""
        return image_bytes(sum(w.shape[0] for w in self.weights), self.weights[0].shape[1])

    @property
    def is_projection(self) -> bool:
        return self.group is not None

    @property
    def launches(self) -> int:
        """Kernel launches of this op on the GPU: a norm is the consuming projection's prologue (and the
        epilogue of the one that wrote x), SiLU·mul gate_up's epilogue, a fused rope attention's prologue,
        so none of them launches anything."""
        if self.kind in FUSED_KINDS or self.fused_into:
            return 0
        return max(len(self.row_ranges), 1) * self.launches_per_range

    @property
    def flops(self) -> float:
        return self.extra_flops + sum(w.flops for w in self.weights)

    @property
    def weight_bytes(self) -> int:
        """Storage bytes of the op's weights (what placement holds)."""
        return sum(w.nbytes for w in self.weights)

    @property
    def active_weight_bytes(self) -> int:
        """Weight bytes a step reads (what the op's time is made of)."""
        return int(self.weight_bytes * self.read_fraction)

    def subset(self, weight_names, suffix: str) -> "Op":
        """The same op restricted to some of its weights (a group split by a per-projection gate).

        The output shrinks in proportion to the output rows kept; the input is
        shared, so every part reads all of it.
        """
        kept = tuple(w for w in self.weights if w.name in weight_names)
        assert kept, f"{self.name}: empty subset"
        rows_all = sum(w.shape[0] for w in self.weights)
        rows_kept = sum(w.shape[0] for w in kept)
        ranges, first = [], 0
        for w in self.weights:
            end = first + w.shape[0]
            if w.name in weight_names and ranges and ranges[-1][1] == first:   # consecutive kept weights: one range
                ranges[-1] = (ranges[-1][0], end)
            elif w.name in weight_names:
                ranges.append((first, end))
            first = end
        return replace(self, name=f"{self.name}[{suffix}]", weights=kept,
                       output_bytes=self.output_bytes * rows_kept // rows_all, row_ranges=tuple(ranges))


def _weight(name, shape, tokens, fmt: str = "Q8_0") -> WeightRef:
    rows, cols = shape
    return WeightRef(name, (rows, cols), format_bytes(rows, cols, fmt), 2.0 * tokens * rows * cols, fmt)


def _norm(name, size, tokens) -> WeightRef:
    # ~4 FLOPs per element (square, sum, scale, multiply by the weight)
    return WeightRef(name, (size,), size * FLOAT32_BYTES, 4.0 * tokens * size)


def _bias(name, size, tokens) -> WeightRef:
    return WeightRef(name, (size,), size * FLOAT32_BYTES, 1.0 * tokens * size)


def layer_ops(config, layer: int, tokens: int, context_len: int, formats: dict | None = None) -> list:
    """The nine ops of one decoder layer, in order (eight in a routed layer: router and experts for gate_up,
    silu_mul and down). context_len: KV entries attention reads."""
    formats = weight_formats(config) if formats is None else formats

    def _projection(name, shape, tokens):
        return _weight(name, shape, tokens, formats.get(name, "Q8_0"))
    H, I = config.hidden_size, config.intermediate_size
    Q, KV, D = config.q_size, config.kv_size, config.head_dim
    p = f"model.layers.{layer}."
    act = FLOAT32_BYTES * tokens
    name = f"L{layer}."
    rope_weights = ()
    if config.qk_norm:
        rope_weights = (_norm(p + "self_attn.q_norm.weight", D, tokens * config.num_attention_heads),
                        _norm(p + "self_attn.k_norm.weight", D, tokens * config.num_key_value_heads))
    if config.qkv_bias:          # added by the rope op (one add per element, like a norm's multiply)
        rope_weights += (_bias(p + "self_attn.q_proj.bias", Q, tokens), _bias(p + "self_attn.k_proj.bias", KV, tokens),
                         _bias(p + "self_attn.v_proj.bias", KV, tokens))
    keys = context_len + tokens
    next_norm = f"L{layer + 1}.attn_norm" if layer + 1 < config.num_hidden_layers else "final_norm"
    attention = [
        Op(name + "attn_norm", "norm", layer, (_norm(p + "input_layernorm.weight", H, tokens),),
           act * H, act * H),
        Op(name + "qkv", "projection", layer,
           (_projection(p + "self_attn.q_proj.weight", (Q, H), tokens),
            _projection(p + "self_attn.k_proj.weight", (KV, H), tokens),
            _projection(p + "self_attn.v_proj.weight", (KV, H), tokens)),
           act * H, act * (Q + 2 * KV), group="qkv", reads=("x",), writes=("qkv",), prologue=name + "attn_norm",
           full_rows=Q + 2 * KV, row_ranges=((0, Q + 2 * KV),)),
        # q/k norm + RoPE + KV append: one op, because one kernel does all three
        Op(name + "rope", "rope", layer, rope_weights, act * (Q + 2 * KV), act * Q,
           extra_flops=6.0 * tokens * (Q + KV), reads=("qkv",), writes=("q",)),
        # reads the whole KV cache of this layer: QK^T and P·V are 2·2·M·keys·Q FLOPs
        Op(name + "attention", "attention", layer, (), act * Q + FLOAT32_BYTES * 2 * keys * KV,
           act * Q, extra_flops=4.0 * tokens * keys * Q, reads=("q",), writes=("attn",)),
        Op(name + "o", "projection", layer,
           (_projection(p + "self_attn.o_proj.weight", (H, Q), tokens),),
           act * (Q + H), act * H, group="o", reads=("attn", "x"), writes=("x",), prepares=name + "mlp_norm",
           full_rows=H, row_ranges=((0, H),)),
        Op(name + "mlp_norm", "norm", layer,
           (_norm(p + "post_attention_layernorm.weight", H, tokens),), act * H, act * H),
    ]
    if config.moe_layer(layer):
        return attention + _routed_mlp(config, layer, tokens, formats, next_norm)
    return attention + [
        Op(name + "gate_up", "projection", layer,
           (_projection(p + "mlp.gate_proj.weight", (I, H), tokens),
            _projection(p + "mlp.up_proj.weight", (I, H), tokens)),
           act * H, act * 2 * I, group="gate_up", reads=("x",), writes=("act",), prologue=name + "mlp_norm",
           full_rows=2 * I, row_ranges=((0, 2 * I),)),
        Op(name + "silu_mul", "elementwise", layer, (), act * 2 * I, act * I,
           extra_flops=5.0 * tokens * I),
        Op(name + "down", "projection", layer,
           (_projection(p + "mlp.down_proj.weight", (H, I), tokens),),
           act * (I + H), act * H, group="down", reads=("act", "x"), writes=("x",), prepares=next_norm,
           full_rows=H, row_ranges=((0, H),)),
    ]


def _routed_mlp(config, layer: int, tokens: int, formats: dict, next_norm: str) -> list:
    """The router and the experts of a mixture-of-experts layer (in place of gate_up, silu_mul, down)."""
    H, E, k, I = config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size
    act, name = FLOAT32_BYTES * tokens, f"L{layer}."
    route = act * ROUTE_FLOATS_PER_CHOICE * k
    router = router_name(config, layer)       # kept float32: the choice of experts is made at full precision
    expert_tokens = tokens * k / E             # expected tokens per expert: each weight's FLOPs
    experts = tuple(_weight(weight, shape, expert_tokens, formats.get(weight, "Q8_0"))
                    for e in range(E)
                    for weight, shape in zip(expert_names(config, layer, e), expert_shapes(config)))
    return [
        Op(name + "router", "router", layer, (WeightRef(router, (E, H), E * H * FLOAT32_BYTES, 2.0 * tokens * E * H),),
           act * H, route, extra_flops=5.0 * tokens * E, reads=("x",), writes=("route",), prologue=name + "mlp_norm"),
        # per token: k experts' gate_up, SiLU·mul and down, their weighted sum added into x
        Op(name + "experts", "experts", layer, experts, act * 2 * H + route, act * H,
           extra_flops=tokens * k * (5.0 * I + 2.0 * H), reads=("x", "route"), writes=("x",),
           prologue=name + "mlp_norm", prepares=next_norm, read_fraction=expected_experts(E, k, tokens) / E,
           launches_per_range=TOKEN_EXPERTS_LAUNCHES if tokens == 1 else EXPERTS_LAUNCHES),
    ]


def step_ops(config, tokens: int, context_len: int = 0) -> list:
    """Every op of one step over `tokens` tokens, in execution order.

    The embedding table is owned by embed when lm_head has its own weight, and
    by lm_head when they are tied (the matmul is the use that costs; embed
    only gathers M rows from it either way).
    """
    assert tokens >= 1 and context_len >= 0
    H, V = config.hidden_size, config.vocab_size
    act = FLOAT32_BYTES * tokens
    embed_name = "model.embed_tokens.weight"
    formats = weight_formats(config)
    embed_table = _weight(embed_name, (V, H), 0, formats.get(embed_name, "Q8_0"))
    tied = bool(config.tie_word_embeddings)
    head_name = embed_name if tied else "lm_head.weight"
    head = _weight(head_name, (V, H), tokens, formats.get(head_name, "Q8_0"))
    ops = [Op("embed", "embed", None, () if tied else (embed_table,),
              TOKEN_ID_BYTES * tokens, act * H, gathers_from=embed_name, writes=("x",), prepares="L0.attn_norm",
              gather_row_bytes=embed_table.nbytes // V)]
    for layer in range(config.num_hidden_layers):
        ops += layer_ops(config, layer, tokens, context_len, formats)
    ops.append(Op("final_norm", "norm", None, (_norm("model.norm.weight", H, tokens),),
                  act * H, act * H))
    ops.append(Op("lm_head", "projection", None, (head,), act * H, act * V, group="lm_head", reads=("x",),
                  writes=("logits",), prologue="final_norm", full_rows=V, row_ranges=((0, V),)))
    return ops


def runs_alone(op: Op) -> bool:
    """Whether `op` runs as a call of its own on either side (a launch on the device, a function on the host):
    norms and elementwise ops are the prologue or epilogue of a projection, a fused rope attention's."""
    return op.kind not in FUSED_KINDS and not op.fused_into


def fuse_rope(ops: list, tokens: int) -> list:
    """A one-token device step's ops with each layer's rope op (q/k norm, RoPE, KV append) run as its
    attention's prologue: attention reads qkv, rotates q and the new key itself and appends k and v, one
    launch less per layer (kernels_ptx/attention_rope.cu).  Steps of one token only (other steps' `ops`
    come back as they are): with several tokens of one session in a step, a later token attends to a
    key that another block appends."""
    if tokens != 1:
        return ops
    fused, by_name = [], {op.name: op for op in ops}
    for op in ops:
        if op.kind == "rope":
            op = replace(op, fused_into=f"L{op.layer}.attention")
        elif op.kind == "attention":
            rope = by_name[f"L{op.layer}.rope"]
            op = replace(op, prologue=rope.name, reads=rope.reads, input_bytes=op.input_bytes - rope.output_bytes
                         + rope.input_bytes)
        fused.append(op)
    return fused


def model_weight_names(config) -> set:
    """Every tensor of the checkpoint, derived from the config alone (for the audit)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    per_layer = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                 "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
                 "mlp.down_proj"]
    if config.qk_norm:
        per_layer += ["self_attn.q_norm", "self_attn.k_norm"]
    biases = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"] if config.qkv_bias else []
    mlp = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    for layer in range(config.num_hidden_layers):
        routed = config.moe_layer(layer)
        names.update(f"model.layers.{layer}.{part}.weight" for part in per_layer if not (routed and part in mlp))
        names.update(f"model.layers.{layer}.{part}.bias" for part in biases)
        if routed:
            names.update(moe_weight_names(config, layer))
    return names
