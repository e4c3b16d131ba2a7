"""``kestrel-stream serve``'s flags: their defaults, help texts and range checks (before the model loads)."""
from __future__ import annotations

from kestrel_stream.serve.limits import Limits, add_limit_args
from kestrel_stream.serve.sampling_defaults import add_sampling_default_args, sampling_defaults_from_args
from kestrel_stream.wire.protocol import MAX_RESPONSE_BYTES

DEFAULT_INLINE_MAX_S = 0.002    # step_thread.DEFAULT_INLINE_MAX_S
DEFAULT_SPIN_US = 300.0
DEFAULT_WINDOW_MS = 1.0         # scheduler.batcher.DEFAULT_WINDOW_S; kept here so `--help` imports no scheduler
DEFAULT_STEP_TOKENS = 256       # scheduler.batcher.DEFAULT_STEP_TOKENS (the host's)
DEVICE_STEP_TOKENS = 2048       # scheduler.batcher.DEVICE_STEP_TOKENS
PROMPT_ORDERS = ("oldest", "shortest")   # scheduler.batcher.PROMPT_ORDERS
DEFAULT_PROMPT_AGE_STEPS = 8    # scheduler.batcher.DEFAULT_PROMPT_AGE_STEPS
MAX_STEP_TOKENS = 65536
DEFAULT_MAX_QUEUE = 256         # generations waiting for a session: 200 requests beyond 64 sessions all wait
MAX_QUEUE = 1 << 20
DEFAULT_PREFIX_SLACK = 4        # scheduler.replica_choice.DEFAULT_PREFIX_SLACK
MAX_PREFIX_SLACK = 1 << 20


def check_serve_args(args) -> None:
    if args.max_sessions < 1 or args.max_batch < 1:
        raise ValueError("--max-sessions and --max-batch must be >= 1")
    sampling_defaults_from_args(args)
    if not 0 <= args.max_queue <= MAX_QUEUE:
        raise ValueError(f"--max-queue must be in 0..{MAX_QUEUE}, got {args.max_queue}")
    if args.step_tokens is not None and not 1 <= args.step_tokens <= MAX_STEP_TOKENS:
        raise ValueError(f"--step-tokens must be in 1..{MAX_STEP_TOKENS}, got {args.step_tokens}")
    if args.prefix_cache_positions is not None and args.prefix_cache_positions < 0:
        raise ValueError(f"--prefix-cache-positions must be >= 0 (got {args.prefix_cache_positions})")
    if not 1 <= args.max_frame_mb <= MAX_RESPONSE_BYTES >> 20:
        raise ValueError(f"--max-frame-mb must be in 1..{MAX_RESPONSE_BYTES >> 20}")
    if args.devices is not None:
        from kestrel_stream.serve.devices import parse_devices
        parse_devices(args.devices)         # the list's own errors; the machine's are serve_devices'
    if not 0 <= args.route_prefix_slack <= MAX_PREFIX_SLACK:
        raise ValueError(f"--route-prefix-slack must be in 0..{MAX_PREFIX_SLACK}, got {args.route_prefix_slack}")
    if not 0 <= args.inline_max_ms <= 1000 or not 0 <= args.spin_us <= 100_000:
        raise ValueError(f"--inline-max-ms must be in 0..1000 (got {args.inline_max_ms}) and --spin-us in "
                         f"0..100000 (got {args.spin_us})")


def add_serve_args(p) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", default=None, help=f"Unix socket path (default: {SOCKET_HELP})")
    where.add_argument("--tcp", default=None, metavar="HOST:PORT", help="listen on TCP (loopback; needs a token)")
    p.add_argument("--token", default=None, help="TCP token; visible to every user in /proc, prefer --token-file "
                                                 "or $KESTREL_TOKEN")
    p.add_argument("--token-file", default=None, help="TCP token file (mode 0600): read if it exists, else a "
                                                      "generated token is written there")
    p.add_argument("--trace-dir", default=None, help="where clients' trace_start files go (default: a private "
                                                     "kestrel-traces dir beside the default socket)")
    p.add_argument("--devices", default=None, metavar="LIST",
                   help="one engine (replica) per device behind the same socket and HTTP front: GPU ordinals "
                        "(0,1) or cpu,cpu; a session stays on its replica, a new one goes to the least loaded "
                        "(default: one engine on --device)")
    p.add_argument("--route-prefix-slack", type=int, default=DEFAULT_PREFIX_SLACK, metavar="N",
                   help="with --devices: a new session goes to a replica caching a longer prefix of its prompt while "
                        "that replica holds at most N more sessions and queued requests than the least loaded one "
                        "(0: the prefix only breaks ties)")
    p.add_argument("--max-sessions", type=int, default=64, help="most sessions open at once (over all replicas)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="generations that wait, first come first served, for a session while --max-sessions are "
                        "held (HTTP ones, and socket opens that ask to wait; one queue for all replicas); one more is "
                        "refused, HTTP 429 (0: no queue)")
    p.add_argument("--prefix-cache-positions", type=int, default=None,
                   help="KV positions of cached prompt prefixes reused across sessions by block hash "
                        "(default 4 x max_seq_len; 0: off)")
    p.add_argument("--max-batch", type=int, default=32, help="most sessions in one decode step (1: no batching)")
    p.add_argument("--batch-window-ms", type=float, default=DEFAULT_WINDOW_MS,
                   help="how long a decode step waits for other sessions' steps")
    p.add_argument("--step-tokens", type=int, default=None,
                   help="token budget of one engine step: every queued session's decode token, then chunks of "
                        "queued prompts up to this many tokens in all; a longer prompt runs over several steps "
                        f"(default: {DEVICE_STEP_TOKENS} on a GPU, {DEFAULT_STEP_TOKENS} on the CPU engine)")
    p.add_argument("--prompt-order", choices=PROMPT_ORDERS, default="oldest",
                   help="which queued prompts a step's budget goes to first: the oldest, or those with the fewest "
                        "tokens left (a short prompt's first token does not wait for a long prompt's chunks; one "
                        f"that has waited {DEFAULT_PROMPT_AGE_STEPS} steps goes first)")
    p.add_argument("--inline-max-ms", type=float, default=DEFAULT_INLINE_MAX_S * 1e3,
                   help="a lone session's decode step runs on the socket reader thread, without a hop to the step "
                        "thread, while its steps take less than this (0: never)")
    p.add_argument("--spin-us", type=float, default=DEFAULT_SPIN_US,
                   help="after such a step the reader polls for the next request this long before it sleeps, "
                        "burning that CPU time so the request finds the core awake (0: sleep at once)")
    p.add_argument("--max-frame-mb", type=int, default=Limits().max_frame_bytes >> 20,
                   help="largest request frame accepted once authenticated (before hello: 4 KiB)")
    add_sampling_default_args(p)
    add_limit_args(p)
    from kestrel_stream.serve.http.options import add_http_args
    add_http_args(p)


SOCKET_HELP = ("$XDG_RUNTIME_DIR/kestrel-stream.sock; without $XDG_RUNTIME_DIR $TMPDIR/kestrel-<uid>/kestrel-stream.sock, "
               "the directory made 0700 and removed at exit when the daemon made it")
