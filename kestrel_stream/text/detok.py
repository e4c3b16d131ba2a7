"""Incremental detokenization: the text each new token adds, correct while streaming.

Decoding token by token loses what only context shows: a SentencePiece
decoder strips the leading space of the first token it is given, and a
character split over byte-fallback or byte-level tokens decodes to U+FFFD
until its last byte arrives.  So each step decodes a short window of recent
tokens twice (with and without the new ones) and emits the difference, and
holds text back while it ends in an incomplete character (the method of
Hugging Face text-generation-inference and vLLM).  Special tokens (control
tokens: `<|im_end|>`, `<|endoftext|>`, ...) are left out of the text, as
``skip_special_tokens`` does; user-defined tokens (`<think>`) stay.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    def __init__(self, tokenizer, prompt_ids=(), context_tokens: int = 6):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids)[-context_tokens:]
        self.prefix_offset = 0                 # start of the window decoded for context
        self.read_offset = len(self.ids)       # tokens before this have been emitted

    def push(self, token_id: int) -> str:
        """Append one token; the text it completes ("" while a character is still incomplete)."""
        self.ids.append(int(token_id))
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special=True)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special=True)
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""
        new_text = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.prefix_offset > 64:            # keep the window (and each decode) short
            drop = self.prefix_offset
            self.ids = self.ids[drop:]
            self.prefix_offset, self.read_offset = 0, self.read_offset - drop
        return new_text

    def flush(self) -> str:
        """What is still held back at the end (an incomplete character decodes as U+FFFD)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special=True)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special=True)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]
