"""The daemon as users meet it: a real `kestrel-stream serve` process on a temp socket, CPU engine, tiny model."""
from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time

import anyio
import numpy as np
import pytest
from daemon_helpers import (ENV, DaemonProcess, assert_greedy_path, closed_by_peer, frame_bytes, raw_connect,
                            read_frame, run_clients, solo_tokens)

import kestrel_stream as ks
from kestrel_stream.wire import protocol as wire

CLIENTS, STEPS = 32, 50


def test_socket_is_private_to_its_user(daemon):
    mode = os.stat(daemon.address).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert "listening on unix:" in daemon.log_path.read_text()


def test_remote_session_matches_in_process(daemon, daemon_engine):
    with ks.Client(daemon.address) as client, client.new_session() as remote, daemon_engine.new_session() as local:
        np.testing.assert_array_equal(remote.prefill([1, 2, 3]), local.prefill([1, 2, 3]))
        logits = local.decode(4)
        np.testing.assert_array_equal(remote.decode(4), logits)
        expected = local.decode(5)
        top = remote.decode(5, want="topk", k=3)
        assert top.ids.tolist() == np.argsort(-expected, kind="stable")[:3].tolist()
        np.testing.assert_array_equal(top.logits, expected[top.ids])
        assert remote.decode(6, want="token") == int(np.argmax(local.decode(6)))
        assert remote.position == local.position == 6
        remote.reset()
        assert remote.position == 0
        assert remote.generate([7, 8], 6) == daemon_engine.generate([7, 8], 6).tokens
        assert client.generate([3, 1, 4], 5) == daemon_engine.generate([3, 1, 4], 5).tokens


def test_errors_arrive_as_typed_exceptions_and_change_nothing(daemon, daemon_engine):
    with ks.Client(daemon.address) as client, ks.Client(daemon.address) as other:
        s = client.new_session(max_seq_len=4)
        s.prefill([1, 2])
        with pytest.raises(ks.InvalidTokenError, match="outside the vocabulary"):
            s.decode(daemon_engine.config.vocab_size)
        with pytest.raises(ks.InvalidTokenError, match="integers"):
            s.prefill([1.5])
        with pytest.raises(ks.CapacityError, match="max_seq_len=4"):
            s.prefill([1, 2, 3])
        with pytest.raises(ks.CapacityError, match="outside 1..128"):
            client.new_session(max_seq_len=10_000)
        with pytest.raises(wire.UnknownSessionError, match=f"session {s.id} is not open on this connection"):
            other.call("decode", {"session": s.id, "token": 1}, {})
        assert s.position == 2
        assert s.decode(3, want="token") == solo_tokens(daemon_engine, [1, 2, 3], 0)[0]
        s.close()
        with pytest.raises(wire.UnknownSessionError):
            s.client.call("decode", {"session": s.id, "token": 1}, {})


def test_a_decode_that_fails_in_its_step_fails_alone(daemon, daemon_engine):
    """Errors found when the step runs (a full session) are answered like any other, and its batch goes on."""
    with ks.Client(daemon.address) as client, ks.Client(daemon.address) as other:
        full, busy = client.new_session(max_seq_len=3), other.new_session()
        full.prefill([1, 2], want="token")
        busy.prefill([4, 2], want="token")
        errors = client.stats()["errors"]
        assert full.decode(3, want="token") >= 0
        with pytest.raises(ks.CapacityError, match="is full"):
            full.decode(4, want="token")
        assert client.stats()["errors"] == errors + 1
        assert full.position == 3
        assert busy.decode(5, want="token") == solo_tokens(daemon_engine, [4, 2, 5], 0)[0]


