"""The ASGI app (starlette): /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /tokenize and
/detokenize (serve/http/tokens.py), and the chat page at / (chat.html beside this file: one static page that talks
to /v1/chat/completions).

Every request passes serve/http/gate.py's ``Gate`` first (the key, the
concurrency limit, the status counts).  A generation's body is read up to a
byte limit and a time limit (serve/http/bodies.py), then parsed, checked and
tokenized off the event loop (serve/http/prepare.py); only then does it take
a generation slot (serve/http/slots.py).  Every refusal is OpenAI's error shape.
"""
from __future__ import annotations

import time
from contextlib import aclosing
from importlib import resources

import anyio
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kestrel_stream.serve.http.access_log import GENERATION_KEY
from kestrel_stream.serve.http.bodies import BodyReader
from kestrel_stream.serve.http.errors import APIError
from kestrel_stream.serve.http.gate import CLIENT_LEFT, Gate
from kestrel_stream.serve.http.generate import HttpGeneration
from kestrel_stream.serve.http.metrics import Metrics
from kestrel_stream.serve.http.options import HttpOptions
from kestrel_stream.serve.http.prepare import Preparer
from kestrel_stream.serve.http.slots import GenerationSlots
from kestrel_stream.serve.http.tokens import TokenRoutes
from kestrel_stream.serve.http.responses import DONE, Shape, sse
from kestrel_stream.serve.prefix_scopes import scope_name
from kestrel_stream.wire.protocol import UnavailableError


class Gone(Response):
    """The answer to a client that left before it: nothing to send, the connection is closed already."""

    def __init__(self):
        super().__init__(status_code=CLIENT_LEFT)

    async def __call__(self, scope, receive, send) -> None:
        return None


class API:
    def __init__(self, service, model_name: str, max_body_bytes: int, body_timeout_s: float, metrics: Metrics,
                 slots: GenerationSlots, key_scope: str | None = None):
        self.service, self.model_name, self.metrics, self.slots = service, model_name, metrics, slots
        self.bodies = BodyReader(max_body_bytes, body_timeout_s)
        self.preparer = Preparer(service, model_name, self.bodies, key_scope)

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, chat=True)

    async def generate(self, request: Request, chat: bool) -> Response:
        try:
            generation = await self.preparer.generation(await self.bodies.read(request), chat)
            self.slots.take()           # only now: a body still arriving, or a bad one, holds no generation slot
        except APIError as e:
            self.service.freed_pages.give_back_soon()   # what a refused body held (up to --http-max-body-kb)
            return e.response()
        except UnavailableError as e:
            return APIError(500, str(e), type_="server_error", code="tokenizer_unavailable").response()
        request.scope.setdefault("state", {})[GENERATION_KEY] = generation    # for the access log line
        try:
            if not await self.admitted(generation, request.receive):
                await self.release(generation)
                return Gone()
            response = await self.answer(generation, chat, request.receive)
        except APIError as e:
            await self.release(generation)
            return e.response()
        except BaseException:
            await self.release(generation)
            raise
        return self.slots.holding(response, lambda: generation.close())

    async def admitted(self, generation: HttpGeneration, receive) -> bool:
        """The generation's session, after its turn in the admission queue; False when the client left first (it
        then holds no place in the queue).  APIError 429 when the queue is full."""
        left, refusal = False, None
        async with anyio.create_task_group() as group:
            async def watch() -> None:
                nonlocal left
                while (await receive())["type"] != "http.disconnect":
                    pass                            # the body was read whole before: nothing else should come
                left = True
                group.cancel_scope.cancel()
            group.start_soon(watch)
            try:
                await generation.open()
            except APIError as e:
                refusal = e
            finally:
                group.cancel_scope.cancel()
        if refusal is not None:
            raise refusal
        return not left

    async def release(self, generation: HttpGeneration) -> None:
        self.slots.give_back()
        await generation.close()

    async def answer(self, generation: HttpGeneration, chat: bool, receive) -> Response:
        shape = Shape(chat, self.model_name, generation)
        self.metrics.prompt_tokens.inc(generation.prompt_tokens)
        if generation.request.stream:
            return StreamingResponse(self.stream(generation, shape), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        outs = await self.collect(generation, receive)
        if outs is None:
            return Gone()
        if isinstance(outs, APIError):
            return outs.response()
        return JSONResponse(shape.complete(outs))

    async def collect(self, generation: HttpGeneration, receive) -> list | APIError | None:
        """Every token of a whole (not streamed) answer; None when the client left first.

        Nothing is sent until the end, so only the ASGI ``http.disconnect`` tells that the client is gone; it is
        awaited beside the generation, which is then cancelled: its session closes at once (HttpGeneration.run's
        ``finally``) instead of running on to max_tokens for nobody."""
        outs: list = []
        result: list | APIError | None = None
        async with anyio.create_task_group() as group:
            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass                            # the body was read whole before: nothing else should come
                group.cancel_scope.cancel()
            group.start_soon(watch)
            try:
                async with aclosing(generation.run()) as tokens:
                    async for out in tokens:
                        outs.append(out)
                result = outs
            except APIError as e:
                result = e
            finally:
                self.account(generation)
                group.cancel_scope.cancel()         # the watcher, once the answer is whole
        return result

    async def stream(self, generation: HttpGeneration, shape: Shape):
        usage = generation.request.include_usage
        try:
            if shape.chat:
                for choice in generation.choices:
                    yield sse(shape.chunk([], first=True, include_usage=usage, index=choice.index))
            plain = generation.request.logprobs is None
            # closed explicitly when this stream is (a client gone): its session is freed now, not at collection
            async with aclosing(generation.run()) as tokens:
                async for out in tokens:            # a chunk per token, text or not (held back): TTFT is honest
                    yield (shape.token_event(out, usage) if plain and not out.calls else
                           sse(shape.chunk([out], include_usage=usage)))
            for choice in generation.choices:
                yield sse(shape.chunk([], choice.finish_reason, include_usage=usage, index=choice.index))
            if usage:
                yield sse(shape.usage_chunk())
        except APIError as e:
            yield sse(e.body())
        finally:
            self.account(generation)
        yield DONE

    def account(self, generation: HttpGeneration) -> None:
        self.metrics.completion_tokens.inc(generation.completion_tokens)
        if generation.first_token_s is not None:
            self.metrics.ttft.observe(generation.first_token_s)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": int(STARTED_S), "owned_by": "kestrel-stream",
             "max_model_len": self.service.engine.max_seq_len}]})

    async def health(self, request: Request) -> Response:
        if self.service.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def prometheus(self, request: Request) -> Response:
        body, content_type = self.metrics.exposition()
        return Response(body, media_type=content_type)


