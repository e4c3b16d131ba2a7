"""What a decode step through any socket server costs on this machine: the floor under the daemon's overhead.

    python3 -m bench.daemon_floor [--preset tiny] [--rounds 100] [--out DIR] [--label NAME]

One client (``ks.Client``, as in bench.daemon_latency) takes turns, in blocks
of back-to-back calls, between the same decode in process, in process after
the thread slept SLEEP_US (untimed: what a server's step thread does between
requests, ``inproc-slept``), and through:
- ``echo``: a server process that sends each frame straight back (bare round trip);
- ``spin``: the same after busy-waiting the in-process step's median time
  (the round trip when the client sleeps through a step);
- ``engine``: a minimal server speaking the daemon's protocol, one blocking
  thread that reads a frame, runs the decode and writes the answer;
- ``engine-hop``: the same, with the decode run and answered on a second
  thread (the hop the daemon makes so its loop keeps reading);
- ``engine-loop``: the same again, with frames read by a callback of an
  asyncio event loop (as the daemon reads a Unix socket);
- ``daemon``: ``kestrel-stream serve``;
- ``daemon@LABEL`` (``--daemon LABEL=DIR``, repeatable): the same served from
  another source tree (e.g. a worktree of an earlier commit), so that builds
  are compared within one run of one machine.
The minimal servers handle one client and only what this bench sends.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import kestrel_stream as ks  # noqa: E402
from kestrel_stream.cli.bench import environment  # noqa: E402
from kestrel_stream.loading.presets import ensure_preset  # noqa: E402
from kestrel_stream.wire.protocol import PREFIX_BYTES, encode_frame, parse_body, parse_prefix  # noqa: E402

from .daemon_latency import BLOCK, BLOCK_WARMUP, PROMPT, parse_daemon_sources, start_daemon  # noqa: E402
from .daemons import stop_daemon  # noqa: E402
from .report import write_results  # noqa: E402

MAX_SEQ_LEN = 256
KINDS = ("echo", "spin", "engine", "engine-hop", "engine-loop")
SLEEP_US = 300


# -- the minimal servers (run as `python3 -m bench.daemon_floor --serve KIND SOCKET MODEL SPIN_US`) ---------
def serve(kind: str, path: str, model: str, spin_us: float) -> None:
    engine = ks.load(model, device="cpu", mode="cpu", max_seq_len=MAX_SEQ_LEN) if kind.startswith("engine") else None
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path + ".tmp")
    listener.listen()
    os.rename(path + ".tmp", path)
    conn, _ = listener.accept()
    buffer, sessions, steps = bytearray(), {}, queue.SimpleQueue()

    def decode(header: dict) -> None:
        session = sessions[header["session"]]
        answer = {"id": header["id"], "ok": True}
        if header.get("want") == "token":
            answer["token"], arrays = int(engine.decode_batch([(session, header["token"])], greedy=True)[0]), None
        else:
            arrays = {"logits": engine.decode_batch([(session, header["token"])])[0]}
        conn.sendall(encode_frame({**answer, "position": session.position}, arrays))

    def step_thread() -> None:
        while True:
            decode(steps.get())

    def on_data(data: bytes) -> None:
        nonlocal buffer
        buffer += data
        while len(buffer) >= PREFIX_BYTES:
            header_bytes, payload_bytes = parse_prefix(bytes(buffer[:PREFIX_BYTES]), 1 << 24)
            end = PREFIX_BYTES + header_bytes + payload_bytes
            if len(buffer) < end:
                break
            frame = parse_body(bytes(buffer[PREFIX_BYTES:PREFIX_BYTES + header_bytes]), bytes(buffer[PREFIX_BYTES + header_bytes:end]))
            del buffer[:end]
            header, op = frame.header, frame.header["op"]
            if op == "decode":
                steps.put(header) if kind != "engine" else decode(header)
                continue
            answer = {"id": header.get("id"), "ok": True}
            if op == "hello":
                answer.update(v=1, vocab_size=engine.config.vocab_size, max_seq_len=MAX_SEQ_LEN, device="cpu", mode="cpu")
            elif op == "open":
                session = engine.new_session()
                sessions[session.id] = session
                answer.update(session=session.id, max_seq_len=MAX_SEQ_LEN)
            elif op == "prefill":
                session = sessions[header["session"]]
                answer.update(token=int(np.argmax(session.prefill(frame.arrays["ids"])[-1])), position=session.position)
            elif op == "reset":
                sessions[header["session"]].reset()
                answer.update(position=0)
            elif op == "close":
                sessions.pop(header["session"]).close()
            conn.sendall(encode_frame(answer))

    threading.Thread(target=step_thread, daemon=True).start()
    if kind == "engine-loop":
        asyncio.run(read_in_loop(conn, on_data))
        return
    while data := conn.recv(65536):
        if kind in ("echo", "spin"):
            end = time.perf_counter() + (spin_us if kind == "spin" else 0) / 1e6
            while time.perf_counter() < end:
                pass
            conn.sendall(data)
        else:
            on_data(data)


async def read_in_loop(conn: socket.socket, on_data) -> None:
    loop = asyncio.get_running_loop()
    closed = loop.create_future()
    conn.setblocking(False)

    def on_readable() -> None:
        try:
            data = conn.recv(65536)
        except BlockingIOError:
            return
        if not data:
            loop.remove_reader(conn.fileno())
            closed.set_result(None)
            return
        conn.setblocking(True)          # this bench's answers are small: written whole
        on_data(data)
        conn.setblocking(False)

    loop.add_reader(conn.fileno(), on_readable)
    await closed


def start_server(kind: str, path: Path, model, spin_us: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "bench.daemon_floor", "--serve", kind, str(path), str(model),
                             str(spin_us)])
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} server exited {proc.returncode}")
        time.sleep(0.02)
    return proc


# -- the client ------------------------------------------------------------------------------
def measure(args, model, tmp: Path) -> list[dict]:
    engine = ks.load(model, device="cpu", mode="cpu", max_seq_len=MAX_SEQ_LEN)
    local = engine.new_session()
    local.prefill(PROMPT)
    inproc_us = []
    for i in range(200):
        if local.position + 1 >= MAX_SEQ_LEN:
            local.reset()
            local.prefill(PROMPT)
        started = time.perf_counter()
        local.decode(i % 200 + 1)
        inproc_us.append((time.perf_counter() - started) * 1e6)
    spin_us = statistics.median(inproc_us[20:])
    procs = {kind: start_server(kind, tmp / f"{kind}.sock", model, spin_us) for kind in KINDS}
    args.client_counts = [1]
    daemons = {"daemon": None, **{f"daemon@{label}": source for label, source in args.daemons}}
    for kind, source in daemons.items():
        procs[kind] = start_daemon(model, args, tmp / f"{kind}.sock", max_batch=32, source=source)
    sockets, remotes = {}, {}
    try:
        for kind in ("echo", "spin"):
            sockets[kind] = socket.socket(socket.AF_UNIX)
            sockets[kind].connect(str(tmp / f"{kind}.sock"))
        clients = {kind: ks.Client(str(tmp / f"{kind}.sock")) for kind in ("engine", "engine-hop", "engine-loop", *daemons)}
        remotes = {kind: client.new_session() for kind, client in clients.items()}
        request = encode_frame({"op": "decode", "id": 1, "session": 1, "token": 1, "want": "token"})
        scratch = bytearray(65536)

        def call(kind: str, token: int) -> None:
            if kind.startswith("inproc"):
                session, restart = local, lambda: (local.reset(), local.prefill(PROMPT))
            elif kind in sockets:
                sockets[kind].sendall(request)
                sockets[kind].recv_into(scratch)
                return
            else:
                session = remotes[kind]
                restart = lambda: (session.reset(), session.prefill(PROMPT, want="token"))  # noqa: E731
            if session.position + 1 >= MAX_SEQ_LEN:
                restart()
            if kind.startswith("inproc"):
                session.decode(token)
            else:
                session.decode(token, want=("logits", "token")[token % 2])

        kinds = ["inproc", "inproc-slept", *KINDS, *daemons]
        samples_us = {kind: [] for kind in kinds}
        for round_index in range(args.rounds):
            for kind in kinds[round_index % len(kinds):] + kinds[:round_index % len(kinds)]:
                for i in range(BLOCK):
                    if kind == "inproc-slept":
                        time.sleep(SLEEP_US / 1e6)
                    started = time.perf_counter()
                    call(kind, (round_index * BLOCK + i) % 200 + 1)
                    if round_index and i >= BLOCK_WARMUP:
                        samples_us[kind].append((time.perf_counter() - started) * 1e6)
        for client in clients.values():
            client.close()
    finally:
        for sock in sockets.values():
            sock.close()
        for kind, proc in procs.items():
            if kind.startswith("daemon"):
                stop_daemon(proc)
            else:
                proc.wait(30)
        local.close()
        engine.close()
    inproc = statistics.median(samples_us["inproc"])
    rows = []
    for kind in kinds:
        median = statistics.median(samples_us[kind])
        baseline = {"inproc": median, "echo": 0.0, "spin": spin_us}.get(kind, inproc)
        rows.append({"path": kind, "median_us": round(median, 1), "overhead_us": round(median - baseline, 1),
                     "p90_us": round(float(np.percentile(samples_us[kind], 90)), 1)})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rounds", type=int, default=100, help="rounds of one block of calls per path")
    parser.add_argument("--out", default=None)
    parser.add_argument("--label", default="")
    parser.add_argument("--daemon", action="append", default=[], metavar="LABEL=DIR", dest="daemon_sources",
                        help="also measure the daemon served from source tree DIR, as path daemon@LABEL")
    parser.add_argument("--serve", nargs=4, metavar=("KIND", "SOCKET", "MODEL", "SPIN_US"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        kind, path, model, spin_us = args.serve
        serve(kind, path, model, float(spin_us))
        return
    model = ensure_preset(args.preset)
    args.daemons = parse_daemon_sources(parser, args.daemon_sources)
    args.device, args.mode, args.max_seq_len = "cpu", "cpu", MAX_SEQ_LEN
    with tempfile.TemporaryDirectory(prefix="kestrel-floor-") as tmp:
        rows = measure(args, model, Path(tmp))
    name = f"daemon-floor-{args.preset}-cpu" + (f"-{args.label}" if args.label else "")
    path = write_results(name, environment(), rows, ["path", "median_us", "overhead_us", "p90_us"], out_dir=args.out,
                         notes=f"Unix sockets; OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}; "
                               f"{os.cpu_count()} cores. Paths take turns in blocks of {BLOCK} calls, "
                               f"{args.rounds} rounds, medians without the first round and the first "
                               f"{BLOCK_WARMUP} calls of each block. inproc-slept: the in-process decode "
                               f"right after a {SLEEP_US} us sleep. overhead_us: against the in-process "
                               f"decode (engine paths, daemon, inproc-slept), the spin time (spin), zero "
                               f"(echo). Decodes "
                               f"alternate want=logits and want=token, as in bench.daemon_latency.")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
