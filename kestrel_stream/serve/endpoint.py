"""Where the daemon listens and what it trusts: the Unix socket's path and mode, the TCP token.

The socket path is refused if it is anything but a stale socket, or if its
directory is a symlink; the token is never generated onto the command line
(``--token`` still works, with a warning: /proc/PID/cmdline is readable by
every user).
"""
from __future__ import annotations

import errno
import os
import secrets
import socket
import stat
import sys
from contextlib import contextmanager
from pathlib import Path

from kestrel_stream.wire.protocol import DaemonError, check_private


def log(message: str) -> None:
    """The daemon's log line (stderr)."""
    print(f"kestrel-stream serve: {message}", file=sys.stderr, flush=True)


@contextmanager
def private_umask():
    old = os.umask(0o177)           # the socket is born 0600, no window where others could connect
    try:
        yield
    finally:
        os.umask(old)


def check_address_free(flag: str, host: str, port: int) -> None:
    """DaemonError naming the flag when ``host:port`` cannot be listened on (in use, or not an address of this
    machine): checked before the model loads, so a busy port costs a line, not a load.  Port 0 is always free."""
    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise DaemonError(f"{flag} {host}:{port}: {host!r} does not resolve ({e.strerror})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as the listener will: TIME_WAIT is free
        try:
            probe.bind(address)
        except OSError as e:
            why = ("is in use by another process; stop it or choose another port" if e.errno == errno.EADDRINUSE
                   else f"cannot be listened on ({e.strerror})")
            raise DaemonError(f"{flag} {host}:{port}: the address {why}") from None


def check_listen_addresses(args) -> None:
    """--http and --tcp, each checked with check_address_free (their syntax was checked before)."""
    for flag, value, default_host in (("--http", args.http, None), ("--tcp", args.tcp, "127.0.0.1")):
        if not value:
            continue
        host, _, port = value.rpartition(":")
        host = host.strip("[]") or default_host
        if host and port.isdigit():
            check_address_free(flag, host, int(port))


def prepare_socket_path(path: Path) -> None:
    """Refuse a path that is anything but a stale socket, or whose directory is a symlink; unlink a stale one."""
    parent = path.parent if str(path.parent) else Path(".")
    if parent.is_symlink():
        raise DaemonError(f"--socket {path}: its directory {parent} is a symlink; give the real directory")
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise DaemonError(f"--socket {path}: exists and is not a socket; the daemon does not replace it")
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()               # a stale socket left by a killed daemon
        return
    finally:
        probe.close()
    raise DaemonError(f"{path}: another daemon is already listening there")


def load_token(args, token_path: Path, env_token: str | None) -> str:
    """--token, else $KESTREL_TOKEN (`env_token`), else the token file's (kept private), else a new one written there.

    ``--token`` still works, but every user can read it in /proc/PID/cmdline."""
    if args.token:
        log("WARNING: --token is visible to every user in /proc/<pid>/cmdline; use --token-file or $KESTREL_TOKEN")
        return args.token
    if env_token:
        return env_token
    if args.token_file and token_path.exists():
        check_private(token_path, f"--token-file {token_path}", "0600")
        token = token_path.read_text().strip()
        if not token:
            raise ValueError(f"--token-file {token_path} is empty")
        log(f"token read from {token_path}")
        return token
    token = secrets.token_hex(32)
    token_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with private_umask():
        fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(token_path, 0o600)
    log(f"token written to {token_path} (mode 0600)")
    return token
