"""``serve --http HOST:PORT``: hypercorn serving the ASGI app inside the daemon's own event loop.

hypercorn runs on the loop the daemon already runs (asyncio, under anyio), so
HTTP handlers await the same step jobs as socket connections.  Its sockets
are bound here (port 0 picks a free one, logged), and it stops on the
daemon's shutdown event instead of installing signal handlers of its own.
The API key is required for a bind beyond loopback; like the TCP token it is
read from --api-key-file or $KESTREL_API_KEY rather than the command line.
"""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import anyio

from kestrel_stream.serve.endpoint import log

LOOPBACK_NAMES = ("localhost",)
DEFAULT_MAX_BODY_KB = 4096
GRACEFUL_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class HttpOptions:
    host: str
    port: int
    api_key: str | None
    max_requests: int           # generations running at once; one more is answered 429
    max_body_bytes: int
    model_name: str | None      # None: the model's directory or file name


def add_http_args(p) -> None:
    p.add_argument("--http", default=None, metavar="HOST:PORT",
                   help="also serve the OpenAI-compatible HTTP API there (loopback unless --api-key is set)")
    p.add_argument("--api-key", default=None, help="HTTP bearer key; visible in /proc, prefer --api-key-file or "
                                                   "$KESTREL_API_KEY; required for a non-loopback --http")
    p.add_argument("--api-key-file", default=None, help="file holding the HTTP bearer key (mode 0600)")
    p.add_argument("--http-max-requests", type=int, default=None,
                   help="HTTP generations running at once, one more gets 429 (default: --max-sessions)")
    p.add_argument("--http-max-body-kb", type=int, default=DEFAULT_MAX_BODY_KB,
                   help="largest HTTP request body; a larger one gets 413")
    p.add_argument("--served-model-name", default=None,
                   help="the model id of /v1/models and the 'model' field requests must name "
                        "(default: the model path's last component)")


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def http_options(args) -> HttpOptions | None:
    """The --http flags, checked (before the model loads); None without --http."""
    if not args.http:
        return None
    host, sep, port = args.http.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--http {args.http!r}: expected HOST:PORT, e.g. 127.0.0.1:8080")
    key = read_api_key(args)
    if not is_loopback(host) and not key:
        raise ValueError(f"--http {args.http}: a non-loopback address needs an API key "
                         f"(--api-key-file, $KESTREL_API_KEY or --api-key)")
    max_requests = args.http_max_requests or args.max_sessions
    if not 1 <= max_requests <= 1 << 20:
        raise ValueError(f"--http-max-requests must be in 1..{1 << 20}, got {max_requests}")
    if not 1 <= args.http_max_body_kb <= 1 << 20:
        raise ValueError(f"--http-max-body-kb must be in 1..{1 << 20}, got {args.http_max_body_kb}")
    name = args.served_model_name or Path(str(args.model).rstrip("/")).name or str(args.model)
    return HttpOptions(host, int(port), key, max_requests, args.http_max_body_kb << 10, name)


def read_api_key(args) -> str | None:
    if args.api_key:
        log("WARNING: --api-key is visible to every user in /proc/<pid>/cmdline; use --api-key-file or "
            "$KESTREL_API_KEY")
        return args.api_key
    if args.api_key_file:
        path = Path(args.api_key_file)
        info = path.stat()
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise PermissionError(f"--api-key-file {path}: must be owned by uid {os.getuid()} with mode 0600 "
                                  f"(it is uid {info.st_uid}, mode {info.st_mode & 0o777:o})")
        key = path.read_text().strip()
        if not key:
            raise ValueError(f"--api-key-file {path} is empty")
        return key
    return os.environ.get("KESTREL_API_KEY") or None


class HttpServer:
    """hypercorn on the daemon's loop: ``run`` in the daemon's task group, ``stop`` before the daemon's shutdown
    (hypercorn must finish its own graceful stop before the task group is cancelled)."""

    def __init__(self, options: HttpOptions):
        self.options = options
        self.stopping, self.stopped = anyio.Event(), anyio.Event()

    async def run(self, service, task_status) -> None:
        """Serve until ``stop``; task_status.started() once listening."""
        from hypercorn.asyncio.run import worker_serve
        from hypercorn.config import Config
        from hypercorn.utils import wrap_app

        from kestrel_stream.serve.http.app import build_app
        options = self.options
        config = Config()
        config.bind = [f"[{options.host}]:{options.port}" if ":" in options.host
                       else f"{options.host}:{options.port}"]
        config.accesslog = None
        config.errorlog = None                  # the daemon logs its own lines
        config.graceful_timeout = GRACEFUL_TIMEOUT_S
        config.h11_max_incomplete_size = 64 * 1024
        try:
            sockets = config.create_sockets()
            bound = sockets.insecure_sockets[0].getsockname()
            app = build_app(service, options.model_name, options.api_key, options.max_requests,
                            options.max_body_bytes)
            where = f"[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"{bound[0]}:{bound[1]}"
            log(f"http listening on http://{where}/v1 (model {options.model_name!r}"
                f"{', API key required' if options.api_key else ''}; {options.max_requests} generations at once)")
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


def http_server(args) -> HttpServer | None:
    options = http_options(args)
    return HttpServer(options) if options is not None else None
