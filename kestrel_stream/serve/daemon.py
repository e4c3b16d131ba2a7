"""``kestrel-stream serve``: the daemon that owns the model and answers clients over a socket.

Transport: a Unix socket (mode 0600, in a per-user runtime dir by default) or
TCP on loopback, where the first frame must carry the token.  Each connection
is answered in order, one request at a time (peer.py reads and writes its
bytes; one reader thread reads every Unix socket, socket_reader.py); decode
steps of different connections meet in the batcher on the step thread
(service.py, step_thread.py).  SIGINT/SIGTERM stop new work, let
in-flight steps finish, tell every client, and exit 0.  What one client may
hold (connections, bytes, time, sessions) is bounded by serve/limits.py, and
whatever goes wrong inside one connection ends that connection, never the
daemon; endpoint.py guards the socket path and the token.

One concern, the daemon's lifetime: the replicas loaded, the service and its batchers built from the
flags, the socket listened on until a signal, and everything released at exit; what happens on each
connection, from accept to its last answer and the shutdown notice, is connections.py's Daemon.
"""
from __future__ import annotations

import contextlib
import signal
import sys
from functools import partial
from pathlib import Path

import anyio

from kestrel_stream.serve.connections import Daemon
from kestrel_stream.serve.endpoint import log, load_token, prepare_socket_path, private_umask
from kestrel_stream.serve.flags import check_serve_args
from kestrel_stream.serve.limits import limits_from_args
from kestrel_stream.serve.memory import freeze_loaded_objects, map_large_buffers
from kestrel_stream.serve.sampling_defaults import (model_sampling_defaults, sampling_defaults_from_args,
                                                    with_model_defaults)
from kestrel_stream.serve.socket_reader import SocketReader
from kestrel_stream.wire.protocol import default_socket_path, default_token_path, make_runtime_dir

# The event loop lets go of the interpreter lock in every socket call and epoll wait.  While a worker thread runs
# Python (a large body parsed, a prompt rendered, a step's host work), the loop gets it back only once that thread
# is asked to let go, after the switch interval (5 ms by default), and it pays that at every such call: a small
# request behind a few busy connections waited tens of milliseconds.
LOOP_SWITCH_INTERVAL_S = 0.0005


