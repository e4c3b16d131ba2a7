"""``serve --devices cpu,cpu``: two CPU engines behind one socket and HTTP front (serve/replicas.py).

A session stays on its replica; new sessions balance; a cached prefix of the prompt wins over balance up to
--route-prefix-slack sessions and loses past it; closing, leaving and expiring free a replica's load; the
replicas' stats and /metrics add up to the totals; one replica's failing steps leave the other's clients alone;
--max-sessions and the admission queue hold across the replicas; greedy tokens are one engine's."""
from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
from daemon_helpers import solo_tokens
from inprocess_daemon import MODEL_NAME, InProcessDaemon
from prometheus_client.parser import text_string_to_metric_families

import kestrel_stream as ks
from kestrel_stream.errors import CapacityError, KestrelError
from kestrel_stream.serve.limits import Limits

RNG = np.random.default_rng(5)
PROMPTS = [[int(t) for t in RNG.integers(0, 256, n)] for n in (7, 12, 30, 19)]


@pytest.fixture
def solo(tiny_model):
    engine = ks.load(tiny_model, device="cpu")
    yield engine
    engine.close()


@pytest.fixture
def replicas(tiny_model, tmp_path):
    d = InProcessDaemon(tiny_model, tmp_path, max_sessions=16, devices=["cpu", "cpu"], prefix_slack=2)
    yield d
    d.stop()


def replica_of(d, session_id: int) -> int:
    [index] = [i for i, engine in enumerate(d.engines) if session_id in engine.sessions]
    return index