def test_pipelined_requests_are_answered_in_order(daemon, daemon_engine):
    """A client may send several requests before reading: each is answered, in the order sent."""
    sock = raw_connect(daemon.address)
    sock.sendall(wire.encode_frame({"op": "open", "id": 1}))
    session = read_frame(sock).header["session"]
    ids = wire.encode_frame({"op": "prefill", "id": 2, "session": session, "want": "token"},
                            {"ids": np.array([4, 2], np.int64)})
    sock.sendall(ids + b"".join(wire.encode_frame(header) for header in (
        {"op": "decode", "id": 3, "session": session, "token": 5, "want": "token"},
        {"op": "stats", "id": 4},
        {"op": "decode", "id": 5, "session": session, "token": 6, "want": "token"},
        {"op": "decode", "id": 6, "session": session, "token": daemon_engine.config.vocab_size},
        {"op": "reset", "id": 7, "session": session})))
    answers = [read_frame(sock).header for _ in range(6)]
    assert [a["id"] for a in answers] == [2, 3, 4, 5, 6, 7]
    assert [a.get("position") for a in answers] == [2, 3, None, 4, None, 0]
    assert answers[1]["token"] == solo_tokens(daemon_engine, [4, 2, 5], 0)[0]
    assert answers[4]["code"] == "invalid_token"
    sock.close()


