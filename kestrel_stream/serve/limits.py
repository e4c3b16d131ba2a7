"""What one client may hold of the daemon: connections, bytes, time, sessions, traces.

Parsed once from ``serve`` flags (``add_limit_args``/``limits_from_args``) and
passed down; every limit a client meets is answered with an error frame that
names the flag, then (for connection-level limits) that connection closes.
Before a connection has said hello it gets much less: small frames, a short
time to say it, and a cap of its own on how many such connections are open.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_connections: int = 256              # open connections, authenticated or not
    max_unauthenticated: int = 32           # of those, connections that have not said hello yet
    hello_timeout_s: float = 10.0           # a new connection must say hello this fast
    # an authenticated connection with no request this long ends, its sessions freed (0: never); on by default so
    # that clients that vanish without a FIN (a host gone, a NAT that forgot them) do not hold sessions for good
    idle_timeout_s: float = 600.0
    max_frame_bytes: int = 16 << 20         # one request frame, once authenticated
    hello_frame_bytes: int = 4096           # one frame before hello (the hello itself is ~100 bytes)
    max_buffered_bytes: int = 64 << 20      # read ahead of one connection's coroutine before reading pauses
    write_timeout_s: float = 30.0           # an answer must leave this fast, or the client that does not read ends
    sessions_per_client: int | None = None  # sessions one connection may hold (None: --max-sessions)
    trace_max_events: int = 200_000         # a client's trace stops recording past this many events
    accept_pause_s: float = 0.1             # out of file descriptors: stop accepting this long, keep serving

    def frame_bytes(self, authenticated: bool) -> int:
        return self.max_frame_bytes if authenticated else self.hello_frame_bytes

    def header_bytes(self, authenticated: bool, max_header_bytes: int) -> int:
        return max_header_bytes if authenticated else min(max_header_bytes, self.hello_frame_bytes)


def add_limit_args(p) -> None:
    d = Limits()
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections; one more is refused with a capacity error")
    p.add_argument("--max-unauthenticated", type=int, default=d.max_unauthenticated,
                   help="connections that have not said hello yet")
    p.add_argument("--hello-timeout-s", type=float, default=d.hello_timeout_s,
                   help="a new connection that sends no hello this long is closed")
    p.add_argument("--idle-timeout-s", type=float, default=d.idle_timeout_s,
                   help="an authenticated connection that sends nothing this long is closed and its sessions freed "
                        "(0: never)")
    p.add_argument("--max-buffered-mb", type=int, default=d.max_buffered_bytes >> 20,
                   help="bytes read ahead of one connection before the daemon stops reading it")
    p.add_argument("--write-timeout-s", type=float, default=d.write_timeout_s,
                   help="a client that does not read an answer within this long is disconnected")
    p.add_argument("--max-sessions-per-client", type=int, default=None,
                   help="sessions one connection may hold (default: --max-sessions)")
    p.add_argument("--trace-max-events", type=int, default=d.trace_max_events,
                   help="a client's trace stops recording after this many events")


def limits_from_args(args) -> Limits:
    """The flags as Limits; ValueError naming the flag for a value out of range."""
    checks = (("--max-connections", args.max_connections, 1, 1 << 20),
              ("--max-unauthenticated", args.max_unauthenticated, 1, 1 << 20),
              ("--hello-timeout-s", args.hello_timeout_s, 0.001, 3600),
              ("--idle-timeout-s", args.idle_timeout_s, 0, 1e9),
              ("--max-buffered-mb", args.max_buffered_mb, 1, 1 << 16),
              ("--write-timeout-s", args.write_timeout_s, 0.001, 3600),
              ("--trace-max-events", args.trace_max_events, 1, 1 << 31))
    for flag, value, low, high in checks:
        if not low <= value <= high:
            raise ValueError(f"{flag} must be in {low}..{high}, got {value}")
    per_client = args.max_sessions_per_client
    if per_client is not None and not 1 <= per_client <= args.max_sessions:
        raise ValueError(f"--max-sessions-per-client must be in 1..--max-sessions ({args.max_sessions}), "
                         f"got {per_client}")
    return Limits(max_connections=args.max_connections, max_unauthenticated=args.max_unauthenticated,
                  hello_timeout_s=args.hello_timeout_s, idle_timeout_s=args.idle_timeout_s,
                  max_frame_bytes=args.max_frame_mb << 20, max_buffered_bytes=args.max_buffered_mb << 20,
                  write_timeout_s=args.write_timeout_s, sessions_per_client=per_client or args.max_sessions,
                  trace_max_events=args.trace_max_events)
