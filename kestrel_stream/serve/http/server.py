"""``serve --http HOST:PORT``: hypercorn serving the ASGI app inside the daemon's own event loop.

hypercorn runs on the loop the daemon already runs (asyncio, under anyio), so
HTTP handlers await the same step jobs as socket connections.  Its sockets
are bound here (port 0 picks a free one, logged), and it stops on the
daemon's shutdown event instead of installing signal handlers of its own.
Its flags are serve/http/options.py's.  Some of its habits are changed here,
once, before it serves: a connection its client closed is let go at once and
the keep-alive timer stops in two loop turns, not five (close_sockets_at_eof),
and a request's method reaches the app as it was sent (keep_methods_as_sent).
On the loop, a connection cancelled at shutdown closes without a traceback in
the log on Pythons before 3.12 too (quiet_cancelled_connections).
"""
from __future__ import annotations

import asyncio

import anyio

from kestrel_stream.serve.endpoint import log
from kestrel_stream.serve.http.options import METHOD_AS_SENT, HttpOptions, http_options

GRACEFUL_TIMEOUT_S = 5.0
_closing_at_eof = False
_keeping_methods = False


class HttpServer:
    """hypercorn on the daemon's loop: ``run`` in the daemon's task group, ``stop`` before the daemon's shutdown
    (hypercorn must finish its own graceful stop before the task group is cancelled)."""

    def __init__(self, options: HttpOptions):
        self.options = options
        self.stopping, self.stopped = anyio.Event(), anyio.Event()
        self.bound: tuple | None = None         # the listening socket's address, once bound

    async def run(self, service, task_status) -> None:
        """Serve until ``stop``; task_status.started() once listening."""
        from hypercorn.asyncio.run import worker_serve
        from hypercorn.config import Config
        from hypercorn.utils import wrap_app

        from kestrel_stream.serve.http.app import build_app
        close_sockets_at_eof()
        keep_methods_as_sent()
        quiet_cancelled_connections(asyncio.get_running_loop())
        options = self.options
        config = Config()
        config.bind = [f"[{options.host}]:{options.port}" if ":" in options.host
                       else f"{options.host}:{options.port}"]
        config.accesslog = None
        config.errorlog = None                  # the daemon logs its own lines
        config.graceful_timeout = GRACEFUL_TIMEOUT_S
        config.h11_max_incomplete_size = 64 * 1024
        config.keep_alive_timeout = options.header_timeout_s      # idle, or headers still arriving
        try:
            sockets = config.create_sockets()
            for sock in sockets.insecure_sockets:      # listening before the line that says so is logged
                sock.listen(config.backlog)
            bound = self.bound = sockets.insecure_sockets[0].getsockname()
            app = build_app(service, options)
            where = f"[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"{bound[0]}:{bound[1]}"
            log(f"http listening on http://{where}/v1 (model {options.model_name!r}"
                f"{', API key required' if options.api_key else ''}; "
                f"{options.max_requests if options.max_requests is not None else 'admitted'} generations, "
                f"{options.max_concurrent} requests at once)")
            task_status.started()
            await worker_serve(wrap_app(app, config.wsgi_max_body_size, "asgi"), config, sockets=sockets,
                               shutdown_trigger=self.stopping.wait)
        finally:
            self.stopped.set()

    async def stop(self) -> None:
        """Stop accepting, let running responses end (at most GRACEFUL_TIMEOUT_S), then return."""
        self.stopping.set()
        with anyio.move_on_after(GRACEFUL_TIMEOUT_S + 1.0):
            await self.stopped.wait()


def quiet_cancelled_connections(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio before 3.12 (CPython gh-113538): the done-callback StreamReaderProtocol puts on a connection's
    task calls task.exception(), which raises CancelledError when the task was cancelled (hypercorn cancels its
    connections' tasks when it stops), and the loop logs "Exception in callback" with a traceback, between the
    daemon's SIGTERM lines.  Later Pythons log nothing there (the connection's own finally has closed its
    writer); this exception handler drops that callback's CancelledError alone and hands every other context
    to the handler there was before."""
    previous = loop.get_exception_handler()
    if getattr(previous, "quiets_cancelled_connections", False):
        return

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        handle = context.get("handle")
        if (isinstance(context.get("exception"), asyncio.CancelledError)
                and "StreamReaderProtocol.connection_made" in repr(handle)):
            return                      # hypercorn's connection closed its writer in its own finally
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)
    handler.quiets_cancelled_connections = True
    loop.set_exception_handler(handler)


def close_sockets_at_eof() -> None:
    """hypercorn (0.18) keeps a connection's socket after its client closed it until the connection's keep-alive
    timer (--http-header-timeout-s) runs out, so quick connections pile up descriptors (2,000 of them held 2,000
    fds for 5 s).  Once its reading side has ended a connection has nothing to keep alive: the timer is stopped
    there, and the connection closes as soon as its requests have ended."""
    global _closing_at_eof
    if _closing_at_eof:
        return
    from hypercorn.asyncio.tcp_server import TCPServer
    read_data = TCPServer._read_data

    async def read_data_then_stop_the_timer(self) -> None:
        await read_data(self)
        await self.idle_task.stop()

    async def idle_timeout_in_its_own_task(self) -> None:
        """hypercorn's timer waits in asyncio.wait_for, which runs the wait in a second task: each request on a
        kept-alive connection stops the timer and awaits it, and the cancellation took five turns of the event
        loop through the two tasks, the request waiting behind all else the loop had to do meanwhile (a /health
        on a busy daemon: tens of milliseconds).  The same wait in the timer's own task takes two."""
        with anyio.move_on_after(self.config.keep_alive_timeout):
            await self.context.terminated.wait()
        await asyncio.shield(self._initiate_server_close())
    TCPServer._read_data = read_data_then_stop_the_timer
    TCPServer._idle_timeout = idle_timeout_in_its_own_task
    _closing_at_eof = True


def keep_methods_as_sent() -> None:
    """hypercorn (0.18) upper-cases a request's method before the app sees it, so "get" and "Post" were answered
    as GET and POST, although methods are case-sensitive (RFC 9110, 9.1).  The method as the client sent it rides
    along, on HTTP/1.1 and HTTP/2 alike, in a header of this server's (one the client sent under that name is
    dropped) for the Gate to check."""
    global _keeping_methods
    if _keeping_methods:
        return
    import h11
    from hypercorn.protocol.h11 import H11Protocol
    from hypercorn.protocol.h2 import H2Protocol
    h11_create_stream, h2_create_stream = H11Protocol._create_stream, H2Protocol._create_stream

    def with_method_as_sent(headers, method: bytes) -> list:
        return [(name, value) for name, value in headers if name.lower() != METHOD_AS_SENT] + [(METHOD_AS_SENT, method)]

    async def h11_create_stream_keeping_the_method(self, request: h11.Request) -> None:
        await h11_create_stream(self, h11.Request(method=request.method, target=request.target,
                                                  headers=with_method_as_sent(request.headers, request.method),
                                                  http_version=request.http_version))

    async def h2_create_stream_keeping_the_method(self, request) -> None:
        method = next((value for name, value in request.headers if name == b":method"), b"")
        request.headers = with_method_as_sent(request.headers, method)
        await h2_create_stream(self, request)
    H11Protocol._create_stream = h11_create_stream_keeping_the_method
    H2Protocol._create_stream = h2_create_stream_keeping_the_method
    _keeping_methods = True


def http_server(args) -> HttpServer | None:
    options = http_options(args)
    return HttpServer(options) if options is not None else None
