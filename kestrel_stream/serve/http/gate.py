"""What every HTTP request passes first (ASGI middleware): the Host check, the bearer key, the request's shape
(its method as sent, case and all; POST bodies are JSON; other routes take no body), the concurrency limit, and
the per-status request counts of /metrics.

Without an API key the server is on loopback, where a web page the user
visits could still reach it: by DNS rebinding (a name of the page's that
resolves to 127.0.0.1, sent as Host: answered 421 unless it names this
server) or by a cross-site form post (its body is never application/json:
415).  Browsers send neither an Authorization header nor a JSON content type
across sites without a CORS preflight, which the API answers only for
--http-cors-origin origins.

The key is compared in constant time.  ``--http-max-concurrent`` bounds the
requests being handled at once, whatever their path, those whose bodies are
still arriving included (503, with Retry-After, which the openai client
honours when it retries).  A request holds its place until its whole
response, stream included, has been sent or abandoned.  The generations
among them are bounded once their bodies are whole (serve/http/slots.py).
"""
from __future__ import annotations

import hmac
import time

import anyio

from kestrel_stream.serve.http.access_log import write_access_line

from kestrel_stream.serve.http.errors import RETRY_AFTER_S, APIError
from kestrel_stream.serve.http.metrics import Metrics
from kestrel_stream.serve.http.options import METHOD_AS_SENT, HttpOptions, is_loopback

GENERATING = ("/v1/completions", "/v1/chat/completions")
OPEN_PATHS = ("/health", "/")      # answered without the key and the limits: a load balancer's probe, the chat
                                    # page (static; it asks for the key and sends it with its API calls)
KNOWN_PATHS = GENERATING + ("/v1/models", "/health", "/metrics", "/tokenize", "/detokenize", "/")
CLIENT_LEFT = 499           # the status /metrics counts for a client that left before its answer (as nginx logs it)


class Gate:
    def __init__(self, app, options: HttpOptions, metrics: Metrics):
        self.app, self.options, self.metrics = app, options, metrics
        self.api_key = options.api_key.encode() if options.api_key else None
        self.handling = 0           # requests past the gate, /health excepted
        bound = options.host.lower().strip("[]")
        # None: any Host (an API key guards the server instead)
        self.hosts = None if self.api_key is not None else {"localhost", bound, *options.allowed_hosts}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, counted, left = scope["path"], [False], [False]
        body_done = [scope.get("http_version") != "2"]     # see drain_body
        started_s, status_sent = time.perf_counter(), [CLIENT_LEFT]

        def count(status: int) -> None:
            counted[0] = True
            status_sent[0] = status
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
            if self.options.access_log:
                write_access_line(scope, status_sent[0], time.perf_counter() - started_s)

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
        headers = dict(scope["headers"])        # a repeated name: its last value
        sent = headers.get(METHOD_AS_SENT)
        if sent is not None and sent.decode("latin-1") != scope["method"]:
            return APIError(501, f"method {sent.decode('latin-1')[:20]!r} is not implemented: methods are "
                                 f"case-sensitive (GET, POST)", code="method_not_implemented")
        if self.hosts is not None:
            host = headers.get(b"host", headers.get(b":authority"))
            if host is not None and not self.known_host(host):
                return APIError(421, f"Host {host.decode('latin-1')[:100]!r} does not name this server; without an "
                                     f"API key only its address, localhost and --http-allowed-host names are "
                                     f"answered", code="misdirected_request")
        if path in OPEN_PATHS:
            return None
        if self.api_key is not None:
            scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.api_key):
                return APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                                "authentication_error", code="invalid_api_key")
        if scope["method"] == "POST":
            media_type = headers.get(b"content-type", b"").partition(b";")[0].strip().lower()
            if media_type != b"application/json":
                return APIError(415, f"Content-Type must be application/json, got "
                                     f"{media_type.decode('latin-1')[:100]!r}", code="unsupported_media_type")
        elif headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers:
            return APIError(413, f"{scope['method']} {path} takes no request body", code="request_too_large")
        limit = self.options.max_concurrent
        if self.handling >= limit:
            return APIError(503, f"{self.handling} HTTP requests are being handled, the limit "
                                 f"(--http-max-concurrent {limit}); retry later", "server_error",
                            code="server_overloaded", retry_after_s=RETRY_AFTER_S)
        return None

    def known_host(self, host: bytes) -> bool:
        """Whether a Host header (name or address, with or without a port) names this server."""
        text = host.decode("latin-1").strip().lower()
        name = text[1:text.find("]")] if text.startswith("[") else text.rpartition(":")[0] if ":" in text else text
        name = name.rstrip(".")
        return name in self.hosts or is_loopback(name)
