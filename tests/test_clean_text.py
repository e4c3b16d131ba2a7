"""Clean text: every end-of-generation token of the tokenizer stops a generation, and generated text never holds
control tokens (skip_special_tokens), while user-defined tokens such as <think> stay text."""
from __future__ import annotations

import json

from tokenizers import pre_tokenizers

from kestrel_stream.text.detok import IncrementalDecoder
from kestrel_stream.text.stop import EOS, StopChecker
from kestrel_stream.text.tokenizer import TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, from_gguf_metadata, from_hf_dir

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>"]
USER_DEFINED = ["<think>"]


def smollm2_like_fields(eos: str = "<|im_end|>") -> dict:
    """A GGUF's tokenizer metadata shaped as SmolLM2's: control tokens first, eos <|im_end|> (id 2), a byte-level
    vocabulary after them."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = CONTROL + USER_DEFINED + alphabet
    types = [TOKEN_TYPE_CONTROL] * len(CONTROL) + [TOKEN_TYPE_USER_DEFINED] * len(USER_DEFINED) + [1] * len(alphabet)
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": [],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": tokens.index(eos)}


def test_every_end_of_generation_token_is_in_the_stop_set_whatever_the_eos_id():
    tok = from_gguf_metadata(smollm2_like_fields(), "smollm2-like.gguf")
    assert tok.eos_ids == {0, 2}                    # <|endoftext|> too, though the file's eos is <|im_end|>
    tok = from_gguf_metadata(smollm2_like_fields(eos="<|endoftext|>"), "base.gguf")
    assert tok.eos_ids == {0, 2}
    fields = {**smollm2_like_fields(), "tokenizer.ggml.eot_token_id": 3, "tokenizer.ggml.eom_token_id": 1}
    assert from_gguf_metadata(fields, "eot.gguf").eos_ids == {0, 1, 2, 3}


def test_a_hugging_face_directory_adds_its_special_end_tokens(tmp_path):
    from tokenizers import AddedToken, Tokenizer, models
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    hf = Tokenizer(models.BPE({ch: i for i, ch in enumerate(alphabet)}, []))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5]}))
    tok = from_hf_dir(tmp_path)
    ends = {hf.token_to_id("<|endoftext|>"), hf.token_to_id("<|im_end|>")}
    assert tok.eos_ids == ends | {5} and hf.token_to_id("<|im_start|>") not in tok.eos_ids


def test_generated_text_leaves_control_tokens_out_and_keeps_user_defined_ones():
    tok = from_gguf_metadata(smollm2_like_fields(), "smollm2-like.gguf")
    ids = tok.encode("<|im_end|>\n<|im_start|>assistant <think>hi<|endoftext|>", add_special=False)
    assert tok.decode(ids) == "<|im_end|>\n<|im_start|>assistant <think>hi<|endoftext|>"     # the public decode
    decoder = IncrementalDecoder(tok, tok.encode("<|im_start|>user", add_special=False))
    text = "".join(decoder.push(t) for t in ids) + decoder.flush()
    assert text == "\nassistant <think>hi"


def test_an_end_of_generation_token_ends_the_text_it_is_not_part_of():
    tok = from_gguf_metadata(smollm2_like_fields(), "smollm2-like.gguf")
    stop = StopChecker(tok.eos_ids, max_new_tokens=50)
    decoder = IncrementalDecoder(tok)
    text = ""
    for token in tok.encode("Ad<|endoftext|>\n\nGet Smart", add_special=False):
        text += stop.push(token, decoder.push(token) if token not in stop.eos_ids else "")
        if stop.reason is not None:
            break
    assert stop.reason == EOS and text == "Ad"
