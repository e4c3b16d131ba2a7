"""What every HTTP request passes first (ASGI middleware): the bearer key, the concurrency limit, and the
per-status request counts of /metrics.

The key is compared in constant time.  ``--http-max-concurrent`` bounds the
requests being handled at once, whatever their path, those whose bodies are
still arriving included (503, with Retry-After, which the openai client
honours when it retries).  A request holds its place until its whole
response, stream included, has been sent or abandoned.  The generations
among them are bounded once their bodies are whole (serve/http/slots.py).
"""
from __future__ import annotations

import hmac

import anyio

from kestrel_stream.serve.http.errors import RETRY_AFTER_S, APIError
from kestrel_stream.serve.http.metrics import Metrics
from kestrel_stream.serve.http.options import HttpOptions

GENERATING = ("/v1/completions", "/v1/chat/completions")
OPEN_PATHS = ("/health",)           # answered without the key and the limits: a load balancer's probe
KNOWN_PATHS = GENERATING + ("/v1/models", "/health", "/metrics")
CLIENT_LEFT = 499           # the status /metrics counts for a client that left before its answer (as nginx logs it)


class Gate:
    def __init__(self, app, options: HttpOptions, metrics: Metrics):
        self.app, self.options, self.metrics = app, options, metrics
        self.api_key = options.api_key.encode() if options.api_key else None
        self.handling = 0           # requests past the gate, /health excepted

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, counted, left = scope["path"], [False], [False]
        body_done = [scope.get("http_version") != "2"]     # see drain_body

        def count(status: int) -> None:
            counted[0] = True
            self.metrics.requests.labels(path if path in KNOWN_PATHS else "other", str(status)).inc()

        async def send_counted(message):
            if message["type"] == "http.response.start":
                if not body_done[0]:
                    await self.drain_body(receive_noted, body_done)
                count(message["status"])        # before the client can see it: a scrape after agrees with it
            await send(message)

        async def receive_noted():
            message = await receive()
            left[0] = left[0] or message["type"] == "http.disconnect"
            body_done[0] = body_done[0] or left[0] or not message.get("more_body", False)
            return message
        try:
            refusal = self.refusal(scope, path)
            if refusal is not None:
                return await refusal.response()(scope, receive_noted, send_counted)
            if path in OPEN_PATHS:
                return await self.app(scope, receive_noted, send_counted)
            self.handling += 1
            try:
                await self.app(scope, receive_noted, send_counted)
            finally:
                self.handling -= 1
        finally:
            if not counted[0]:
                count(CLIENT_LEFT if left[0] else 500)

    async def drain_body(self, receive, body_done: list) -> None:
        """HTTP/2: read (and drop) the rest of a request body before answering without it (a refusal).

        hypercorn's HTTP/2 protocol closes the whole connection, every stream
        of the client's with it, on a DATA frame for a stream whose answer
        already ended; so a refused stream stays open until its body has come,
        within the body limits."""
        seen = 0
        with anyio.move_on_after(self.options.body_timeout_s):
            while not body_done[0] and seen <= self.options.max_body_bytes:
                seen += len((await receive()).get("body", b""))

    def refusal(self, scope, path: str) -> APIError | None:
        if path in OPEN_PATHS:
            return None
        if self.api_key is not None:
            offered = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    offered = value
            scheme, _, key = offered.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.api_key):
                return APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                                "authentication_error", code="invalid_api_key")
        limit = self.options.max_concurrent
        if self.handling >= limit:
            return APIError(503, f"{self.handling} HTTP requests are being handled, the limit "
                                 f"(--http-max-concurrent {limit}); retry later", "server_error",
                            code="server_overloaded", retry_after_s=RETRY_AFTER_S)
        return None
