"""OpenAI's response bodies: completion and chat completion objects, their stream chunks, logprobs, usage; a
request of n choices answers each under its ``index``.  A chat message's tool calls go in ``tool_calls``
(its content null when it holds no other text); streamed, each call is one delta carrying the whole call,
under the call's ``index`` within its choice."""
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
        self.text_offsets: dict[int, int] = {}              # choice -> characters of text sent before
        self.framing: dict[int, tuple[bytes, bytes]] = {}  # choice -> token_event's bytes around the text
        self.calls_sent: dict[int, int] = {}                # choice -> tool calls streamed before

    def head(self, stream: bool) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def usage(self) -> dict:
        g = self.generation
        return {"prompt_tokens": g.prompt_tokens, "completion_tokens": g.completion_tokens,
                "total_tokens": g.prompt_tokens + g.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": g.cached_tokens}}

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
            offsets.append(self.text_offsets.get(o.index, 0))
            self.text_offsets[o.index] = offsets[-1] + len(o.text)
        # a dict by token text: where two tokens read the same (e.g. partial UTF-8), the likelier one stays
        return {"tokens": tokens, "token_logprobs": [o.logprob for o in outs],
                "top_logprobs": [{text(t): lp for t, lp in reversed(o.top)} for o in outs], "text_offset": offsets}

    # -- whole responses -------------------------------------------------------
    def complete(self, outs) -> dict:
        choices = []
        for one in self.generation.choices:
            mine = [o for o in outs if o.index == one.index]
            text, reason = "".join(o.text for o in mine), one.finish_reason
            if self.chat:
                message = {"role": "assistant", "content": text, "refusal": None}
                calls = [call.as_openai() for o in mine for call in o.calls]
                if calls:
                    message.update(content=text if text.strip() else None, tool_calls=calls)
                choices.append({"index": one.index, "message": message, "logprobs": self.chat_logprobs(mine),
                                "finish_reason": reason})
            else:
                choices.append({"index": one.index, "text": text, "logprobs": self.completion_logprobs(mine),
                                "finish_reason": reason})
        return {**self.head(False), "choices": choices, "usage": self.usage()}

    # -- stream chunks ---------------------------------------------------------
    def chunk(self, outs, finish_reason: str | None = None, first: bool = False, include_usage: bool = False,
              index: int = 0) -> dict:
        """A chunk of choice ``index`` (that of ``outs``, when given)."""
        text = "".join(o.text for o in outs)
        index = outs[0].index if outs else index
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if outs else {})
            calls = [call for o in outs for call in o.calls]
            if calls:
                sent = self.calls_sent.get(index, 0)
                self.calls_sent[index] = sent + len(calls)
                delta = {"content": text or None,
                         "tool_calls": [{"index": sent + k, **call.as_openai()} for k, call in enumerate(calls)]}
            choice = {"index": index, "delta": delta, "logprobs": self.chat_logprobs(outs) if outs else None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": self.completion_logprobs(outs) if outs else None,
                      "finish_reason": finish_reason}
        body = {**self.head(True), "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return body

    def token_event(self, out, include_usage: bool) -> bytes:
        """The SSE event of one token without logprobs: ``chunk([out])`` with only its text encoded anew."""
        framing = self.framing.get(out.index)
        if framing is None:
            head = json.dumps(self.head(True), separators=(",", ":"))[:-1]
            text_key = '"delta":{"content":' if self.chat else '"text":'
            tail = ("}" if self.chat else "") + ',"logprobs":null,"finish_reason":null}]'
            tail += ',"usage":null}' if include_usage else "}"
            framing = self.framing[out.index] = (f'data: {head},"choices":[{{"index":{out.index},{text_key}'.encode(),
                                                 (tail + "\n\n").encode())
        return framing[0] + json.dumps(out.text).encode() + framing[1]

    def usage_chunk(self) -> dict:
        return {**self.head(True), "choices": [], "usage": self.usage()}


def sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