STARTED_S = time.time()
# the page may reach nothing but this server: inline script and style, requests to its own origin
PAGE_POLICY = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'"


def chat_page():
    page = resources.files(__package__).joinpath("chat.html").read_bytes()

    async def serve_page(request: Request) -> Response:
        return HTMLResponse(page, headers={"Content-Security-Policy": PAGE_POLICY, "Cache-Control": "no-cache"})
    return serve_page


async def not_found(request: Request, exc) -> Response:
    return APIError(404, f"no route {request.method} {request.url.path}", code="not_found").response()


async def wrong_method(request: Request, exc) -> Response:
    return APIError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed").response()


def build_app(service, options: HttpOptions):
    """The ASGI app: starlette routes behind the Gate (and CORS where --http-cors-origin asks for it)."""
    metrics = Metrics(service)
    # one API key today, so its scope is the same for every HTTP request: apart from the socket clients'
    key_scope = scope_name("key", options.api_key or "") if options.prefix_scope == "key" else None
    api = API(service, options.model_name, options.max_body_bytes, options.body_timeout_s, metrics,
              GenerationSlots(options.max_requests), key_scope)
    tokens = TokenRoutes(service, api.bodies, api.preparer.prompt_bounds)
    routes = [Route("/v1/completions", api.completions, methods=["POST"]),
              Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
              Route("/v1/models", api.models, methods=["GET"]),
              Route("/health", api.health, methods=["GET"]),
              Route("/metrics", api.prometheus, methods=["GET"]),
              Route("/tokenize", tokens.tokenize, methods=["POST"]),
              Route("/detokenize", tokens.detokenize, methods=["POST"]),
              Route("/", chat_page(), methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: wrong_method})
    app.router.redirect_slashes = False     # its redirect would build Location from the request's Host header
    gate = Gate(app, options, metrics)
    service.freed_pages.count_busy(lambda: gate.handling)      # no idle collection while a body is read or parsed
    if not options.cors_origins:
        return gate
    # outside the Gate: a browser's preflight carries no key, and its answer gives nothing away
    return CORSMiddleware(gate, allow_origins=list(options.cors_origins), allow_methods=["GET", "POST"],
                          allow_headers=["Authorization", "Content-Type"])
