"""Model configuration: Llama (1-3.x), Mistral, Qwen2/2.5, Qwen3 and the mixture-of-experts Qwen3-MoE and
Mixtral, parsed from a Hugging Face config.json.

Only the fields a decode step needs are kept (gpt-fast's ModelArgs, mlx-lm's
from_dict); anything that would change the arithmetic and is not supported
(an o/MLP bias, rope scaling other than linear/llama3/yarn, another
activation) is rejected with a message that names it, rather than silently
computing something else.  Mistral is Llama-shaped with an optional sliding
attention window; Qwen2 adds a bias to the q, k and v projections.  Qwen3-MoE is Qwen3 with a routed MLP
(softmax over the experts, top-k, renormalized when norm_topk_prob; some layers may keep a dense MLP),
Mixtral is Mistral with one (top-k on the router's logits, softmax over the chosen).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from kestrel_stream.model.rope import RopeScaling, parse_rope_scaling

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
QKV_BIAS_ARCHS = ("qwen2",)
QK_NORM_ARCHS = ("qwen3", "qwen3_moe")
SLIDING_ARCHS = ("mistral", "mixtral")
MOE_ARCHS = ("qwen3_moe", "mixtral")


class ConfigError(ValueError):
    """A config.json (or GGUF metadata) that kestrel-stream cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str                      # "llama" | "mistral" | "qwen2" | "qwen3" | "qwen3_moe" | "mixtral"
    hidden_size: int               # H
    intermediate_size: int         # I (MLP width)
    num_hidden_layers: int         # L
    num_attention_heads: int       # n_heads
    num_key_value_heads: int       # n_kv_heads (GQA: n_heads % n_kv_heads == 0)
    head_dim: int                  # D, independent of H / n_heads in Qwen3
    vocab_size: int                # V
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None   # a GGUF's rope_freqs.weight: [D/2] divisors
    sliding_window: int | None = None   # attention sees the last sliding_window positions (Mistral)
    # (HF weight name, block format) for linear weights kept in a format other than Q8_0 (a GGUF's
    # Q4_0 / Q4_K / Q6_K tensors, model/quant4.py): what the cost model and the window count
    weight_formats: tuple[tuple[str, str], ...] = ()
    # mixture of experts (0 experts: a dense model)
    num_experts: int = 0               # E, experts of a routed layer
    num_experts_per_tok: int = 0       # k, experts each token uses
    moe_intermediate_size: int = 0     # one expert's MLP width
    norm_topk_prob: bool = False       # the chosen experts' weights renormalized to sum to 1
    dense_layers: tuple[int, ...] = () # layers of an MoE model with a dense MLP (Qwen3-MoE's mlp_only_layers and
                                       # the layers decoder_sparse_step skips)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def moe_layer(self, layer: int) -> bool:
        """Whether `layer` routes its MLP through experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def router_softmax_first(self) -> bool:
        """Qwen3-MoE: softmax over every expert, then top-k (renormalized when norm_topk_prob); Mixtral: top-k
        on the logits, then softmax over the chosen (equal to renormalizing the first's)."""
        return self.arch != "mixtral"

    @property
    def qkv_bias(self) -> bool:
        """Qwen2 adds a bias to the q, k and v projections (not o)."""
        return self.arch in QKV_BIAS_ARCHS

    @property
    def qk_norm(self) -> bool:
        """Qwen3 applies an RMSNorm over head_dim to every q and k head before RoPE."""
        return self.arch in QK_NORM_ARCHS

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def gqa_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "ModelConfig":
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        arch = None
        for name in archs:
            arch = SUPPORTED_ARCHITECTURES.get(name)
            if arch:
                break
        if arch is None and not archs and model_type in SUPPORTED_ARCHITECTURES.values():
            arch = model_type
        if arch is None:
            named = ", ".join(archs) if archs else f"model_type={model_type!r}"
            raise ConfigError(
                f"{where}: unsupported architecture {named}; kestrel-stream runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")

        def need(key):
            if key not in d:
                raise ConfigError(f"{where}: missing required key {key!r} for {arch}")
            value = d[key]
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{where}: {key!r} must be a positive integer, got {value!r}")
            return value

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = d.get("num_key_value_heads") or heads
        head_dim = d.get("head_dim") or hidden // heads
        if heads % kv_heads:
            raise ConfigError(f"{where}: num_attention_heads={heads} is not a multiple of "
                              f"num_key_value_heads={kv_heads}")
        if head_dim % 2:
            raise ConfigError(f"{where}: head_dim={head_dim} must be even for RoPE")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag) and arch not in QKV_BIAS_ARCHS:
                raise ConfigError(f"{where}: {flag}=true is not supported for {arch} (an o/MLP bias)")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act={act!r} is not supported (only 'silu')")
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{where}: rope_scaling must be an object, got {rope!r}")
        max_positions = int(d.get("max_position_embeddings", 4096))
        try:
            scaling = parse_rope_scaling(rope, max_positions, where)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        window = d.get("sliding_window") if arch in SLIDING_ARCHS else None
        if arch == "qwen2" and d.get("use_sliding_window"):
            raise ConfigError(f"{where}: use_sliding_window=true (sliding attention in some Qwen2 layers only) "
                              "is not supported")
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
            raise ConfigError(f"{where}: sliding_window must be a positive integer or null, got {window!r}")
        cfg = cls(
            arch=arch,
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=need("vocab_size"),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=max_positions,
            rope_scaling=scaling,
            sliding_window=window,
            **_moe_fields(d, arch, where),
        )
        for name, size in (("hidden_size", cfg.hidden_size),
                           ("intermediate_size", cfg.intermediate_size),
                           ("moe_intermediate_size", cfg.moe_intermediate_size),
                           ("num_attention_heads*head_dim", cfg.q_size)):
            if size % 32:
                raise ConfigError(f"{where}: {name}={size} is not a multiple of 32, "
                                  "the Q8_0 group size")
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls.from_dict(d, where=str(path))

    def to_hf_dict(self) -> dict:
        """config.json contents for a checkpoint of this shape (make-model, tests)."""
        name = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.arch]
        return {
            "architectures": [name],
            "model_type": self.arch,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": self.qkv_bias,
            "torch_dtype": "float32",
            **({"rope_scaling": _rope_dict(self.rope_scaling)} if self.rope_scaling else {}),
            **({"sliding_window": self.sliding_window} if self.arch in SLIDING_ARCHS else {}),
            **_moe_dict(self),
        }


