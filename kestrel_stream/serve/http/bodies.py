"""Request bodies: read on the event loop as the chunks that come, bounded in bytes and in time; decoded and parsed
as JSON on a worker thread.

The loop does no more per chunk than keep it: no buffer is grown and copied
there (a 4 MB body grown a chunk at a time is tens of megabytes of copying),
and the text and its JSON are made off the loop.  Decoding goes a chunk at a
time and parsing a large body walks its containers (wire/json_limits.py), so
no single call holds the interpreter for long: the loop, waiting for it after
reading or answering a socket, gets it back within the switch interval
(serve/daemon.py sets a short one).  Large bodies are handled one at a time on
a thread of their own, so they neither crowd out small requests nor hold more
than one large body's objects at once; what they held is given back to the
system when they are done.
"""
from __future__ import annotations

import codecs
from typing import Callable, TypeVar

import anyio
from starlette.requests import ClientDisconnect, Request

from kestrel_stream.serve.http.errors import APIError
from kestrel_stream.serve.memory import release_freed_memory
from kestrel_stream.wire.json_limits import JSONLimitError, load_limited, load_walked

LARGE_BODY_BYTES = 256 << 10        # from here a body is parsed walking its lists, on the large bodies' thread

T = TypeVar("T")


class Body:
    """The chunks of one request body, as they came; ``text()`` (worker thread) turns them into one string."""

    def __init__(self):
        self.parts: list[bytes] = []
        self.size = 0                   # bytes

    def add(self, part: bytes) -> None:
        self.parts.append(part)
        self.size += len(part)

    @property
    def large(self) -> bool:
        return self.size >= LARGE_BODY_BYTES

    def text(self) -> str:
        """The body as text, its chunks let go of as they are decoded; APIError 400 when it is not UTF-8."""
        decoder = codecs.getincrementaldecoder("utf-8")()
        pieces, fed = [], 0             # fed: the bytes given to the decoder so far
        try:
            for i, part in enumerate(self.parts + [b""]):
                start = fed - len(decoder.getstate()[0])    # where the bytes it decodes now begin
                pieces.append(decoder.decode(part, final=i == len(self.parts)))
                if i < len(self.parts):
                    self.parts[i] = b""
                fed += len(part)
        except UnicodeDecodeError as e:
            raise APIError(400, f"the request body is not UTF-8: byte {e.object[e.start]:#04x} at byte "
                                f"{start + e.start} ({e.reason})", code="invalid_json") from None
        finally:
            self.parts.clear()
        return "".join(pieces)

    def json(self, max_items: int | None = None):
        """The body's JSON value (worker thread); APIError 400 invalid_json for a body that is not UTF-8 JSON within
        json_limits' limits.  max_items: the most items a list may hold, a longer one raised as the JSONLimitError
        that names its key (``where``), for the caller to answer."""
        text = self.text()
        try:
            if len(text) >= LARGE_BODY_BYTES:
                return load_walked(text, len(text), max_items=max_items)
            return load_limited(text, max_chars=len(text))
        except JSONLimitError as e:
            if e.where is not None:
                raise
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


class BodyReader:
    def __init__(self, max_body_bytes: int, body_timeout_s: float):
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s
        self.large_bodies = anyio.CapacityLimiter(1)

    async def read(self, request: Request) -> Body:
        """The whole body (loop); APIError 413 over --http-max-body-kb, 408 past --http-body-timeout-s, 400 when the
        client closed the request first."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self.too_large()
        body = Body()
        try:
            with anyio.fail_after(self.body_timeout_s):     # a body trickling in holds a place of the Gate
                async for part in request.stream():
                    body.add(part)
                    if body.size > self.max_body_bytes:
                        raise self.too_large()
        except ClientDisconnect:
            raise APIError(400, "the client closed the request before its body ended") from None
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive whole within {self.body_timeout_s:g} s "
                                f"(--http-body-timeout-s)", code="request_timeout") from None
        return body

    def too_large(self) -> APIError:
        return APIError(413, f"the request body is over {self.max_body_bytes} bytes (--http-max-body-kb)",
                        code="request_too_large")

    async def off_loop(self, body: Body, work: Callable[..., T], *args) -> T:
        """``work(*args)`` on a worker thread, where it may take ``body`` apart: a large body's on the large bodies'
        thread, after which its memory goes back to the system."""
        if not body.large:
            return await anyio.to_thread.run_sync(work, *args)
        try:
            return await anyio.to_thread.run_sync(work, *args, limiter=self.large_bodies)
        except APIError as e:
            refusal = e.with_traceback(None)    # its frames (and its context's) held the body's text and objects
            refusal.__context__ = None
        finally:                    # its text and parsed objects are gone: give their pages back to the system
            await anyio.to_thread.run_sync(release_freed_memory, limiter=self.large_bodies)
        raise refusal
