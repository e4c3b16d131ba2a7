"""Generation slots (--http-max-requests): a request takes one only once its body has arrived whole and been
checked, and holds it until its response, stream included, has been sent or abandoned.

So a client that opens requests and sends their bodies slowly (or never)
holds no slot: it meets the body timeout and --http-max-concurrent, while
well-formed generations keep being served.
"""
from __future__ import annotations

from typing import Awaitable, Callable

from starlette.responses import Response

from kestrel_stream.serve.http.errors import RETRY_AFTER_S, APIError


class GenerationSlots:
    def __init__(self, limit: int | None):
        """limit: None for none of its own (the admission queue bounds the generations held)."""
        self.limit = limit
        self.running = 0

    def take(self) -> None:
        """One slot, or APIError 429 (with Retry-After) when all are taken."""
        if self.limit is not None and self.running >= self.limit:
            raise APIError(429, f"{self.running} generations are running, the limit (--http-max-requests "
                                f"{self.limit}); retry later", "rate_limit_error", code="too_many_requests",
                           retry_after_s=RETRY_AFTER_S)
        self.running += 1

    def give_back(self) -> None:
        self.running -= 1

    def holding(self, response: Response, release: Callable[[], Awaitable[None]]) -> Response:
        """``response``, which gives the slot back, and awaits ``release`` (the generation's session freed, shielded),
        once it has been sent or abandoned."""
        return Holding(response, self, release)


class Holding(Response):
    def __init__(self, response: Response, slots: GenerationSlots, release: Callable[[], Awaitable[None]]):
        self.response, self.slots, self.release = response, slots, release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.slots.give_back()
            await self.release()
