"""Structured outputs: a generation held to a JSON grammar by masking, before sampling, every token that cannot
continue a valid document (llguidance: Microsoft's low-level grammar engine, Rust; the mask of a step is
computed from the tokenizer's trie and the parser state, not by testing each token).

``Grammars`` belongs to one tokenizer: it builds llguidance's view of the
vocabulary once, on first use (under a second for a 50k vocabulary), and
compiles a request's response_format (or a forced tool call's grammar) into a
``Constraint``: one matcher per generation, fed each token sampled.  When the document is complete the
grammar allows only the end-of-generation tokens, so a constrained
generation stops as a plain one does.

Imported only when a request asks for structured output: a server that never
gets one never loads the library.
"""
from __future__ import annotations

import json
import threading

import numpy as np

JSON_OBJECT_SCHEMA = {"type": "object"}


class GrammarError(ValueError):
    """A response_format that cannot be compiled into a grammar; the message says why."""


class Grammars:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lock = threading.Lock()
        self.ll_tokenizer = None

    def vocabulary(self):
        with self.lock:             # built once, from whichever worker thread asks first
            if self.ll_tokenizer is None:
                import llguidance
                tok = self.tokenizer
                self.ll_tokenizer = llguidance.LLTokenizer(tok.hf.to_str(), n_vocab=tok.vocab_size,
                                                           eos_token=sorted(tok.eos_ids) or None)
            return self.ll_tokenizer

    def json(self, schema: dict | None, vocab_size: int) -> "Constraint":
        """A constraint to JSON: any object (``schema`` None, as response_format json_object) or a document
        of ``schema`` (json_schema).  GrammarError for a schema the compiler refuses."""
        import llguidance
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(JSON_OBJECT_SCHEMA if schema is None else schema),
                defaults={"whitespace_flexible": False})
        except ValueError as e:
            raise GrammarError(f"the schema cannot be compiled: {e}") from None
        return self.compiled(grammar, vocab_size)

    def lark(self, text: str, vocab_size: int) -> "Constraint":
        """A constraint to llguidance's lark grammar ``text`` (JSON Schemas inline as ``%json {...}``; a tool
        call's, text/tool_calls.py).  GrammarError for one the compiler refuses."""
        import llguidance
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
        except ValueError as e:
            raise GrammarError(f"the grammar cannot be compiled: {e}") from None
        return self.compiled(grammar, vocab_size)

    def compiled(self, grammar: str, vocab_size: int) -> "Constraint":
        import llguidance
        ll_tokenizer = self.vocabulary()
        error = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer)
        if error:
            raise GrammarError(f"the schema cannot be compiled: {error}")
        return Constraint(llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0), vocab_size,
                          frozenset(ll_tokenizer.eos_tokens))


class Constraint:
    """One generation's grammar state: ``mask`` the logits before a token is drawn, ``accept`` it after."""

    def __init__(self, matcher, vocab_size: int, end_ids: frozenset[int] = frozenset()):
        self.matcher, self.vocab_size = matcher, vocab_size
        # the tokens the grammar ends a document with: the model's end-of-generation ids, or (a model with
        # none) the one llguidance takes instead (id 0), which the mask allows only as the end
        self.end_ids = end_ids
        self.words = np.empty((vocab_size + 31) // 32, np.int32)      # 1 bit a token: allowed

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """The logits [vocab] with every token the grammar does not allow now at -inf (a copy)."""
        self.matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        allowed = np.unpackbits(self.words.view(np.uint8), bitorder="little")[:len(logits)].astype(bool)
        return np.where(allowed, logits, -np.inf).astype(np.float32, copy=False)

    def copy(self) -> "Constraint":
        """A constraint in the same state, going on on its own (a sibling choice's)."""
        return Constraint(self.matcher.deep_copy(), self.vocab_size, self.end_ids)

    def accept(self, token: int) -> None:
        self.matcher.consume_token(int(token))

    @property
    def complete(self) -> bool:
        """The document has ended: nothing but an end-of-generation token may follow."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None
