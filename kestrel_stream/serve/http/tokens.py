"""``POST /tokenize`` and ``POST /detokenize`` in llama-server's shapes, with this server's tokenizer.

    /tokenize    {"content": str, "add_special": false, "with_pieces": false}
                 -> {"tokens": [id, ...]}  or, with_pieces, {"tokens": [{"id": id, "piece": str | [bytes]}, ...]}
    /detokenize  {"tokens": [id, ...]} -> {"content": str}

Special tokens written in the content (``<|im_start|>``) are parsed as such,
as the engine's prompts are.  A piece that is not whole UTF-8 on its own (a
byte of a multi-byte character) is given as its bytes.  The body is bounded
as a generation's, the content as a prompt's text; parsing (serve/http/bodies.py)
and the tokenizer run on a worker thread.
"""
from __future__ import annotations

import re
from functools import cache

from starlette.responses import JSONResponse, Response

from kestrel_stream.serve.http.bodies import Body, BodyReader
from kestrel_stream.serve.http.errors import APIError, bad_param


class TokenRoutes:
    def __init__(self, service, bodies: BodyReader, prompt_bounds):
        """bodies: the API's bounded body reader; prompt_bounds: the PromptBounds of a prompt (worker thread), which
        bound the content tokenized as a prompt's text."""
        self.service, self.bodies, self.prompt_bounds = service, bodies, prompt_bounds

    async def tokenize(self, request) -> Response:
        return await self.answer(request, self.tokenized)

    async def detokenize(self, request) -> Response:
        return await self.answer(request, self.detokenized)

    async def answer(self, request, work) -> Response:
        """``work(fields)`` -> the answer's JSON, run with the body's parsing and the answer's encoding on a worker
        thread (a body, a token list and a text may each be megabytes)."""
        try:
            body = await self.bodies.read(request)
            if await self.service.tokenizer() is None:
                raise APIError(400, "the model has no tokenizer", code="no_tokenizer")
            return await self.bodies.off_loop(body, self.answered, body, work)
        except APIError as e:
            return e.response()

    @staticmethod
    def answered(body: Body, work) -> Response:
        fields = body.json()
        if not isinstance(fields, dict):
            raise APIError(400, f"the request body must be a JSON object, got {type(fields).__name__}")
        return JSONResponse(work(fields))

    def tokenized(self, fields: dict) -> dict:
        content = fields.get("content")
        if not isinstance(content, str):
            raise bad_param("content", f"expected a string, got {content!r:.80}", "invalid_type")
        flags = {}
        for name in ("add_special", "with_pieces"):
            flags[name] = fields.get(name, False)
            if not isinstance(flags[name], bool):
                raise bad_param(name, f"expected a boolean, got {flags[name]!r:.80}", "invalid_type")
        self.prompt_bounds().check_chars(len(content), "content")   # no more than a prompt may hold
        tokenizer = self.service.engine.tokenizer
        ids = tokenizer.encode(content, add_special=flags["add_special"])
        if not flags["with_pieces"]:
            return {"tokens": ids}
        return {"tokens": [{"id": i, "piece": piece_of(tokenizer, i)} for i in ids]}

    def detokenized(self, fields: dict) -> dict:
        tokens = fields.get("tokens")
        vocab = self.service.vocab_size
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise bad_param("tokens", f"expected a list of token ids, got {tokens!r:.80}", "invalid_type")
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_param("tokens", f"token id {bad} is outside the vocabulary 0..{vocab - 1}")
        return {"content": self.service.engine.tokenizer.decode(tokens)}


def piece_of(tokenizer, token: int) -> str | list[int]:
    """The text of one token, or its bytes where they are not whole UTF-8 alone (llama-server's choice)."""
    text = tokenizer.decode([token])
    if "\ufffd" not in text:
        return text
    raw = tokenizer.token_text(token) or ""
    if BYTE_FALLBACK.fullmatch(raw):                # SentencePiece: <0xE2>
        return [int(raw[3:5], 16)]
    byte_of = byte_level_bytes()
    if raw and all(c in byte_of for c in raw):      # byte-level BPE: one character a byte
        return [byte_of[c] for c in raw]
    return list(text.encode("utf-8"))


BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@cache
def byte_level_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars
