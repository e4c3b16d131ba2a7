"""``serve --http``'s flags: where to listen, the API key, and what one HTTP client may hold, checked before the
model loads (the style of serve/limits.py: parsed once, passed down as ``HttpOptions``).

The API key is required for a bind beyond loopback; like the TCP token it is
read from --api-key-file or $KESTREL_API_KEY rather than the command line.
Without a key, requests must name this server in their Host header (the
bound address, localhost, or a name of --http-allowed-host), so that a web
page the user visits cannot reach the API through a DNS name it controls.
"""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from kestrel_stream.serve.endpoint import log

# a request's method as sent, before hypercorn upper-cases it (server.py writes it, gate.py reads it)
METHOD_AS_SENT = b"kestrel-method-as-sent"

LOOPBACK_NAMES = ("localhost",)
DEFAULT_MAX_BODY_KB = 4096
DEFAULT_MAX_CONCURRENT = 256        # as --max-connections of the socket transports
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_HEADER_TIMEOUT_S = 5.0      # hypercorn's keep-alive timeout, which is also the headers' time
MAX_COUNT = 1 << 20
PREFIX_SCOPES = ("shared", "key")


@dataclass(frozen=True)
class HttpOptions:
    host: str
    port: int
    api_key: str | None
    max_requests: int | None    # generations running or queued at once, one more answered 429 (None: as admitted)
    max_body_bytes: int
    model_name: str | None      # None: the model's directory or file name
    max_concurrent: int = DEFAULT_MAX_CONCURRENT    # requests being handled, any path; one more is answered 503
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # a request body must arrive whole this fast, else 408
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # a connection without a whole request's headers this long
    allowed_hosts: tuple[str, ...] = ()     # Host names accepted besides the bound address and loopback's
    cors_origins: tuple[str, ...] = ()      # origins a browser may call the API from (none: CORS off)
    prefix_scope: str = "shared"            # "key": HTTP requests reuse only prefixes cached under their API key
    access_log: bool = True                 # a line per request on stderr (serve/http/access_log.py)


def add_http_args(p) -> None:
    p.add_argument("--http", default=None, metavar="HOST:PORT",
                   help="also serve the OpenAI-compatible HTTP API there (loopback unless --api-key is set)")
    p.add_argument("--api-key", default=None, help="HTTP bearer key; visible in /proc, prefer --api-key-file or "
                                                   "$KESTREL_API_KEY; required for a non-loopback --http")
    p.add_argument("--api-key-file", default=None, help="file holding the HTTP bearer key (mode 0600)")
    p.add_argument("--http-max-requests", type=int, default=None,
                   help="HTTP generations running or waiting for a session at once, one more gets 429 "
                        "(default: no bound of its own; --max-sessions + --max-queue bound them)")
    p.add_argument("--http-max-concurrent", type=int, default=DEFAULT_MAX_CONCURRENT,
                   help="HTTP requests being handled at once, of any path and bodies still arriving included; "
                        "one more gets 503 (/health excepted)")
    p.add_argument("--http-body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help="a request body that has not arrived whole within this long gets 408")
    p.add_argument("--http-max-body-kb", type=int, default=DEFAULT_MAX_BODY_KB,
                   help="largest HTTP request body of a generation; a larger one gets 413 (other routes take none)")
    p.add_argument("--http-header-timeout-s", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="an HTTP connection whose request headers have not arrived whole within this long "
                        "(an idle keep-alive connection too) is closed")
    p.add_argument("--http-allowed-host", action="append", default=[], metavar="NAME",
                   help="without an API key, a Host name accepted besides the bound address, localhost, 127.0.0.1 "
                        "and ::1 (others get 421); repeatable")
    p.add_argument("--prefix-cache-scope", choices=PREFIX_SCOPES, default="shared",
                   help="shared: every client reuses every cached prompt prefix; key: HTTP requests reuse only "
                        "prefixes cached by requests with their API key (socket clients keep theirs apart); a "
                        "request's cache_salt narrows either to requests with the same salt")
    p.add_argument("--http-cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="an origin (scheme://host[:port]) whose web pages may call the API; repeatable "
                        "(default: none, CORS off)")
    p.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="no line per HTTP request on stderr (method, path, status, tokens, queue wait, time to first "
                        "token, duration)")
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
    max_requests = args.http_max_requests
    checks = (("--http-max-requests", 1 if max_requests is None else max_requests, 1, MAX_COUNT),
              ("--http-max-concurrent", args.http_max_concurrent, 1, MAX_COUNT),
              ("--http-body-timeout-s", args.http_body_timeout_s, 0.001, 3600),
              ("--http-header-timeout-s", args.http_header_timeout_s, 0.001, 3600),
              ("--http-max-body-kb", args.http_max_body_kb, 1, MAX_COUNT))
    for flag, value, low, high in checks:
        if not low <= value <= high:
            raise ValueError(f"{flag} must be in {low}..{high}, got {value}")
    for origin in args.http_cors_origin:
        scheme, sep, rest = origin.partition("://")
        if scheme not in ("http", "https") or not sep or not rest or "/" in rest:
            raise ValueError(f"--http-cors-origin {origin!r}: expected scheme://host[:port], e.g. "
                             f"http://localhost:3000")
    for name in args.http_allowed_host:
        if not name or any(c in name for c in "/ :@"):
            raise ValueError(f"--http-allowed-host {name!r}: expected a host name, e.g. myhost.local")
    name = args.served_model_name or Path(str(args.model).rstrip("/")).name or str(args.model)
    return HttpOptions(host, int(port), key, max_requests, args.http_max_body_kb << 10, name,
                       args.http_max_concurrent, args.http_body_timeout_s, args.http_header_timeout_s,
                       tuple(n.lower() for n in args.http_allowed_host), tuple(args.http_cors_origin),
                       args.prefix_cache_scope, args.access_log)


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
    return args.environment.api_key         # $KESTREL_API_KEY, read once by the CLI (options.Environment)
