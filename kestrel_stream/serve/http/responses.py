"""OpenAI's response bodies: completion and chat completion objects, their stream chunks, logprobs, usage."""
from __future__ import annotations

import json
import time
import uuid


class Shape:
    """The ids and fixed fields of one response; ``chat`` picks the chat or the completions shape."""

    def __init__(self, chat: bool, model: str, generation):
        self.chat, self.model, self.generation = chat, model, generation
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text_offset = 0
        self.framing: tuple[bytes, bytes] | None = None    # token_event's bytes around the text

    def head(self, stream: bool) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def usage(self) -> dict:
        g = self.generation
        return {"prompt_tokens": g.prompt_tokens, "completion_tokens": len(g.tokens),
                "total_tokens": g.prompt_tokens + len(g.tokens)}

    # -- logprobs --------------------------------------------------------------
    def chat_logprobs(self, outs) -> dict | None:
        if self.generation.request.logprobs is None:
            return None
        text = self.generation.token_text

        def entry(token: int, logprob: float) -> dict:
            piece = text(token)
            return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8", "replace"))}
        return {"content": [{**entry(o.token, o.logprob), "top_logprobs": [entry(t, lp) for t, lp in o.top]}
                            for o in outs], "refusal": None}

    def completion_logprobs(self, outs) -> dict | None:
        if self.generation.request.logprobs is None:
            return None
        text = self.generation.token_text
        tokens, offsets = [], []
        for o in outs:
            tokens.append(text(o.token))
            offsets.append(self.text_offset)
            self.text_offset += len(o.text)
        # a dict by token text: where two tokens read the same (e.g. partial UTF-8), the likelier one stays
        return {"tokens": tokens, "token_logprobs": [o.logprob for o in outs],
                "top_logprobs": [{text(t): lp for t, lp in reversed(o.top)} for o in outs], "text_offset": offsets}

    # -- whole responses -------------------------------------------------------
    def complete(self, outs) -> dict:
        text = "".join(o.text for o in outs)
        reason = self.generation.finish_reason
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                      "logprobs": self.chat_logprobs(outs), "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": self.completion_logprobs(outs), "finish_reason": reason}
        return {**self.head(False), "choices": [choice], "usage": self.usage()}

    # -- stream chunks ---------------------------------------------------------
    def chunk(self, outs, finish_reason: str | None = None, first: bool = False, include_usage: bool = False) -> dict:
        text = "".join(o.text for o in outs)
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if outs else {})
            choice = {"index": 0, "delta": delta, "logprobs": self.chat_logprobs(outs) if outs else None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": self.completion_logprobs(outs) if outs else None,
                      "finish_reason": finish_reason}
        body = {**self.head(True), "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return body

    def token_event(self, out, include_usage: bool) -> bytes:
        """The SSE event of one token without logprobs: ``chunk([out])`` with only its text encoded anew."""
        if self.framing is None:
            head = json.dumps(self.head(True), separators=(",", ":"))[:-1]
            text_key = '"delta":{"content":' if self.chat else '"text":'
            tail = ("}" if self.chat else "") + ',"logprobs":null,"finish_reason":null}]'
            tail += ',"usage":null}' if include_usage else "}"
            self.framing = (f'data: {head},"choices":[{{"index":0,{text_key}'.encode(), (tail + "\n\n").encode())
        return self.framing[0] + json.dumps(out.text).encode() + self.framing[1]

    def usage_chunk(self) -> dict:
        return {**self.head(True), "choices": [], "usage": self.usage()}


def sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
