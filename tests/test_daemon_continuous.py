"""Continuous batching in the daemon: prompts run in chunks beside other sessions' decodes, under --step-tokens
(oldest prompt first, or with --prompt-order shortest those with the fewest tokens left).

A real `kestrel-stream serve` process (CPU engine, tiny model); every session's
tokens are compared with the same session run alone in process.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anyio
import numpy as np
import pytest
from daemon_helpers import ENV, DaemonProcess, run_clients
from solo_reference import solo_runs

import kestrel_stream as ks
from kestrel_stream.errors import CapacityError, InvalidTokenError
from kestrel_stream.wire.protocol import ProtocolError, UnknownSessionError

MAX_SEQ_LEN, STEP_TOKENS = 2100, 128
CLIENTS, DECODES = 32, 4


def start_daemon(long_tiny_model, where, *flags, **kwargs) -> DaemonProcess:
    return DaemonProcess.on_socket(long_tiny_model, where, "--max-seq-len", str(MAX_SEQ_LEN), "--max-sessions", "48",
                                   "--step-tokens", str(STEP_TOKENS), *flags, **kwargs)


def vocab_size(model) -> int:
    return json.loads((Path(model) / "config.json").read_text())["vocab_size"]


def ids(seed: int, count: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, count).tolist()


async def bad_requests(client, s, vocab: int) -> None:
    """Refused requests, each answered with its error; none may change the session or any other."""
    with pytest.raises(InvalidTokenError):
        await s.prefill([1, vocab, 2], want="token")
    with pytest.raises(CapacityError):
        await s.prefill([1] * (MAX_SEQ_LEN + 1), want="token")
    with pytest.raises(ProtocolError):
        await client.call("prefill", {"session": s.id, "want": "topk", "k": 0}, {"ids": np.array([1, 2])})
    with pytest.raises(UnknownSessionError):
        await client.call("decode", {"session": 10**6, "token": 1}, {})


@pytest.mark.parametrize("order", ["oldest", "shortest"])
def test_32_clients_with_prompts_of_1_to_1000_tokens_get_their_solo_tokens(long_tiny_model, tmp_path, monkeypatch,
                                                                            order):
    # numpy's arithmetic gives a session's rows the same numbers whatever its step holds, so any other
    # token is the batching's fault (the native host kernels' step sizes agree within 2e-3, not bit for bit)
    monkeypatch.setenv("KESTREL_HOST_KERNELS", "numpy")         # the daemon's and the solo reference's
    vocab = vocab_size(long_tiny_model)
    lengths = np.linspace(1, 1000, CLIENTS).astype(int).tolist()
    prompts = [ids(i, n, vocab) for i, n in enumerate(lengths)]
    mores = [ids(100 + i, 1 + (37 * i) % 150, vocab) for i in range(CLIENTS)]
    got, logits = {}, {}
    daemon = start_daemon(long_tiny_model, tmp_path, "--prompt-order", order,
                          env=dict(ENV, KESTREL_HOST_KERNELS="numpy"))
    try:
        async def one_client(i: int) -> None:
            async with ks.AsyncClient(daemon.address) as client:
                async with await client.new_session() as s:
                    if i % 4 == 0:
                        await bad_requests(client, s, vocab)
                    if i == CLIENTS - 1:
                        logits[i] = await s.prefill(prompts[i], want="logits")
                        tokens = [int(np.argmax(logits[i][-1]))]
                    else:
                        tokens = [await s.prefill(prompts[i], want="token")]
                    for _ in range(DECODES):
                        tokens.append(await s.decode(tokens[-1], want="token"))
                    if i % 4 == 1:
                        await bad_requests(client, s, vocab)
                    top = await s.prefill(mores[i], want="topk", k=3)
                    tokens.append(int(top.ids[0]))
                    for _ in range(DECODES):
                        tokens.append(await s.decode(tokens[-1], want="token"))
                    got[i] = tokens

        stats = run_clients(daemon.address, CLIENTS, one_client)
    finally:
        assert daemon.stop() == 0, daemon.log_path.read_text()
    # each session alone in process: the prompt's token, decodes, more prompt, decodes
    runs = [[["prefill", prompts[i]], ["decode", DECODES], ["prefill", mores[i]], ["decode", DECODES]]
            for i in range(CLIENTS)]
    runs.insert(0, runs[-1])                        # first: the run whose whole-prompt logits are saved
    expected = solo_runs(long_tiny_model, MAX_SEQ_LEN, runs, tmp_path / "logits.npy")
    assert [got[i] for i in range(CLIENTS)] == expected[1:]
    full_logits = np.load(tmp_path / "logits.npy")     # [1000, V]: want="logits" came in many chunks
    # chunked logits: the engine's batched arithmetic is per session but BLAS sums in another order
    assert logits[CLIENTS - 1].shape == full_logits.shape
    np.testing.assert_allclose(logits[CLIENTS - 1], full_logits, rtol=1e-4, atol=1e-5)
    assert (logits[CLIENTS - 1].argmax(-1) == full_logits.argmax(-1)).all()
    assert stats["max_tokens_in_step"] <= STEP_TOKENS == stats["step_tokens"] and stats["prompt_order"] == order
    sizes = [len(p) for p in prompts + mores]
    # refused prompts ran nothing; a one-token prompt is a one-token request, as a decode is
    assert stats["prompt_tokens"] == sum(n for n in sizes if n > 1)
    assert stats["decode_tokens"] == 2 * DECODES * CLIENTS + sizes.count(1)
    assert stats["prompt_chunks"] > 2 * CLIENTS                     # long prompts were cut
    assert stats["mixed_steps"] > 0                                 # prompts ran beside decodes
    assert stats["prompts_answered"] == 2 * CLIENTS and stats["ttft_ms"]["samples"] == 2 * CLIENTS
    assert 0 < stats["ttft_ms"]["p50"] <= stats["ttft_ms"]["p99"]
    # a long prompt's first token comes after its chunks' steps: at least 1, and more for the cut ones
    assert 1 <= stats["ttft_ms"]["steps_p50"] <= stats["ttft_ms"]["steps_p99"] and stats["ttft_ms"]["steps_p99"] > 1
    assert stats["step_ms"]["samples"] >= stats["steps"] - 1 and 0 < stats["step_ms"]["p50"] <= stats["step_ms"]["max"]
    assert stats["queue_depth"] == 0 and stats["sessions"] == 0


def test_a_2000_token_prompt_mid_stream_does_not_stall_the_others_decode(long_tiny_model, tmp_path):
    vocab, decoders = vocab_size(long_tiny_model), 4
    prompts = [ids(200 + i, 5, vocab) for i in range(decoders)]
    long_prompt = ids(300, 2000, vocab)
    got: dict = {}
    daemon = start_daemon(long_tiny_model, tmp_path)
    try:
        async def decoder(i: int, started: anyio.Event, answered: anyio.Event) -> None:
            async with ks.AsyncClient(daemon.address) as client, await client.new_session() as s:
                tokens = [await s.prefill(prompts[i], want="token")]
                while not answered.is_set() or len(tokens) < 12:   # decode on until after the long prompt
                    tokens.append(await s.decode(tokens[-1], want="token"))
                    if len(tokens) == 4:
                        started.set()
                got[i] = tokens

        async def long_client(started: list, answered: anyio.Event) -> None:
            for event in started:
                await event.wait()
            async with ks.AsyncClient(daemon.address) as client, await client.new_session() as s:
                got["long"] = await s.prefill(long_prompt, want="token")
                got["stats"] = await client.stats()
            answered.set()

        async def run() -> dict:
            started, answered = [anyio.Event() for _ in range(decoders)], anyio.Event()
            async with anyio.create_task_group() as tg:
                for i in range(decoders):
                    tg.start_soon(decoder, i, started[i], answered)
                tg.start_soon(long_client, started, answered)

        anyio.run(run)
    finally:
        assert daemon.stop() == 0, daemon.log_path.read_text()
    runs = [[["prefill", long_prompt]]] + [[["prefill", prompts[i]], ["decode", len(got[i]) - 1]]
                                           for i in range(decoders)]
    assert [[got["long"]]] + [got[i] for i in range(decoders)] == solo_runs(long_tiny_model, MAX_SEQ_LEN, runs)
    stats = got["stats"]
    # Every decode went into the first step formed after it arrived: it waited at most for the step running
    # then, which held at most STEP_TOKENS tokens.
    assert stats["max_decode_wait_steps"] == 0, stats
    assert stats["max_tokens_in_step"] <= STEP_TOKENS
    assert stats["prompt_tokens"] == 2000 + 5 * decoders
    assert stats["prompt_chunks"] >= decoders + 2000 // STEP_TOKENS       # the long prompt was cut
    # chunks beside the others' decodes: the decoders went on while the long prompt ran
    assert stats["mixed_steps"] >= 2000 // STEP_TOKENS // 2, stats


@pytest.mark.parametrize("value", ["0", "70000"])
def test_a_step_budget_out_of_range_is_refused_before_loading(long_tiny_model, tmp_path, value):
    out = subprocess.run([sys.executable, "-m", "kestrel_stream", "serve", "--model", str(long_tiny_model),
                          "--socket", str(tmp_path / "ks.sock"), "--step-tokens", value],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode != 0 and "--step-tokens" in out.stderr, out.stderr
    assert not (tmp_path / "ks.sock").exists()
