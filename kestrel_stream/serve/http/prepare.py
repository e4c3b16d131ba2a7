"""From a generation request's body to a ready ``HttpGeneration``, on a worker thread: JSON, fields, the cheap
bounds, then the chat template and the tokens.

All of it is CPU work proportional to the body (megabytes of JSON, a
template over thousands of messages, a tokenizer over the text), so none of
it runs on the event loop, which keeps answering other clients (/health
included) meanwhile.  The cheap bounds come first, so a body that cannot fit
the context is refused before it is rendered or tokenized: lists no longer
than the context (checked while the JSON is parsed), then characters against
the context (requests.PromptBounds).  Large bodies are prepared one at a time
on a thread of their own, so they neither crowd out small requests nor
hold more than one large body's objects at once.
"""
from __future__ import annotations

import anyio

from kestrel_stream.serve.http.errors import APIError
from kestrel_stream.serve.http.generate import HttpGeneration
from kestrel_stream.serve.http.requests import PromptBounds, parse_request
from kestrel_stream.wire.json_limits import JSONLimitError, load_limited, load_walked
from kestrel_stream.serve.memory import release_freed_memory

LARGE_BODY_BYTES = 256 << 10        # from here a body is parsed walking its lists, on the large bodies' thread


class Preparer:
    def __init__(self, service, model_name: str, max_body_bytes: int, key_scope: str | None = None):
        """key_scope: the prefix cache scope of HTTP requests (--prefix-cache-scope key), None: shared."""
        self.service, self.model_name, self.max_body_bytes = service, model_name, max_body_bytes
        self.key_scope = key_scope
        self.large_bodies = anyio.CapacityLimiter(1)
        self.bounds: PromptBounds | None = None         # once the tokenizer is built

    async def generation(self, data: bytearray, chat: bool) -> HttpGeneration:
        """The request in ``data``, checked and tokenized; APIError for a bad one.  ``data`` is emptied."""
        await self.service.tokenizer()          # built in the background after the load: may still be running
        if len(data) < LARGE_BODY_BYTES:
            return await anyio.to_thread.run_sync(self.prepare, data, chat)
        try:
            return await anyio.to_thread.run_sync(self.prepare, data, chat, limiter=self.large_bodies)
        except APIError as e:
            refusal = e.with_traceback(None)    # its frames (and its context's) held the body's text and objects
            refusal.__context__ = None
        finally:                    # its text and parsed objects are gone: give their pages back to the system
            await anyio.to_thread.run_sync(release_freed_memory, limiter=self.large_bodies)
        raise refusal

    def prepare(self, data: bytearray, chat: bool) -> HttpGeneration:
        bounds = self.prompt_bounds()
        try:
            text = data.decode("utf-8")
            data.clear()
            if len(text) >= LARGE_BODY_BYTES:
                body = load_walked(text, self.max_body_bytes, max_items=bounds.context_tokens)
            else:
                body = load_limited(text, max_chars=self.max_body_bytes)
        except UnicodeDecodeError as e:
            raise APIError(400, f"the request body is not UTF-8: {e}", code="invalid_json") from None
        except JSONLimitError as e:
            if e.where is not None:          # a list longer than the context: the field is known
                raise APIError(400, f"{e}; this model's context is {bounds.context_tokens} tokens",
                               param=e.where, code="context_length_exceeded") from None
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        del text
        parsed = parse_request(body, chat, self.service.vocab_size, bounds, self.service.sampling_defaults)
        model = body.get("model")
        if not isinstance(model, str) or model != self.model_name:
            raise APIError(404, f"model {model!r:.80} does not exist; this server has {self.model_name!r}",
                           param="model", code="model_not_found")
        del body
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
