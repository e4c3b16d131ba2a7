"""What every HTTP request passes first (ASGI middleware): the bearer key, the two concurrency limits, and the
per-status request counts of /metrics.

The key is compared in constant time.  ``--http-max-concurrent`` bounds the
requests being handled at once, whatever their path, those whose bodies are
still arriving included (503); ``--http-max-requests`` bounds the generations
among them (429).  Both refusals carry Retry-After, which the openai client
honours when it retries.  A request holds its places until its whole
response, stream included, has been sent or abandoned.
"""
from __future__ import annotations

import hmac

from kestrel_stream.serve.http.errors import RETRY_AFTER_S, APIError
from kestrel_stream.serve.http.metrics import Metrics
from kestrel_stream.serve.http.options import HttpOptions

GENERATING = ("/v1/completions", "/v1/chat/completions")
OPEN_PATHS = ("/health", "/")      # answered without the key and the limits: a load balancer's probe, the chat
                                    # page (static; it asks for the key and sends it with its API calls)
KNOWN_PATHS = GENERATING + ("/v1/models", "/health", "/metrics", "/")
CLIENT_LEFT = 499           # the status /metrics counts for a client that left before its answer (as nginx logs it)


class Gate:
    def __init__(self, app, options: HttpOptions, metrics: Metrics):
        self.app, self.options, self.metrics = app, options, metrics
        self.api_key = options.api_key.encode() if options.api_key else None
        self.handling = 0           # requests past the gate, /health excepted
        self.running = 0            # of which generations

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, counted, left = scope["path"], [False], [False]

        def count(status: int) -> None:
            counted[0] = True
            self.metrics.requests.labels(path if path in KNOWN_PATHS else "other", str(status)).inc()

        async def send_counted(message):
            if message["type"] == "http.response.start":
                count(message["status"])        # before the client can see it: a scrape after agrees with it
            await send(message)

        async def receive_noted():
            message = await receive()
            left[0] = left[0] or message["type"] == "http.disconnect"
            return message
        try:
            refusal = self.refusal(scope, path)
            if refusal is not None:
                return await refusal.response()(scope, receive_noted, send_counted)
            if path in OPEN_PATHS:
                return await self.app(scope, receive_noted, send_counted)
            generating = path in GENERATING
            self.handling += 1
            self.running += generating
            try:
                await self.app(scope, receive_noted, send_counted)
            finally:
                self.handling -= 1
                self.running -= generating
        finally:
            if not counted[0]:
                count(CLIENT_LEFT if left[0] else 500)

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
        limit = self.options.max_requests
        if path in GENERATING and self.running >= limit:
            return APIError(429, f"{self.running} generations are running, the limit "
                                 f"(--http-max-requests {limit}); retry later", "rate_limit_error",
                            code="too_many_requests", retry_after_s=RETRY_AFTER_S)
        return None