def complete(d, prompt, max_tokens: int, **fields) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}
    answer = httpx.post(f"http://127.0.0.1:{d.http_port}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def figures(stats: dict, key: str) -> list:
    return [replica[key] for replica in stats["replicas"]]


def test_a_session_stays_on_its_replica_and_new_sessions_balance(replicas):
    with ks.Client(str(replicas.socket_path)) as client:
        sessions = [client.new_session() for _ in range(4)]
        assert [replica_of(replicas, s.id) for s in sessions] == [0, 1, 0, 1]
        assert len({s.id for s in sessions}) == 4             # one id space across the replicas
        before = client.stats()
        s = sessions[1]                                       # every kind of request of one session on replica 1
        token = s.prefill(PROMPTS[0], want="token")
        for _ in range(5):
            token = s.decode(token, want="token")
        s.reset()
        s.generate(PROMPTS[1], 4)
        after = client.stats()
        assert figures(after, "prompt_tokens")[0] == figures(before, "prompt_tokens")[0]
        assert figures(after, "decode_tokens")[0] == figures(before, "decode_tokens")[0]
        assert figures(after, "prompt_tokens")[1] - figures(before, "prompt_tokens")[1] == 7 + 12
        assert figures(after, "decode_tokens")[1] - figures(before, "decode_tokens")[1] == 5 + 3
        assert replica_of(replicas, s.id) == 1 and figures(after, "sessions") == [2, 2]
        assert after["inline_steps"] == 0       # the shared reader thread runs no replica's steps
    # an HTTP request of n choices opens its sessions together, on one replica
    complete(replicas, PROMPTS[2], 3, n=2)
    assert figures(replicas.service.stats(), "placed") in ([4, 2], [2, 4])


def test_greedy_tokens_on_either_replica_are_one_engines(replicas, solo):
    out: dict = {}

    def socket_client(i: int) -> None:
        with ks.Client(str(replicas.socket_path)) as client, client.new_session() as s:
            out[i] = (replica_of(replicas, s.id), s.generate(PROMPTS[i], 12).tokens)
    threads = [threading.Thread(target=socket_client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r for r, _ in out.values()) == [0, 0, 1, 1]
    for i, (_, tokens) in out.items():
        assert tokens == solo_tokens(solo, PROMPTS[i], 11), i
    texts = {}

    def http_client(i: int) -> None:
        texts[i] = complete(replicas, PROMPTS[i], 10)["choices"][0]["text"]
    threads = [threading.Thread(target=http_client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, text in texts.items():
        assert text == solo.generate(PROMPTS[i], max_new_tokens=10, temperature=0.0).text, i
    assert min(figures(replicas.service.stats(), "placed")) >= 3          # the HTTP ones balanced too


def hold(client, replicas, on_first: int) -> list:
    """Sessions of ``client`` leaving replica 0 ``on_first`` sessions busier than replica 1 (its sessions opened
    in balance, then the ones on replica 1 closed)."""
    sessions = [client.new_session() for _ in range(2 * on_first)]
    for s in sessions:
        if replica_of(replicas, s.id) == 1:
            s.close()
    return [s for s in sessions if not s.closed]


def test_a_cached_prefix_wins_over_balance_up_to_the_slack(replicas):
    """--route-prefix-slack 2: a replica caching a prompt's prefix takes it while at most 2 busier."""
    near, far = PROMPTS[2] + PROMPTS[3], PROMPTS[3] + PROMPTS[2]      # 49 tokens: 3 full blocks each
    complete(replicas, near + [1], 2)
    complete(replicas, far + [1], 2)                                  # both prompts cached on replica 0 (a tie)
    stats = replicas.service.stats()
    assert figures(stats, "placed") == [2, 0] and figures(stats, "load") == [0, 0]
    with ks.Client(str(replicas.socket_path)) as client:
        held = hold(client, replicas, 3)
        assert figures(replicas.service.stats(), "load") == [3, 0]
        complete(replicas, far + [2], 2)            # 3 busier: past the slack, balance wins
        stats = replicas.service.stats()
        assert figures(stats, "placed_by_prefix") == [0, 0] and figures(stats, "placed")[1] == 4
        assert stats["replicas"][1]["prefix_cache"]["prefix_hits"] == 0
        held.pop().close()
        assert figures(replicas.service.stats(), "load") == [2, 0]
        hits = replicas.service.stats()["replicas"][0]["prefix_cache"]["prefix_hits"]
        complete(replicas, near + [2], 2)           # 2 busier: within the slack, the prefix wins
        stats = replicas.service.stats()
        assert figures(stats, "placed_by_prefix") == [1, 0]
        assert stats["replicas"][0]["prefix_cache"]["prefix_hits"] == hits + 1
        assert stats["replicas"][0]["prefix_cache"]["prefix_reused_tokens"] >= 48


def test_closing_leaving_and_expiring_free_the_replicas_load(tiny_model, tmp_path):
    d = InProcessDaemon(tiny_model, tmp_path, devices=["cpu", "cpu"], limits=Limits(idle_timeout_s=1.0))
    try:
        with ks.Client(str(d.socket_path)) as client:
            sessions = [client.new_session() for _ in range(3)]
            assert figures(d.service.stats(), "load") == [2, 1]
            sessions[0].close()
            assert figures(d.service.stats(), "load") == [1, 1]
            assert replica_of(d, client.new_session().id) == 0     # the freed place is where the next one goes
        deadline = time.monotonic() + 10
        while d.service.held_sessions and time.monotonic() < deadline:   # the client left: its sessions close
            time.sleep(0.01)
        assert figures(d.service.stats(), "load") == [0, 0] and d.sessions() == 0
        idle = ks.Client(str(d.socket_path))
        idle.new_session(), idle.new_session()
        assert figures(d.service.stats(), "load") == [1, 1]
        time.sleep(1.5)                                 # --idle-timeout-s: the connection ends, its sessions freed
        deadline = time.monotonic() + 10
        while d.service.held_sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        assert figures(d.service.stats(), "load") == [0, 0] and d.sessions() == 0
        idle.close()
    finally:
        d.stop()


def test_per_replica_stats_and_metrics_add_up_to_the_totals(replicas):
    with ks.Client(str(replicas.socket_path)) as client:
        open_ones = [client.new_session() for _ in range(3)]
        for i, s in enumerate(open_ones):
            s.generate(PROMPTS[i], 5)
        complete(replicas, PROMPTS[3] * 2, 4)
        complete(replicas, PROMPTS[3] * 2, 4)           # a prefix hit
        stats = client.stats()
        body = httpx.get(f"http://127.0.0.1:{replicas.http_port}/metrics", timeout=10).text
    for key in ("steps", "batches", "batched_requests", "decode_tokens", "prompt_tokens", "prompts_answered",
                "sessions", "decode_steps", "generated_tokens", "kv_positions_used", "kv_positions_allocated",
                "inline_steps"):
        assert sum(figures(stats, key)) == stats[key], key
    assert sum(r["counters"]["tokens"] for r in stats["replicas"]) == stats["counters"]["tokens"]
    assert sum(r["prefix_cache"]["prefix_hits"] for r in stats["replicas"]) == stats["prefix_cache"]["prefix_hits"] >= 1
    assert stats["mean_batch"] == round(stats["batched_requests"] / stats["batches"], 3)
    assert stats["ttft_ms"]["samples"] == sum(r["ttft_ms"]["samples"] for r in stats["replicas"])
    for key in ("ttft_histogram", "ttft_steps_histogram"):       # bucket by bucket, the replicas' added
        assert stats[key]["le"] == {le: sum(r[key]["le"][le] for r in stats["replicas"]) for le in stats[key]["le"]}
        assert stats[key]["count"] == stats["ttft_ms"]["samples"] > 0
    assert stats["step_ms"]["samples"] == sum(r["step_ms"]["samples"] for r in stats["replicas"]) > 0
    assert min(r["step_ms"]["max"] for r in stats["replicas"]) <= stats["step_ms"]["max"] == max(
        r["step_ms"]["max"] for r in stats["replicas"])
    samples: dict = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    assert samples["kestrel_replicas"][0].value == 2
    pairs = {"kestrel_replica_steps_total": "kestrel_steps_total",
             "kestrel_replica_decode_steps_total": "kestrel_decode_steps_total",
             "kestrel_replica_decode_step_seconds_total": "kestrel_decode_step_seconds_total",
             "kestrel_replica_decode_tokens_total": "kestrel_decode_tokens_total",
             "kestrel_replica_prompt_tokens_total": "kestrel_prompt_tokens_total",
             "kestrel_replica_sessions": "kestrel_sessions", "kestrel_replica_queue_depth": "kestrel_queue_depth",
             "kestrel_replica_kv_positions_used": "kestrel_kv_positions_used",
             "kestrel_replica_kv_positions_allocated": "kestrel_kv_positions_allocated",
             "kestrel_replica_prefix_hits_total": "kestrel_prefix_hits_total",
             "kestrel_replica_prefix_reused_tokens_total": "kestrel_prefix_reused_tokens_total"}
    for per_replica, total in pairs.items():
        labelled = samples[per_replica]
        assert sorted((s.labels["replica"], s.labels["device"]) for s in labelled) == [("0", "cpu"), ("1", "cpu")]
        assert sum(s.value for s in labelled) == pytest.approx(samples[total][0].value), per_replica
    assert samples["kestrel_replica_sessions"][0].value + samples["kestrel_replica_sessions"][1].value == 3


def test_one_replicas_failing_steps_leave_the_other_replicas_clients_alone(replicas, solo):
    def broken(*args, **kwargs):
        raise RuntimeError("device 0 lost")
    with ks.Client(str(replicas.socket_path)) as first, ks.Client(str(replicas.socket_path)) as second:
        a, b = first.new_session(), second.new_session()
        assert (replica_of(replicas, a.id), replica_of(replicas, b.id)) == (0, 1)
        replicas.engines[0].step = broken           # replica 0's every step fails from now on
        failures, done = [0], threading.Event()

        def hammer() -> None:
            while not done.is_set():
                with pytest.raises(KestrelError, match="device 0 lost"):
                    a.generate(PROMPTS[0], 4)
                failures[0] += 1
        thread = threading.Thread(target=hammer)
        thread.start()
        try:
            for i in range(3):
                assert b.generate(PROMPTS[i], 10).tokens == solo_tokens(solo, PROMPTS[i], 9)
                b.reset()
        finally:
            done.set()
            thread.join()
        assert failures[0] >= 1 and a.position == 0          # a failed prompt leaves its session as it was
        del replicas.engines[0].step                        # the device is back: its session works again
        assert a.generate(PROMPTS[1], 6).tokens == solo_tokens(solo, PROMPTS[1], 5)
        stats = first.stats()
        assert figures(stats, "step_errors")[0] == failures[0] and figures(stats, "step_errors")[1] == 0


def test_max_sessions_and_the_admission_queue_hold_across_the_replicas(tiny_model, tmp_path):
    d = InProcessDaemon(tiny_model, tmp_path, max_sessions=3, max_queue=2, devices=["cpu", "cpu"])
    try:
        with ks.Client(str(d.socket_path)) as client:
            held = [client.new_session() for _ in range(3)]
            assert figures(d.service.stats(), "load") == [2, 1]
            with pytest.raises(CapacityError, match=r"holds 3 sessions \(--max-sessions 3\)"):
                client.new_session()                # each replica alone would have room: the limit is the daemon's
            answer = {}
            waiting = threading.Thread(target=lambda: answer.update(complete(d, PROMPTS[0], 3)))
            waiting.start()
            deadline = time.monotonic() + 10
            while d.service.stats()["admission_queue_depth"] < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert d.service.stats()["admission_queue_depth"] == 1 and not answer
            [on_second] = [s for s in held if replica_of(d, s.id) == 1]
            on_second.close()                       # the freed place goes to the queued generation
            waiting.join(30)
            assert answer["usage"]["completion_tokens"] == 3
            assert figures(d.service.stats(), "placed") == [2, 2]       # it went where the place was freed
    finally:
        d.stop()


def test_speculative_rounds_run_on_their_sessions_replica(tiny_model, tmp_path, solo):
    """Each replica has its own draft (here prompt lookup); a generation's rounds use its session's, and the totals
    add the replicas' passes up."""
    d = InProcessDaemon(tiny_model, tmp_path, devices=["cpu", "cpu"], load={"spec": "lookup", "spec_policy": "always"})
    prompt = PROMPTS[1] * 3
    try:
        with ks.Client(str(d.socket_path)) as client:
            sessions = [client.new_session() for _ in range(2)]
            for s in sessions:
                assert s.generate(prompt, 12).tokens == solo_tokens(solo, prompt, 11)
            stats = client.stats()
        passes = [r["speculation"]["spec_passes"] for r in stats["replicas"]]
        assert min(passes) > 0 and stats["speculation"]["spec_passes"] == sum(passes)
        drafted = sum(r["speculation"]["spec_drafted"] for r in stats["replicas"])
        accepted = sum(r["speculation"]["spec_accepted"] for r in stats["replicas"])
        assert stats["speculation"]["spec_acceptance"] == round(accepted / drafted, 4)
    finally:
        d.stop()