def _moe_fields(d: dict, arch: str, where: str) -> dict:
    """The mixture-of-experts fields of a config.json (none for a dense architecture)."""
    if arch not in MOE_ARCHS:
        return {}

    def positive(key):
        value = d.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{where}: {key!r} must be a positive integer for {arch}, got {value!r}")
        return value
    layers = d.get("num_hidden_layers")
    if arch == "mixtral":
        experts, width, normalize, dense = positive("num_local_experts"), positive("intermediate_size"), True, ()
    else:
        experts, width = positive("num_experts"), positive("moe_intermediate_size")
        normalize = bool(d.get("norm_topk_prob", False))
        step, only = d.get("decoder_sparse_step", 1), d.get("mlp_only_layers") or []
        if not isinstance(step, int) or step <= 0 or not all(isinstance(i, int) for i in only):
            raise ConfigError(f"{where}: decoder_sparse_step={step!r} / mlp_only_layers={only!r} are not valid")
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    chosen = positive("num_experts_per_tok")
    if chosen > experts:
        raise ConfigError(f"{where}: num_experts_per_tok={chosen} is more than the {experts} experts")
    if d.get("shared_expert_intermediate_size"):
        raise ConfigError(f"{where}: a shared expert is not supported for {arch}")
    return dict(num_experts=experts, num_experts_per_tok=chosen, moe_intermediate_size=width,
                norm_topk_prob=normalize, dense_layers=dense)


def _moe_dict(c: ModelConfig) -> dict:
    """config.json's mixture-of-experts keys for ``c``."""
    if c.arch == "mixtral":
        return {"num_local_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok,
                "router_jitter_noise": 0.0}
    if c.arch == "qwen3_moe":
        return {"num_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok,
                "moe_intermediate_size": c.moe_intermediate_size, "norm_topk_prob": c.norm_topk_prob,
                "decoder_sparse_step": 1, "mlp_only_layers": list(c.dense_layers), "use_sliding_window": False}
    return {}


def _rope_dict(s: RopeScaling) -> dict:
    """config.json's rope_scaling object for ``s``."""
    d = {"rope_type": s.type, "factor": s.factor}
    if s.type == "llama3":
        d.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                 original_max_position_embeddings=s.original_max_position_embeddings)
    elif s.type == "yarn":
        d.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate,
                 original_max_position_embeddings=s.original_max_position_embeddings)
        if s.attention_factor is not None:
            d["attention_factor"] = s.attention_factor
    return d
