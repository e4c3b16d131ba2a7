"""Random checkpoints with real architectures' shapes (``kestrel-stream make-model``).

Weights are scaled so activations stay finite through every layer:
projections ~ N(0, 1/fan_in), the two projections that write the residual
stream (o, down) further by 1/sqrt(2L), norms ~ 1 + N(0, 0.1^2), the
embedding ~ N(0, 0.02^2) as Hugging Face initializes it (a larger one dominates
the residual stream, and a tied lm_head then just repeats the input token).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from kestrel_stream.loading.checkpoint_writer import write_checkpoint
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.model.rope import RopeScaling
from kestrel_stream.model.weights import hf_tensor_shapes

GENERATOR_VERSION = 2   # bump when random_tensor's scaling changes, so cached preset checkpoints are rebuilt

PRESETS: dict[str, ModelConfig] = {
    # A Qwen3 with head_dim independent of hidden/heads and GQA 2: fast enough for every test, and
    # head_dim 64 so the GPU kernels (head_dim 64/128/256) run it too.
    "tiny": ModelConfig(arch="qwen3", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=256,
                        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                        max_position_embeddings=512),
    "llama-tiny": ModelConfig(arch="llama", hidden_size=256, intermediate_size=352, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=64, vocab_size=320,
                              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                              max_position_embeddings=512),
    # Llama 3.x's rope scaling (the original context shrunk so that the three frequency bands all occur)
    # at head_dim 32; Mistral with a sliding window shorter than a test's prompt, at head_dim 80; Qwen2.5's
    # q/k/v bias with YaRN.
    "llama3-tiny": ModelConfig(arch="llama", hidden_size=128, intermediate_size=224, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=288,
                               rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                               max_position_embeddings=512,
                               rope_scaling=RopeScaling("llama3", 8.0, original_max_position_embeddings=64,
                                                        low_freq_factor=1.0, high_freq_factor=4.0)),
    "mistral-tiny": ModelConfig(arch="mistral", hidden_size=160, intermediate_size=256, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=80, vocab_size=256,
                                rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=False,
                                max_position_embeddings=512, sliding_window=6),
    "qwen2-tiny": ModelConfig(arch="qwen2", hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256,
                              rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                              max_position_embeddings=512,
                              rope_scaling=RopeScaling("yarn", 4.0, original_max_position_embeddings=128)),
    # Mixture of experts: Qwen3-MoE with a dense layer between two routed ones (mlp_only_layers), and
    # Mixtral; few enough experts that a short prompt reaches every one of them.
    "qwen3-moe-tiny": ModelConfig(arch="qwen3_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256,
                                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                                  max_position_embeddings=512, num_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=64, norm_topk_prob=True, dense_layers=(1,)),
    "mixtral-tiny": ModelConfig(arch="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                                rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=False,
                                max_position_embeddings=512, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=96, norm_topk_prob=True),
    # Qwen3-30B-A3B's routed layers (the top 8 of many narrow experts, no dense layer) at a size a small
    # machine's benches hold: 24 layers of 64 experts, ~3 GB in Q8_0
    "qwen3-moe-small": ModelConfig(arch="qwen3_moe", hidden_size=1024, intermediate_size=3072, num_hidden_layers=24,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=151936,
                                   rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                                   max_position_embeddings=40960, num_experts=64, num_experts_per_tok=8,
                                   moe_intermediate_size=512, norm_topk_prob=True),
    "qwen3-0.6b": ModelConfig(arch="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                              rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                              max_position_embeddings=40960),
    "qwen3-1.7b": ModelConfig(arch="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                              rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                              max_position_embeddings=40960),
    "qwen3-8b": ModelConfig(arch="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                            rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                            max_position_embeddings=40960),
    "qwen3-30b-a3b": ModelConfig(arch="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                 num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                                 rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                                 max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8,
                                 moe_intermediate_size=768, norm_topk_prob=True),
}


def random_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...], cfg: ModelConfig) -> np.ndarray:
    """One float32 tensor of a random checkpoint, scaled by its role (see module docstring)."""
    if name.endswith(".bias"):
        return (0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if len(shape) == 1:
        return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        scale = 0.02 if name.endswith("embed_tokens.weight") else 1.0 / np.sqrt(shape[1])
    else:
        scale = 1.0 / np.sqrt(shape[1])
        if name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):    # w2: Mixtral's expert down
            scale /= np.sqrt(2 * cfg.num_hidden_layers)
    out = rng.standard_normal(shape, dtype=np.float32)
    out *= np.float32(scale)
    return out


def random_weights(cfg: ModelConfig, seed: int = 0) -> Callable[[str, tuple[int, ...]], np.ndarray]:
    """A producer of deterministic random tensors: each tensor's values depend only on (seed, name)."""
    def produce(name: str, shape: tuple[int, ...]) -> np.ndarray:
        name_key = int.from_bytes(name.encode()[-16:].ljust(16, b"\0"), "little") ^ len(name)
        rng = np.random.default_rng([seed, name_key])
        return random_tensor(rng, name, shape, cfg)
    return produce


