"""Thousands of malformed frames built by rule (tests/fuzz_frames.py), on a Unix socket and on TCP, before and
after hello: each gets an error answer or a clean close, the daemon never exits, and a well-formed client then
gets its solo-run tokens."""
from __future__ import annotations

import random
import socket
import threading

import pytest
from daemon_helpers import DaemonProcess, closed_by_peer, read_frame, solo_tokens
from fuzz_frames import answered_frames, fatal_frames

import kestrel_stream as ks
from kestrel_stream.wire import protocol as wire

BATCH = 100                 # frames pipelined before their answers are read


@pytest.fixture(scope="module")
def tcp_daemon(tiny_model, tmp_path_factory):
    where = tmp_path_factory.mktemp("tcp")
    proc = DaemonProcess(tiny_model, where / "serve.log", "--tcp", "127.0.0.1:0", "--token-file",
                         str(where / "token"), "--max-seq-len", "128")
    proc.token = (where / "token").read_text().strip()
    yield proc
    assert proc.stop() == 0, (where / "serve.log").read_text()


def connect(proc) -> socket.socket:
    if proc.address.startswith("tcp://"):
        host, port = proc.address[6:].rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=10.0)
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(10.0)
        sock.connect(proc.address)
    return sock


def hello(proc, sock) -> None:
    sock.sendall(wire.encode_frame({"op": "hello", "id": 0, "v": wire.VERSION, "token": getattr(proc, "token", None)}))
    assert read_frame(sock).header["ok"]


def send_split(sock, data: bytes, rng: random.Random) -> None:
    """Whole, or in pieces of 1..300 bytes, so that frames arrive split and several in one read."""
    if rng.random() < 0.5:
        sock.sendall(data)
        return
    at = 0
    while at < len(data):
        step = rng.randint(1, 300)
        sock.sendall(data[at:at + step])
        at += step


def answers_in_order(sock, frames: list[bytes], rng: random.Random) -> list[dict]:
    """Pipeline ``frames`` and a closing stats request; every frame's answer comes before the stats one."""
    sentinel = wire.encode_frame({"op": "stats", "id": 987654})
    sender = threading.Thread(target=send_split, args=(sock, b"".join(frames) + sentinel, rng))
    sender.start()
    answers = []
    while True:
        header = read_frame(sock).header
        if header.get("id") == 987654 and "stats" in header:
            break
        answers.append(header)
    sender.join()
    assert len(answers) == len(frames)
    return answers


def send_rest(sock, data: bytes, rng) -> None:
    """The frame in pieces, then end of stream; the daemon may answer and hang up before the last piece."""
    try:
        send_split(sock, data, rng)
        sock.shutdown(socket.SHUT_WR)
    except OSError:                 # broken pipe, reset, or not connected any more
        pass


def fuzz(proc, vocab: int) -> int:
    rng = random.Random(18)
    sent = 0
    sock = connect(proc)                        # after hello: pipelined, answered one by one
    hello(proc, sock)
    sock.sendall(wire.encode_frame({"op": "open", "id": 1}))
    session = read_frame(sock).header["session"]
    frames = answered_frames(session, vocab)
    for start in range(0, len(frames), BATCH):
        for answer in answers_in_order(sock, frames[start:start + BATCH], rng):
            assert answer["ok"] is True or (answer["code"] and answer["message"]), answer
        sent += len(frames[start:start + BATCH])
    sock.close()
    for data in frames[::3] + fatal_frames():   # before hello: one answer at most, then the daemon hangs up
        with connect(proc) as bad:
            send_rest(bad, data, rng)
            try:
                header = read_frame(bad).header
                assert header["ok"] is False or header.get("v") == wire.VERSION, header   # a hello that holds
            except ConnectionError:
                pass                            # a truncated frame, dropped
            assert closed_by_peer(bad)          # (a hello that held ends at the client's end of stream)
        sent += 1
    for data in fatal_frames():                 # after hello: the stream is out of step
        with connect(proc) as bad:
            hello(proc, bad)
            send_rest(bad, data, rng)
            try:
                assert read_frame(bad).header["ok"] is False
            except ConnectionError:
                pass
            assert closed_by_peer(bad)
        sent += 1
    return sent


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_malformed_frames_get_answers_and_leave_the_daemon_serving(transport, daemon, tcp_daemon, daemon_engine):
    proc = daemon if transport == "unix" else tcp_daemon
    sent = fuzz(proc, daemon_engine.config.vocab_size)
    assert sent >= 2500                         # both transports: >= 5,000
    assert proc.proc.poll() is None
    log = proc.log_path.read_text()
    assert "internal error" not in log and "Traceback" not in log, log[-3000:]
    token = getattr(proc, "token", None)
    with ks.Client(proc.address, token=token) as client, client.new_session() as s:
        tokens = [s.prefill([5, 3, 9], want="token")]
        for _ in range(12):
            tokens.append(s.decode(tokens[-1], want="token"))
        assert tokens == solo_tokens(daemon_engine, [5, 3, 9], 12)
        assert client.stats()["errors"] > 2000
