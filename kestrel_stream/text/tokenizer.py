"""The model's tokenizer: a Hugging Face `tokenizer.json`, or the tokenizer inside a GGUF file.

Both end as one `tokenizers.Tokenizer`.  A GGUF stores its vocabulary as
`tokenizer.ggml.*` arrays; they are converted at load the way transformers'
GGUF integration does (convert_slow_tokenizer's GPT-2 and Llama converters):
  gpt2:  byte-level BPE from tokens + merges, split first by the regexes
         llama.cpp uses for the file's pre-tokenizer type (tokenizer.ggml.pre);
  llama: SentencePiece BPE: merges rebuilt from the pieces' scores, "▁" for
         spaces, <0xXX> byte fallback.
Control and user-defined tokens (token_type 3 and 4) become added tokens,
so a chat template's `<|im_start|>` is one id; control tokens are special
(left out of generated text), user-defined ones (e.g. `<think>`) are text.

The end-of-generation set is llama.cpp's: the file's eos, eot and eom ids,
and every control token whose text ends a turn or a document in some
model's format (EOG_TOKEN_TEXTS), whatever the eos id says (a SmolLM2 GGUF's
eos is `<|im_end|>`, yet the model also ends with `<|endoftext|>`).  A
Hugging Face directory adds generation_config.json's eos list and its
special added tokens of those texts.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

log = logging.getLogger(__name__)

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# tokenizer.ggml.pre -> the regexes llama.cpp (src/llama-vocab.cpp) splits with, applied in order
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx", "smaug-bpe"),
                    [LLAMA3_SPLIT]),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), [QWEN2_SPLIT]),
    **dict.fromkeys(("gpt-2", "phi-2", "default", "mpt", "olmo", "jina-es", "jina-de"), [GPT2_SPLIT]),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    [r"\p{N}", GPT2_SPLIT]),
}
IGNORE_MERGES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral")
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4
# llama.cpp's (src/llama-vocab.cpp) texts of tokens that end a generation
EOG_TOKEN_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                             "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>",
                             "<｜end▁of▁sentence｜>"})


class TokenizerError(ValueError):
    """A tokenizer that cannot be built; the message names the file."""


@dataclass
class Tokenizer:
    """encode/decode plus what generation needs: BOS, the end-of-generation ids, the chat template."""
    hf: tokenizers.Tokenizer
    eos_ids: frozenset[int]                  # ids that end a generation (EOS, EOT, <|im_end|>, ...)
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None
    source: str = ""
    special_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. "<|im_end|>") are parsed as such.
        add_special adds what the model puts around a prompt (BOS where the model wants one)."""
        if not isinstance(text, str):
            raise TypeError(f"encode: expected a str, got {type(text).__name__}")
        return self.hf.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids, skip_special: bool = False) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str | None:
        return self.hf.id_to_token(int(token_id))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from kestrel_stream.text.chat import render_chat
        if not self.chat_template:
            raise TokenizerError(f"{self.source}: the model has no chat template; use a plain prompt")
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer of a checkpoint directory (tokenizer.json beside config.json) or a .gguf file;
    None where the model carries none."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return from_gguf_metadata(gguf_tokenizer_fields(path), str(path))
    if (path / "tokenizer.json").is_file():
        return from_hf_dir(path)
    return None


# -- Hugging Face directory -------------------------------------------------
def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{file}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _token_content(value) -> str | None:
    if isinstance(value, dict):           # {"content": "<s>", ...} in older tokenizer_config.json files
        return value.get("content")
    return value if isinstance(value, str) else None


def from_hf_dir(ckpt_dir: Path) -> Tokenizer:
    file = ckpt_dir / "tokenizer.json"
    try:
        hf = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:                 # tokenizers raises plain Exception subclasses
        raise TokenizerError(f"{file}: cannot be read by the tokenizers library ({e})") from None
    config = _read_json(ckpt_dir / "tokenizer_config.json")
    generation = _read_json(ckpt_dir / "generation_config.json")
    bos_token, eos_token = _token_content(config.get("bos_token")), _token_content(config.get("eos_token"))
    eos_ids = set()
    eos_value = generation.get("eos_token_id")
    for value in eos_value if isinstance(eos_value, list) else [eos_value]:
        if isinstance(value, int):
            eos_ids.add(value)
    if eos_token is not None and hf.token_to_id(eos_token) is not None:
        eos_ids.add(hf.token_to_id(eos_token))
    eos_ids.update(i for i, t in hf.get_added_tokens_decoder().items() if t.special and t.content in EOG_TOKEN_TEXTS)
    template = config.get("chat_template")
    if isinstance(template, list):         # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (ckpt_dir / "chat_template.jinja").is_file():
        template = (ckpt_dir / "chat_template.jinja").read_text(encoding="utf-8")
    special = frozenset(i for i, t in hf.get_added_tokens_decoder().items() if t.special)
    return Tokenizer(hf, frozenset(eos_ids), bos_token, eos_token, template, str(ckpt_dir),
                     frozenset(special))


