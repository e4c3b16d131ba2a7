"""Model configuration: the Llama family and Qwen3, parsed from a Hugging Face config.json.

Only the fields a decode step needs are kept (gpt-fast's ModelArgs, mlx-lm's
from_dict); anything that would change the arithmetic and is not supported
(biases, rope scaling other than none, another activation) is rejected with a
message that names it, rather than silently computing something else.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}


class ConfigError(ValueError):
    """A config.json (or GGUF metadata) that kestrel-stream cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str                      # "llama" | "qwen3"
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

    @property
    def qk_norm(self) -> bool:
        """Qwen3 applies an RMSNorm over head_dim to every q and k head before RoPE."""
        return self.arch == "qwen3"

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
        if arch is None and not archs and model_type in ("llama", "qwen3"):
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
            if d.get(flag):
                raise ConfigError(f"{where}: {flag}=true is not supported")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act={act!r} is not supported (only 'silu')")
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(f"{where}: rope scaling type {rope_type!r} is not supported")
        theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
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
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        )
        for name, size in (("hidden_size", cfg.hidden_size),
                           ("intermediate_size", cfg.intermediate_size),
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
            "attention_bias": False,
            "torch_dtype": "float32",
        }