def make_model(out_dir: str | Path, preset: str | ModelConfig, seed: int = 0, dtype: str = "bf16",
               max_shard_bytes: int = 2 << 30, on_tensor: Callable[[str], None] | None = None) -> Path:
    """Write a random Hugging Face checkpoint of ``preset``'s shapes to ``out_dir``."""
    cfg = PRESETS[preset] if isinstance(preset, str) else preset
    out_dir = Path(out_dir)
    specs = list(hf_tensor_shapes(cfg).items())
    write_checkpoint(out_dir, cfg.to_hf_dict(), specs, random_weights(cfg, seed), dtype=dtype,
                     max_shard_bytes=max_shard_bytes, on_tensor=on_tensor)
    write_byte_tokenizer(out_dir, cfg.vocab_size)          # so generate and the demo print text
    return out_dir


def write_byte_tokenizer(out_dir: Path, vocab_size: int) -> Path | None:
    """A byte-level tokenizer.json (one token per byte, ids 0..255) for a random preset checkpoint, so its
    output reads as text; None where the vocabulary is smaller than 256."""
    if vocab_size < 256:
        return None
    import tokenizers                       # imported here: make-model's weights need only numpy
    from tokenizers import decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: _byte_of(ch))
    hf = tokenizers.Tokenizer(models.BPE({ch: i for i, ch in enumerate(alphabet)}, []))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    path = Path(out_dir) / "tokenizer.json"
    hf.save(str(path))
    return path


def _byte_of(ch: str) -> int:
    """GPT-2's byte -> printable character map, inverted (printable bytes map to themselves)."""
    code = ord(ch)
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    return code if code in printable else sorted(set(range(256)) - set(printable))[code - 256]


def cache_root() -> Path:
    """Where preset models are generated: Options.cache_dir (KESTREL_CACHE_DIR), else ~/.cache/kestrel-stream."""
    from kestrel_stream.options import Options
    return Options.from_env().cache_dir or Path.home() / ".cache" / "kestrel-stream"


def preset_dir(preset: str, seed: int = 0, dtype: str = "bf16") -> Path:
    """Where ``ensure_preset`` keeps the random checkpoint of ``preset``."""
    return cache_root() / "models" / f"{preset}-seed{seed}-{dtype}-v{GENERATOR_VERSION}"


def ensure_preset(preset: str, seed: int = 0, dtype: str = "bf16",
                  on_tensor: Callable[[str], None] | None = None) -> Path:
    """The path of a random checkpoint of ``preset`` in the cache dir, written on first use."""
    out_dir = preset_dir(preset, seed, dtype)
    if not (out_dir / "config.json").exists():
        make_model(out_dir, preset, seed=seed, dtype=dtype, on_tensor=on_tensor)
    return out_dir
