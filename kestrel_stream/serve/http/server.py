"""``serve --http HOST:PORT``: hypercorn serving the ASGI app inside the daemon's own event loop.

hypercorn runs on the loop the daemon already runs (asyncio, under anyio), so
HTTP handlers await the same step jobs as socket connections.  Its sockets
are bound here (port 0 picks a free one, logged), and it stops on the
daemon's shutdown event instead of installing signal handlers of its own.
Its flags are serve/http/options.py's.
"""
from __future__ import annotations

import anyio

from kestrel_stream.serve.endpoint import log
from kestrel_stream.serve.http.options import HttpOptions, http_options

GRACEFUL_TIMEOUT_S = 5.0
_closing_at_eof = False


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
    TCPServer._read_data = read_data_then_stop_the_timer
    _closing_at_eof = True


def http_server(args) -> HttpServer | None:
    options = http_options(args)
    return HttpServer(options) if options is not None else None
