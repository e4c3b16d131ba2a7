"""Start a real ``kestrel-stream serve`` process for tests and talk raw frames to it."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kestrel_stream.wire import protocol as wire

def decode_frame(data: bytes, max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES) -> wire.Frame:
    """A whole frame from bytes (the daemon and clients read prefix, header, payload in turn)."""
    header_bytes, payload_bytes = wire.parse_prefix(data[:wire.PREFIX_BYTES], max_frame_bytes)
    if len(data) != wire.PREFIX_BYTES + header_bytes + payload_bytes:
        raise wire.ProtocolError(f"frame: prefix announces {wire.PREFIX_BYTES + header_bytes + payload_bytes} "
                                 f"bytes, got {len(data)}", fatal=True)
    head_end = wire.PREFIX_BYTES + header_bytes
    return wire.parse_body(data[wire.PREFIX_BYTES:head_end], data[head_end:])


ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


class DaemonProcess:
    def __init__(self, model, log_path: Path, *flags: str, env: dict | None = None, preexec_fn=None):
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "kestrel_stream", "serve", "--model", str(model),
                                      "--device", "cpu", *flags], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env or ENV, preexec_fn=preexec_fn)
        self.address = self.wait_for_listen_line()

    @classmethod
    def on_socket(cls, model, where: Path, *flags: str, **kwargs) -> "DaemonProcess":
        """``serve --socket WHERE/ks.sock FLAGS...``, logging to WHERE/serve.log."""
        return cls(model, where / "serve.log", "--socket", str(where / "ks.sock"), *flags, **kwargs)

    def wait_for_listen_line(self, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(r"listening on (unix:\S+|tcp:\S+)", self.log_path.read_text())
            if found:
                where = found.group(1)
                return where.removeprefix("unix:") if where.startswith("unix:") else "tcp://" + where[4:]
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log_path.read_text()}")
            time.sleep(0.05)
        raise TimeoutError(f"daemon did not listen within {timeout_s} s:\n{self.log_path.read_text()}")

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self.log.close()


def run_clients(address: str, count: int, one_client) -> dict:
    """``await one_client(i)`` for i in 0..count-1 all at once (one anyio loop), then the daemon's stats."""
    import anyio

    import kestrel_stream as ks

    async def all_clients() -> dict:
        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(one_client, i)
        async with ks.AsyncClient(address) as client:
            return await client.stats()
    return anyio.run(all_clients)


def raw_connect(path: str, hello: bool = True) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10.0)
    sock.connect(path)
    if hello:
        sock.sendall(wire.encode_frame({"op": "hello", "id": 0, "v": wire.VERSION}))
        assert read_frame(sock).header["ok"]
    return sock


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def receive_exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def read_frame(sock: socket.socket) -> wire.Frame:
    header_bytes, payload_bytes = wire.parse_prefix(receive_exactly(sock, wire.PREFIX_BYTES), wire.MAX_RESPONSE_BYTES)
    return wire.parse_body(receive_exactly(sock, header_bytes), receive_exactly(sock, payload_bytes))


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def frame_bytes(header, payload: bytes = b"", **prefix) -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    fields = {"magic": b"KS", "version": wire.VERSION, "flags": 0, "header_len": len(head),
              "payload_len": len(payload), **prefix}
    return wire.PREFIX.pack(fields["magic"], fields["version"], fields["flags"], fields["header_len"],
                            fields["payload_len"]) + head + payload


def solo_tokens(engine, prompt, steps):
    """The greedy tokens of one session alone in process: prompt's next token, then `steps` more."""
    with engine.new_session() as s:
        tokens = [int(np.argmax(s.prefill(prompt)[-1]))]
        for _ in range(steps):
            tokens.append(int(np.argmax(s.decode(tokens[-1]))))
    return tokens


TIE_LOGIT = 1e-3    # a batched step's float32 sums differ from one session's by up to ~1e-4 (BLAS gemm vs gemv)


def assert_greedy_path(engine, prompt, tokens, tie: float = TIE_LOGIT) -> None:
    """`tokens` (the prompt's next token, then one per decode) are one session's greedy path, as the session alone
    in process scores them: each token is the argmax of the solo logits after the tokens before it, or within
    `tie` of it (a near tie that a batched step's summation order may turn the other way)."""
    with engine.new_session() as s:
        logits = s.prefill(prompt)[-1]
        for i, token in enumerate(tokens):
            best = int(np.argmax(logits))
            assert token == best or logits[best] - logits[token] <= tie, (
                f"token {i} of the path after prompt {prompt}: {token} scores {logits[token]:.6f}, "
                f"the greedy {best} {logits[best]:.6f}")
            if i + 1 < len(tokens):
                logits = s.decode(token)
