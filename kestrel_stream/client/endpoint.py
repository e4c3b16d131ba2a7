"""Where a client finds the daemon and what it proves there: the address (a Unix socket or tcp://HOST:PORT,
$KESTREL_SOCKET, the default socket) and a TCP connection's token ($KESTREL_TOKEN, the default token
file), for the blocking and the anyio client alike (serve/endpoint.py is the daemon's side).
"""
from __future__ import annotations

from kestrel_stream.options import Environment
from kestrel_stream.wire.protocol import default_socket_path, default_token_path

DEFAULT_TIMEOUT_S = 60.0        # what a client waits on its socket by default (timeout=None: no limit)


def parse_address(address, environment: Environment | None = None) -> tuple[str, object]:
    """("unix", path) or ("tcp", (host, port)) from a path, "unix:PATH" or "tcp://HOST:PORT"; without an
    address, $KESTREL_SOCKET, else the default socket (`environment`: read here when None)."""
    if address is None:
        environment = Environment.from_env() if environment is None else environment
        address = environment.socket or default_socket_path(environment.runtime_dir)
    text = str(address)
    if text.startswith("tcp://") or text.startswith("tcp:"):
        host, _, port = text.split(":", 1)[1].lstrip("/").rpartition(":")
        if not port.isdigit():
            raise ValueError(f"daemon address {text!r}: expected tcp://HOST:PORT")
        return "tcp", (host.strip("[]") or "127.0.0.1", int(port))
    return "unix", text.removeprefix("unix:")


def resolve_token(kind: str, token: str | None, environment: Environment) -> str | None:
    """A TCP connection's token: `token`, else $KESTREL_TOKEN, else the default token file's."""
    if kind != "tcp" or token:
        return token
    if environment.token:
        return environment.token
    path = default_token_path(environment.runtime_dir)
    return path.read_text().strip() if path.exists() else None
