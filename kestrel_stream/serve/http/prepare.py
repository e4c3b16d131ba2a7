"""From a generation request's body to a ready ``HttpGeneration``, on a worker thread: JSON, fields, the cheap
bounds, then the chat template and the tokens.

All of it is CPU work proportional to the body (megabytes of JSON, a
template over thousands of messages, a tokenizer over the text), so none of
it runs on the event loop, which keeps answering other clients (/health
included) meanwhile (serve/http/bodies.py: where a body's work runs).  The
cheap bounds come first, so a body that cannot fit the context is refused
before it is rendered or tokenized: lists no longer than the context (checked
while the JSON is parsed), then characters against the context
(requests.PromptBounds).
"""
from __future__ import annotations

from kestrel_stream.serve.http.bodies import Body, BodyReader
from kestrel_stream.serve.http.errors import APIError
from kestrel_stream.serve.http.generate import HttpGeneration
from kestrel_stream.serve.http.requests import PromptBounds, parse_request
from kestrel_stream.wire.json_limits import JSONLimitError


class Preparer:
    def __init__(self, service, model_name: str, bodies: BodyReader, key_scope: str | None = None):
        """key_scope: the prefix cache scope of HTTP requests (--prefix-cache-scope key), None: shared."""
        self.service, self.model_name, self.bodies = service, model_name, bodies
        self.key_scope = key_scope
        self.bounds: PromptBounds | None = None         # once the tokenizer is built

    async def generation(self, body: Body, chat: bool) -> HttpGeneration:
        """The request in ``body``, checked and tokenized; APIError for a bad one.  ``body`` is emptied."""
        await self.service.tokenizer()          # built in the background after the load: may still be running
        return await self.bodies.off_loop(body, self.prepare, body, chat)

    def prepare(self, body: Body, chat: bool) -> HttpGeneration:
        bounds = self.prompt_bounds()
        try:
            fields = body.json(max_items=bounds.context_tokens)
        except JSONLimitError as e:          # a list longer than the context: the field is known
            raise APIError(400, f"{e}; this model's context is {bounds.context_tokens} tokens",
                           param=e.where, code="context_length_exceeded") from None
        parsed = parse_request(fields, chat, self.service.vocab_size, bounds, self.service.sampling_defaults)
        model = fields.get("model")
        if not isinstance(model, str) or model != self.model_name:
            raise APIError(404, f"model {model!r:.80} does not exist; this server has {self.model_name!r}",
                           param="model", code="model_not_found")
        del fields
        return HttpGeneration(self.service, parsed, self.key_scope)

    def prompt_bounds(self) -> PromptBounds:
        if self.bounds is None:         # races are harmless: every thread computes the same value
            engine = self.service.engine
            self.bounds = PromptBounds(engine.max_seq_len, longest_token_chars(engine.tokenizer))
        return self.bounds


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of the vocabulary stands for (1 without a tokenizer: ids only).  The
    vocabulary's own strings are never shorter than what they decode to (a byte-level or byte-fallback token
    is written with at least as many characters as its text has), so the bound errs on the long side (a
    normalizer that merges characters aside)."""
    if tokenizer is None:
        return 1
    return max(1, max((len(t) for t in tokenizer.hf.get_vocab(with_added_tokens=True)), default=1))