def test_a_lone_client_does_not_wait_for_the_batching_window(tiny_model, tmp_path):
    """Only sessions that are decoding hold a batch back; an idle one next to a lone client does not."""
    proc = DaemonProcess.on_socket(tiny_model, tmp_path, "--batch-window-ms", "400")
    try:
        with ks.Client(proc.address) as client, ks.Client(proc.address) as idle:
            idle.new_session().prefill([1], want="token")
            s = client.new_session()
            token = s.prefill([1, 2, 3], want="token")
            took_s = []
            for _ in range(8):
                started = time.perf_counter()
                token = s.decode(token, want="token")
                took_s.append(time.perf_counter() - started)
            assert sorted(took_s)[len(took_s) // 2] < 0.2, took_s        # a held step would take >= 0.4 s
    finally:
        assert proc.stop() == 0


def test_trace_start_stop_reach_the_recorder(daemon, tmp_path):
    try:
        from kestrel_stream.obs import trace  # noqa: F401  (built separately; absent in older builds)
    except ImportError:
        with ks.Client(daemon.address) as client, pytest.raises(wire.UnavailableError, match="tracing unavailable"):
            client.trace_start(tmp_path / "t.json")
        return
    trace_dir = os.path.join(os.path.dirname(daemon.address), "traces")      # the fixture's --trace-dir
    with ks.Client(daemon.address) as client:
        client.trace_start("t.json")
        assert client.generate([1, 2], 4)
        written = client.trace_stop()
    assert written == os.path.join(trace_dir, "t.json") and os.path.getsize(written) > 0


def test_concurrent_clients_get_their_solo_tokens(daemon, daemon_engine):
    prompts = [[(7 * i + j) % daemon_engine.config.vocab_size for j in range(1 + i % 5)] for i in range(CLIENTS)]
    got: dict[int, list[int]] = {}

    async def one_client(i: int) -> None:
        async with ks.AsyncClient(daemon.address) as client:
            async with await client.new_session() as s:
                tokens = [await s.prefill(prompts[i], want="token")]
                for _ in range(STEPS):
                    tokens.append(await s.decode(tokens[-1], want="token"))
                got[i] = tokens

    before = ks.connect(daemon.address).stats()
    stats = run_clients(daemon.address, CLIENTS, one_client)
    for i in range(CLIENTS):
        assert len(got[i]) == STEPS + 1
        assert_greedy_path(daemon_engine, prompts[i], got[i])
    batches = stats["batches"] - before["batches"]
    assert batches < CLIENTS * STEPS / 2, f"{batches} batches: decode steps were not batched"
    inline = stats["inline_steps"] - before["inline_steps"]
    assert inline < CLIENTS * STEPS / 10, f"{inline} of the concurrent steps ran alone on the reader thread"
    assert stats["sessions"] == 0


def test_killed_client_frees_its_sessions(daemon):
    with ks.Client(daemon.address) as watcher:
        baseline = watcher.stats()["sessions"]
        script = ("import sys, time, kestrel_stream as ks\n"
                  "c = ks.Client(sys.argv[1])\n"
                  "sessions = [c.new_session() for _ in range(3)]\n"
                  "[s.prefill([1, 2, 3]) for s in sessions]\n"
                  "print('ready', flush=True)\n"
                  "time.sleep(60)\n")
        child = subprocess.Popen([sys.executable, "-c", script, daemon.address], stdout=subprocess.PIPE, text=True,
                                 env=ENV)
        assert child.stdout.readline().strip() == "ready"
        assert watcher.stats()["sessions"] == baseline + 3
        child.kill()
        child.wait()
        deadline = time.monotonic() + 10
        while watcher.stats()["sessions"] != baseline and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watcher.stats()["sessions"] == baseline


def test_session_limit_is_an_error_for_that_request_only(daemon):
    with ks.Client(daemon.address) as client:
        held = []
        with pytest.raises(ks.CapacityError, match="--max-sessions 48"):
            for _ in range(49):
                held.append(client.new_session(max_seq_len=8))
        for s in held:
            s.close()
        assert client.new_session().prefill([1], want="token") >= 0


def test_client_timeouts_and_missing_daemon_are_clear(tmp_path):
    with pytest.raises(ConnectionError, match="is `kestrel-stream serve` running"):
        ks.Client(tmp_path / "missing.sock")
    silent = socket.socket(socket.AF_UNIX)          # accepts, never answers
    silent.bind(str(tmp_path / "silent.sock"))
    silent.listen()
    with pytest.raises(TimeoutError, match="within 0.2 s"):
        ks.Client(tmp_path / "silent.sock", timeout=0.2)
    with pytest.raises(TimeoutError, match="within 0.2 s"):
        anyio.run(ks.AsyncClient.connect, tmp_path / "silent.sock", None, 0.2)
    silent.close()


def test_first_frame_must_be_hello(daemon):
    sock = raw_connect(daemon.address, hello=False)
    sock.sendall(frame_bytes({"op": "stats", "id": 1}))
    reply = read_frame(sock).header
    assert reply["code"] == "auth" and "hello" in reply["message"]
    assert closed_by_peer(sock)


def test_tcp_without_the_token_is_refused(tiny_model, tmp_path):
    token_file = tmp_path / "token"
    proc = DaemonProcess(tiny_model, tmp_path / "serve.log", "--tcp", "127.0.0.1:0", "--token-file", str(token_file))
    try:
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        with pytest.raises(wire.AuthError, match="token"):
            ks.Client(proc.address, token="wrong")
        with pytest.raises(wire.AuthError, match="token"):
            ks.Client(proc.address, token="")
        with ks.Client(proc.address, token=token) as client, client.new_session() as s:
            assert s.generate([1, 2], 3) == client.generate([1, 2], 3)
            fresh = client.new_session()
            fresh.prefill([1, 2], want="token")
            assert fresh.decode(3, want="token") == client.generate([1, 2, 3], 1)[0]   # answered from the loop
    finally:
        assert proc.stop() == 0


def test_sigterm_finishes_steps_tells_clients_and_exits_zero(tiny_model, tmp_path):
    sock_path = tmp_path / "ks.sock"
    proc = DaemonProcess(tiny_model, tmp_path / "serve.log", "--socket", str(sock_path))
    client = ks.Client(str(sock_path))
    s = client.new_session()
    s.prefill([1, 2, 3])
    assert proc.stop() == 0
    assert not sock_path.exists()
    log = (tmp_path / "serve.log").read_text()
    assert "SIGTERM: finishing in-flight steps" in log and "stopped" in log
    with pytest.raises((wire.ShuttingDownError, ConnectionError)):
        s.decode(4)


def hostile_requests(rng, vocab: int, own: int, foreign: int):
    """Well-framed but wrong requests (each must be answered with an error); 12 kinds, 70 of each."""
    ids = lambda values, dtype="<i8": ({"name": "ids", "dtype": dtype, "shape": [len(values)]},  # noqa: E731
                                      np.asarray(values, dtype).tobytes())
    for i in range(70):
        bad_token = [-1, vocab, 2**40, 1.5, "3", None, True, [1]][i % 8]
        bad_session = [foreign, 10**9, -1, "1", None, 2.0][i % 6]
        bad_ids = [ids([vocab + i]), ids([-1 - i]), ids([1.5], "<f4"), ids([], "<i4"),
                   ({"name": "ids", "dtype": "<i2", "shape": [1]}, b"\0\0"),
                   ({"name": "ids", "dtype": "<i8", "shape": [3]}, b"\0" * 8),
                   ({"name": "ids", "dtype": "<i8", "shape": [2, 2]}, b"\0" * 32)][i % 7]
        yield bytes(rng.integers(32, 127, rng.integers(2, 200)).astype(np.uint8)), b""      # not JSON
        yield [b"[1]", b"33", b"null", b'"x"', b"{}"][i % 5], b""
        yield {"op": f"op_{i}", "id": i}, b""
        yield {"op": "decode", "id": ["x", 1.5, [1]][i % 3], "session": own, "token": 1}, b""
        yield {"op": "decode", "id": i, "session": own, "token": bad_token}, b""
        yield {"op": "decode", "id": i, "session": bad_session, "token": 1}, b""
        spec, payload = bad_ids
        yield {"op": ["prefill", "generate"][i % 2], "id": i, "session": own, "n": 2, "arrays": [spec]}, payload
        yield {"op": "decode", "id": i, "session": own, "token": 1, "want": ["topk", "all", 3][i % 3],
               "k": [0, vocab + 1, "3"][i % 3]}, b""
        yield {"op": "generate", "id": i, "session": own, "n": [-1, 10**9, "5"][i % 3], "arrays": [ids([1])[0]]}, \
            ids([1])[1]
        yield {"op": "open", "id": i, "max_seq_len": [0, -5, "x", 10**12][i % 4]}, b""
        yield {"op": "trace_start", "id": i, "path": [5, "", None][i % 3]}, b""
        yield {"op": "prefill", "id": i, "session": own, "arrays": {"ids": 1}}, b""


def broken_framing(rng):
    """Frames that leave the stream out of step (the daemon answers at most once, then hangs up)."""
    for i in range(60):
        yield bytes(rng.integers(0, 256, rng.integers(12, 300)).astype(np.uint8))
        yield frame_bytes({"op": "stats", "id": i}, **[{"magic": b"HT"}, {"version": 9}, {"flags": 4}][i % 3])
        yield frame_bytes({"op": "stats"}, header_len=[0, 1, wire.MAX_HEADER_BYTES + 1, 2**32 - 1][i % 4])
        yield frame_bytes({"op": "stats"}, payload_len=[2**32 - 1, 17 * 2**20, 2**31][i % 3])
        yield frame_bytes({"op": "prefill", "id": i}, payload=b"\0" * 64, payload_len=10 * 2**20)[:40 + i]


def test_fuzzed_frames_never_disturb_other_sessions(daemon, daemon_engine):
    rng = np.random.default_rng(6)
    expected = solo_tokens(daemon_engine, [4, 2], 20)
    with ks.Client(daemon.address) as victim, ks.Client(daemon.address) as stranger:
        vs = victim.new_session()
        tokens = [vs.prefill([4, 2], want="token")]
        foreign = stranger.new_session().id
        sock = raw_connect(daemon.address)
        sock.sendall(wire.encode_frame({"op": "open", "id": 1}))
        own = read_frame(sock).header["session"]
        sent = 0
        for header, payload in hostile_requests(rng, daemon_engine.config.vocab_size, own, foreign):
            sock.sendall(frame_bytes(header, payload))
            reply = read_frame(sock).header
            assert reply["ok"] is False and reply["message"], (header, reply)
            sent += 1
            if sent % 100 == 0:            # the victim keeps decoding while the fuzzing goes on
                tokens.append(vs.decode(tokens[-1], want="token"))
        for data in broken_framing(rng):
            with raw_connect(daemon.address) as bad:
                bad.sendall(data)
                bad.shutdown(1)
                try:
                    reply = read_frame(bad).header
                    assert reply["ok"] is False
                except ConnectionError:
                    pass                    # a truncated frame is simply dropped
                assert closed_by_peer(bad)
            sent += 1
        assert sent >= 1000
        while len(tokens) < len(expected):
            tokens.append(vs.decode(tokens[-1], want="token"))
        assert tokens == expected
        sock.sendall(wire.encode_frame({"op": "decode", "id": 7, "session": own, "token": 5, "want": "token"}))
        assert read_frame(sock).header["ok"]
        sock.close()
        assert victim.generate([9, 9, 9], 8) == daemon_engine.generate([9, 9, 9], 8).tokens
        assert victim.stats()["errors"] >= 840