async def serve(engines, args, environment, devices: list[str] | None = None) -> int:
    """Serve the engines (one replica each, on ``devices``) until SIGINT/SIGTERM."""
    from scheduler.batcher import StepBatcher, default_step_tokens
    from kestrel_stream.serve.service import Service
    from kestrel_stream.serve.traces import DaemonTraces, prepare_trace_dir
    from kestrel_stream.serve.http.server import http_server
    http = http_server(args)
    limits = limits_from_args(args)
    uses_runtime_dir = not args.trace_dir or not (args.socket or args.tcp)
    made_dir = make_runtime_dir(environment.runtime_dir) if uses_runtime_dir else None     # removed at exit, once empty
    traces = DaemonTraces(prepare_trace_dir(args.trace_dir, environment.runtime_dir), limits.trace_max_events)
    engine = engines[0]
    sampling_defaults = with_model_defaults(sampling_defaults_from_args(args),
                                            model_sampling_defaults(engine.weights.source))
    if sampling_defaults.given():
        log("requests that set none get " + ", ".join(f"{k} {v:g}" for k, v in sampling_defaults.given().items()))
    step_tokens = args.step_tokens or default_step_tokens(on_device=engine.device == "cuda")
    batchers = [StepBatcher(max_batch=args.max_batch, window_s=args.batch_window_ms / 1e3, step_tokens=step_tokens,
                            prompt_order=args.prompt_order) for _ in engines]   # each replica forms its own steps
    service = Service(engines, args.max_sessions, batchers, inline_max_s=args.inline_max_ms / 1e3,
                      sessions_per_client=limits.sessions_per_client, traces=traces, max_queue=args.max_queue,
                      sampling_defaults=sampling_defaults, devices=devices, prefix_slack=args.route_prefix_slack)
    socket_path = None
    if args.tcp:
        host, _, port = args.tcp.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        if host not in ("127.0.0.1", "localhost", "::1"):
            log(f"WARNING: listening on {host}, which is not loopback; anyone with the token can connect")
        token_path = Path(args.token_file) if args.token_file else default_token_path(environment.runtime_dir)
        daemon = Daemon(engine, service, load_token(args, token_path, environment.token), limits)
        listener = await anyio.create_tcp_listener(local_host=host, local_port=int(port))
        bound = listener.listeners[0].extra(anyio.abc.SocketAttribute.local_address)
        where = f"tcp:{bound[0]}:{bound[1]} (token required)"
    else:
        socket_path = Path(args.socket) if args.socket else default_socket_path(environment.runtime_dir)
        prepare_socket_path(socket_path)
        with private_umask():
            listener = await anyio.create_unix_listener(socket_path, mode=0o600)
        daemon = Daemon(engine, service, None, limits)
        daemon.reader = SocketReader()
        if args.spin_us > 0:
            for replica in service.replicas:
                replica.steps.after_inline = partial(daemon.reader.spin_for, args.spin_us / 1e6)
        where = f"unix:{socket_path} (mode 0600)"
    if len(engines) > 1:
        log(f"{len(engines)} replicas ({', '.join(replica.device for replica in service.replicas)}): a session "
            f"stays on its replica; a new one goes to the least loaded, or to one caching a longer prefix of its "
            f"prompt up to {args.route_prefix_slack} sessions busier (--route-prefix-slack)")
    log(f"max {args.max_sessions} sessions ({limits.sessions_per_client} per client; {args.max_queue} HTTP "
        f"generations may wait for one), steps of up to "
        f"{args.max_batch} sessions and {step_tokens} tokens within {args.batch_window_ms} ms"
        f"{' on each replica' if len(engines) > 1 else ''}; "
        f"max {limits.max_connections} connections "
        f"({limits.max_unauthenticated} before hello); traces in {traces.directory}")
    map_large_buffers()
    sys.setswitchinterval(LOOP_SWITCH_INTERVAL_S)
    log(f"listening on {where}")
    try:
        async with anyio.create_task_group() as tg:
            daemon.spawn = tg.start_soon
            if http is not None:        # the OpenAI-compatible API on the same service (serve/http/)
                await tg.start(http.run, service)
            freeze_loaded_objects()     # the model, the modules and both servers: no full collection walks them
            for one in getattr(listener, "listeners", [listener]):     # TCP may listen on IPv4 and IPv6
                tg.start_soon(daemon.accept_forever, one, tg)
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    if http is not None:        # no new generations; running HTTP responses end first
                        service.start_draining()
                        await http.stop()
                    await daemon.shutdown(tg.cancel_scope, signal.Signals(signum).name)
                    break
    finally:
        with anyio.CancelScope(shield=True):
            await listener.aclose()
        if socket_path is not None:
            socket_path.unlink(missing_ok=True)
        if made_dir is not None:
            with contextlib.suppress(OSError):      # not empty: traces were written, or something else put a file there
                if traces.directory.parent == made_dir:
                    traces.directory.rmdir()
                made_dir.rmdir()
        service.stop()                      # waits for a step still running (a drain that timed out)
        if daemon.reader is not None:
            daemon.reader.stop()
    log("stopped")
    return 0


def run_daemon(args, environment) -> int:
    """Load the model (one engine per device of --devices, else one), log what was loaded, and serve until
    SIGINT/SIGTERM.

    environment: the process's Environment (socket directory, token), read by the CLI."""
    from kestrel_stream.api import load
    from kestrel_stream.serve.devices import load_replicas, make_ready, serve_devices
    check_serve_args(args)
    devices = serve_devices(args)           # bad --devices fail before anything loads
    from kestrel_stream.serve.http.server import http_options
    http_options(args)                      # bad --http flags fail before the model loads
    if getattr(args, "trace", None):          # `serve --trace FILE`: the CLI stops and writes it at exit
        from kestrel_stream.obs import trace
        trace.start(args.trace, command="serve")

    def load_one(device: str):
        return load(args.model, device=device, mode=args.mode, vram_budget=args.vram_budget,
                    max_seq_len=args.max_seq_len, max_batch=args.max_batch, max_sessions=args.max_sessions,
                    cache=not args.no_cache, kv_dtype=args.kv_dtype, cpu_threads=args.cpu_threads,
                    draft=args.model_draft, spec=args.spec, draft_max=args.draft_max, spec_policy=args.spec_policy)
    engines = load_replicas(load_one, devices or [args.device], args.devices)
    try:
        engine = engines[0]
        engine.build_tokenizer_in_background()   # while the daemon starts: the first text request rarely waits
        prefix_positions = (4 * engine.max_seq_len if args.prefix_cache_positions is None
                            else args.prefix_cache_positions)
        cfg = engine.config
        log(f"model {args.model}: {cfg.arch}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
            f"vocab {cfg.vocab_size}; device {engine.device}, mode {engine.mode}, max_seq_len {engine.max_seq_len}")
        make_ready(engines, devices, prefix_positions, log)
        return anyio.run(serve, engines, args, environment, devices)
    finally:
        for engine in engines:
            engine.close()