# -- GGUF -------------------------------------------------------------------
def gguf_tokenizer_fields(path: Path) -> dict:
    """The file's tokenizer.* metadata (key -> value), read through the header's mmap: the tensor data
    after it is never touched, so the cost is the vocabulary's, not the file's."""
    from kestrel_stream.loading.gguf_file import GGUFFormatError, open_shared
    try:
        f = open_shared(path)
        return {key: f.metadata(key) for key in f.keys() if key.startswith("tokenizer.")}
    except GGUFFormatError as e:
        raise TokenizerError(str(e)) from None


def _field(fields: dict, key: str, default=None):
    return fields.get(key, default)


def from_gguf_metadata(fields: dict, source: str) -> Tokenizer | None:
    """Build the tokenizer from a GGUF's tokenizer.* metadata (key -> value)."""
    kind = _field(fields, "tokenizer.ggml.model")
    if kind is None:
        return None
    tokens = _field(fields, "tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError(f"{source}: tokenizer.ggml.model is {kind!r} but tokenizer.ggml.tokens is missing")
    types = _field(fields, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        hf, add_bos_default = _gpt2_bpe(fields, tokens, source), False
    elif kind == "llama":
        hf, add_bos_default = _sentencepiece_bpe(fields, tokens, types, source), True
    else:
        raise TokenizerError(f"{source}: tokenizer.ggml.model {kind!r} is not supported (gpt2 and llama are)")
    added = [i for i, t in enumerate(types) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
    special = [i for i in added if types[i] == TOKEN_TYPE_CONTROL]
    hf.add_tokens([tokenizers.AddedToken(tokens[i], special=False, normalized=False) for i in added
                   if types[i] != TOKEN_TYPE_CONTROL])
    hf.add_special_tokens([tokenizers.AddedToken(tokens[i], special=True, normalized=False) for i in special])

    def token_at(key: str):
        token_id = _field(fields, key)
        return (token_id, tokens[token_id]) if isinstance(token_id, int) and 0 <= token_id < len(tokens) else (None, None)

    bos_id, bos_token = token_at("tokenizer.ggml.bos_token_id")
    eos_id, eos_token = token_at("tokenizer.ggml.eos_token_id")
    eot_id, _ = token_at("tokenizer.ggml.eot_token_id")
    eom_id, _ = token_at("tokenizer.ggml.eom_token_id")
    if bos_id is not None and _field(fields, "tokenizer.ggml.add_bos_token", add_bos_default):
        hf.post_processor = processors.TemplateProcessing(
            single=f"{bos_token}:0 $A:0", pair=f"{bos_token}:0 $A:0 $B:1", special_tokens=[(bos_token, bos_id)])
    eos_ids = {i for i in (eos_id, eot_id, eom_id) if i is not None}
    eos_ids.update(i for i in special if tokens[i] in EOG_TOKEN_TEXTS)     # as llama.cpp: by their text
    return Tokenizer(hf, frozenset(eos_ids), bos_token, eos_token, _field(fields, "tokenizer.chat_template"),
                     source, frozenset(added))


def _gpt2_bpe(fields, tokens: list[str], source: str) -> tokenizers.Tokenizer:
    merges = _field(fields, "tokenizer.ggml.merges")
    if merges is None:
        raise TokenizerError(f"{source}: a gpt2 tokenizer needs tokenizer.ggml.merges, which is missing")
    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise TokenizerError(f"{source}: tokenizer.ggml.merges entry {m!r} is not 'left right'")
        pairs.append((left, right))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pre = _field(fields, "tokenizer.ggml.pre", "default")
    # llama.cpp takes a pre-token that is itself in the vocabulary whole, before any merge (llama3)
    hf = tokenizers.Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False,
                                         ignore_merges=pre in IGNORE_MERGES))
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        log.warning("%s: pre-tokenizer %r is not known here; splitting as GPT-2 does", source, pre)
        splits = [GPT2_SPLIT]
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    return hf


def _sentencepiece_merges(tokens: list[str], scores) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score order: every split of a piece into two pieces of
    the vocabulary, ranked by the merged piece's score (transformers' GGUF conversion does the same)."""
    index = {tok: i for i, tok in enumerate(tokens)}
    merges = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in index and piece[k:] in index]
        local.sort(key=lambda lr: (scores[index[lr[0]]], scores[index[lr[1]]]), reverse=True)
        merges.extend((score, left, right) for left, right in local)
    merges.sort(key=lambda m: m[0], reverse=True)     # stable: ties keep the order above
    return [(left, right) for _, left, right in merges]


def _sentencepiece_bpe(fields, tokens: list[str], types, source: str) -> tokenizers.Tokenizer:
    scores = _field(fields, "tokenizer.ggml.scores")
    if scores is None:
        raise TokenizerError(f"{source}: a llama tokenizer needs tokenizer.ggml.scores, which is missing")
    scores = np.asarray(scores, np.float32).tolist()
    unk_id = _field(fields, "tokenizer.ggml.unknown_token_id", 0)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = models.BPE(vocab, _sentencepiece_merges(tokens, scores), unk_token=tokens[unk_id], fuse_unk=True,
                     byte_fallback=True)
    hf = tokenizers.Tokenizer(bpe)
    add_space_prefix = _field(fields, "tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    hf.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    decode_steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode_steps.append(decoders.Strip(content=" ", left=1, right=0))
    hf.decoder = decoders.Sequence(decode_steps)
    return hf
