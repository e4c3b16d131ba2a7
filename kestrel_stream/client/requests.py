"""The session operations as the clients send them and their answers as the clients return them: each
request's (op, header fields, arrays), an answer checked and shaped (logits, a token, TopK, Generated),
for the blocking and the anyio client alike.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kestrel_stream.errors import InvalidTokenError
from kestrel_stream.wire.protocol import Frame, ShuttingDownError, error_from_code


class TopK(NamedTuple):
    ids: np.ndarray          # int32 [k], best first
    logits: np.ndarray       # float32 [k]


def check_response(frame: Frame, request_id: int):
    """The response's (header, arrays), or the daemon's error raised as its typed exception."""
    header = frame.header
    if header.get("op") == "shutdown":
        raise ShuttingDownError(header.get("message", "daemon shutting down"))
    if header.get("id") not in (request_id, None):
        raise ConnectionError(f"daemon answered request {header.get('id')!r}, expected {request_id}")
    if not header.get("ok"):
        raise error_from_code(str(header.get("code")), str(header.get("message")))
    return header, frame.arrays


def want_fields(want: str, k: int) -> dict:
    if want not in ("logits", "last", "token", "topk"):
        raise ValueError(f"want must be 'logits', 'last', 'token' or 'topk', got {want!r}")
    return {"want": want, "k": int(k)} if want == "topk" else {"want": want}


def shaped(want: str, header: dict, arrays: dict):
    if want == "token":
        return header["token"]
    if want == "topk":
        return TopK(arrays["topk_ids"], arrays["topk_logits"])
    return arrays["logits"]


def ids_array(ids, op: str) -> np.ndarray:
    """Token ids as int64 for the wire; non-integers are refused here, as Session.prefill refuses them."""
    arr = np.asarray(ids)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidTokenError(f"{op}: token ids must be integers, got {arr.dtype}")
    return (arr.reshape(1) if arr.ndim == 0 else arr).astype(np.int64, copy=False)


class Requests:
    """What every session operation sends: (op, header fields, arrays)."""

    @staticmethod
    def prefill(sid, ids, want, k):
        return "prefill", {"session": sid, **want_fields(want, k)}, {"ids": ids_array(ids, "prefill")}

    @staticmethod
    def decode(sid, token, want, k):
        token = int(token) if isinstance(token, (int, np.integer)) else token
        return "decode", {"session": sid, "token": token, **want_fields(want, k)}, {}

    @staticmethod
    def generate(sid, prompt, n, options: dict | None = None, stream: bool = False):
        """prompt: text (the daemon's tokenizer encodes it), chat messages ([{"role", "content"}, ...], rendered
        with the daemon's chat template) or token ids; options: sampling and stop fields."""
        fields = {"session": sid, "n": int(n), **{k: v for k, v in (options or {}).items() if v is not None}}
        if stream:
            fields["stream"] = True
        if isinstance(prompt, str):
            return "generate", {**fields, "prompt": prompt}, {}
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            return "generate", {**fields, "messages": [dict(m) for m in prompt]}, {}
        return "generate", fields, {"ids": ids_array(prompt, "generate")}


def open_fields(max_seq_len: int | None, wait: bool) -> dict:
    return {"max_seq_len": max_seq_len, **({"wait": True} if wait else {})}


def generate_options(temperature=None, top_k=None, top_p=None, min_p=None, repeat_penalty=None,
                     presence_penalty=None, frequency_penalty=None, seed=None, stop=None, ignore_eos=None,
                     speculative=None) -> dict:
    """The generate request's optional fields; None: the daemon's default (Engine.generate's; speculative:
    where the daemon has a draft; False opts out, {"draft_max": N} caps the chains)."""
    if isinstance(stop, str):
        stop = [stop]
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
            "repeat_penalty": repeat_penalty, "presence_penalty": presence_penalty,
            "frequency_penalty": frequency_penalty, "seed": seed, "stop": stop, "ignore_eos": ignore_eos,
            "speculative": speculative}


class Piece(NamedTuple):
    """One streamed token and the text it released ("" while text is held back), as Engine.generate's."""
    token: int
    text: str


class Generated(list):
    """A generation's tokens (a list, as the greedy generate always returned) with .tokens, .text
    (None when the daemon's model has no tokenizer), .stop_reason ("eos", "stop" or "length"), .speculation
    (the generation's acceptance, tokens per pass and draft length; None where it did not speculate)."""

    def __init__(self, header: dict, arrays: dict):
        super().__init__(arrays["tokens"].tolist())
        self.text, self.stop_reason = header.get("text"), header.get("stop_reason")
        self.position = header.get("position")
        self.speculation = header.get("speculation")

    @property
    def tokens(self) -> list[int]:
        return list(self)
