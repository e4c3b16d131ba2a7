"""serve/http pieces without a daemon: the fast stream event equals the general chunk, request checks, bodies kept
as their chunks came and decoded off the loop."""
from __future__ import annotations

import json

import pytest

from kestrel_stream.serve.http.bodies import Body
from kestrel_stream.serve.http.errors import APIError
from kestrel_stream.serve.http.generate import TokenOut, log_probs
from kestrel_stream.serve.http.requests import parse_request
from kestrel_stream.serve.http.responses import Shape, sse


class Plain:
    class request:
        logprobs = None


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("usage", [False, True])
def test_token_event_equals_the_chunk(chat, usage):
    shape = Shape(chat, "m", Plain)
    for text in ('a"\u00e9\n\\', "", "\ufffd"):
        out = TokenOut(5, text)
        assert json.loads(shape.token_event(out, usage)[6:]) == json.loads(sse(shape.chunk([out], include_usage=usage))[6:])


def test_defaults_and_refusals():
    r = parse_request({"model": "m", "prompt": "x"}, chat=False, vocab_size=256)
    assert r.max_tokens == 16 and r.params.temperature == 1.0 and r.params.top_k == 0 and r.stop == []
    r = parse_request({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                       "stop": "x", "max_completion_tokens": 3}, chat=True, vocab_size=256)
    assert r.max_tokens == 3 and r.stop == ["x"] and r.prompt == [{"role": "user", "content": "a"}]
    for body, param in (({"prompt": "x", "tools": []}, "tools"), ({"prompt": "x", "echo": True}, "echo"),
                        ({"prompt": "x", "stop": ["a"] * 5}, "stop"), ({"prompt": "x", "top_k": True}, "top_k")):
        with pytest.raises(APIError) as e:
            parse_request({"model": "m", **body}, chat=False, vocab_size=256)
        assert e.value.status == 400 and e.value.param == param


def test_log_probs_are_a_log_softmax():
    logits = [2.0, 0.0, 1.0, -1.0]
    import numpy as np
    chosen, top = log_probs(np.array(logits, np.float32), 2, 2)
    assert [t for t, _ in top] == [0, 2] and chosen == pytest.approx(top[1][1])
    assert sum(np.exp(np.array(logits) - np.log(np.exp(logits).sum()))) == pytest.approx(1.0)
    assert top[0][1] == pytest.approx(2.0 - np.log(np.exp(logits).sum()))


def test_metrics_name_the_daemon_stats_window_kv_pool_and_prefix_counters_included():
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from kestrel_stream.serve.http.metrics import Metrics
    stats = {"requests": 3, "errors": 1, "steps": 10, "decode_steps": 8, "decode_step_s": 0.5, "decode_tokens": 40,
             "prompt_tokens": 100, "mean_batch": 4.0, "tokens_per_step": 14.0, "queue_depth": 2, "sessions": 2,
             "max_sessions": 64, "ttft_ms": {"p50": 12.0, "p99": 30.0, "samples": 5, "steps_p50": 2, "steps_p99": 7},
             "step_ms": {"p50": 11.0, "p99": 25.0, "max": 40.0, "samples": 9},
             "ttft_histogram": {"le": {"0.01": 1, "0.02": 4, "+Inf": 5}, "sum": 0.3, "count": 5},
             "ttft_steps_histogram": {"le": {"1": 3, "2": 5, "+Inf": 5}, "sum": 7, "count": 5},
             "counters": {"window_hits": 7, "window_misses": 2},
             "kv": {"kv_blocks_used": 5, "kv_blocks_cached": 3, "kv_blocks_max": 100, "kv_bytes_used": 5 << 20},
             "prefix_cache": {"prefix_hits": 4, "prefix_misses": 6, "prefix_reused_tokens": 640},
             "kv_positions_used": 14, "kv_positions_allocated": 96}
    service = SimpleNamespace(stats=lambda: stats)
    body, content_type = Metrics(service).exposition()
    assert content_type.startswith("text/plain")
    values = {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    assert values["kestrel_window_hits_total"] == 7 and values["kestrel_window_misses_total"] == 2
    assert values["kestrel_kv_positions_used"] == 14 and values["kestrel_kv_positions_allocated"] == 96
    assert values["kestrel_ttft_p99_seconds"] == pytest.approx(0.03) and values["kestrel_queue_depth"] == 2
    assert values["kestrel_ttft_steps_p50"] == 2 and values["kestrel_ttft_steps_p99"] == 7
    buckets = {(s.name, s.labels.get("le")): s.value for f in text_string_to_metric_families(body.decode())
               for s in f.samples if s.name.startswith(("kestrel_ttft_seconds", "kestrel_ttft_steps_"))}
    assert buckets[("kestrel_ttft_seconds_bucket", "0.02")] == 4 and buckets[("kestrel_ttft_seconds_count", None)] == 5
    assert buckets[("kestrel_ttft_seconds_sum", None)] == pytest.approx(0.3)
    assert buckets[("kestrel_ttft_steps_bucket", "1")] == 3 and buckets[("kestrel_ttft_steps_bucket", "+Inf")] == 5
    assert values["kestrel_step_p99_seconds"] == pytest.approx(0.025) and values["kestrel_step_max_seconds"] == 0.04
    assert values["kestrel_decode_step_seconds_total"] == 0.5 and values["kestrel_mean_batch"] == 4.0
    assert values["kestrel_kv_blocks_used"] == 5 and values["kestrel_kv_blocks_max"] == 100
    assert values["kestrel_prefix_hits_total"] == 4 and values["kestrel_prefix_reused_tokens_total"] == 640


@pytest.mark.parametrize("field, value", [("user", 5), ("user", ["a"]), ("stream_options", 0),
                                          ("stream_options", []), ("stream_options", {"include_usage": "yes"}),
                                          ("stream_options", {"other": True}), ("echo", 0), ("echo", "no")])
def test_user_stream_options_and_echo_are_type_checked(field, value):
    with pytest.raises(APIError) as e:
        parse_request({"model": "m", "prompt": "x", field: value}, chat=False, vocab_size=256)
    assert e.value.status == 400 and e.value.param == field and e.value.code == "invalid_type"
    ok = parse_request({"model": "m", "prompt": "x", "user": "u", "echo": False,
                        "stream_options": {"include_usage": True}}, chat=False, vocab_size=256)
    assert ok.include_usage


def test_the_idle_timeout_is_on_by_default():
    from kestrel_stream.cli.main import build_parser
    from kestrel_stream.serve.limits import limits_from_args
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert limits_from_args(args).idle_timeout_s == 600


def test_prefix_counters_in_metrics_move_a_minute_at_a_time():
    """A scrape right after a request does not tell whether it reused a cached prefix."""
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from kestrel_stream.serve.http.metrics import PREFIX_WINDOW_S, Metrics
    prefix = {"prefix_hits": 1, "prefix_misses": 0, "prefix_reused_tokens": 32}
    stats = {"requests": 0, "errors": 0, "decode_steps": 0, "decode_step_s": 0.0, "sessions": 0, "max_sessions": 1,
             "prefix_cache": prefix}
    now = [100.0]
    metrics = Metrics(SimpleNamespace(stats=lambda: stats), clock=lambda: now[0])

    def reused() -> float:
        body = metrics.exposition()[0].decode()
        return {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples}[
            "kestrel_prefix_reused_tokens_total"]
    assert reused() == 32
    prefix.update(prefix_hits=2, prefix_reused_tokens=64)      # another request reused 32 positions
    now[0] += 1.0
    assert reused() == 32
    now[0] += PREFIX_WINDOW_S
    assert reused() == 64


def body_of(*parts: bytes) -> Body:
    body = Body()
    for part in parts:
        body.add(part)
    return body


def test_a_body_is_decoded_across_its_chunks_and_a_bad_byte_is_named_where_it_is():
    text = json.dumps({"prompt": "h\u00e9llo w\u00f6rld \u2603"}, ensure_ascii=False).encode()
    for cut in range(len(text) + 1):           # every split, inside a character's bytes too
        assert body_of(text[:cut], text[cut:]).json() == {"prompt": "h\u00e9llo w\u00f6rld \u2603"}
    for parts, where in [((b"abc", b"\xff"), 3), ((b"ab\xc3", b"("), 2), ((b"ab\xc3",), 2),
                         ((b"a" * 10, b"b\xe2\x82", b"x"), 11)]:
        with pytest.raises(APIError) as refused:
            body_of(*parts).text()
        assert refused.value.code == "invalid_json" and f"at byte {where} " in refused.value.message


def test_a_connection_cancelled_at_shutdown_leaves_no_traceback_and_other_errors_still_reach_the_log():
    """asyncio before 3.12 (CPython gh-113538) logged a traceback from StreamReaderProtocol's done-callback when a
    connection's task was cancelled (hypercorn cancels them when it stops): a SIGTERM test saw it under load."""
    import asyncio

    from kestrel_stream.serve.http.server import quiet_cancelled_connections

    async def scenario() -> list:
        loop = asyncio.get_running_loop()
        seen = []
        loop.set_exception_handler(lambda loop, context: seen.append(context))
        quiet_cancelled_connections(loop)
        quiet_cancelled_connections(loop)              # twice: one handler
        tasks = []

        async def connection(reader, writer):
            tasks.append(asyncio.current_task())
            try:
                await reader.read(1)
            finally:
                writer.close()

        server = await asyncio.start_server(connection, "127.0.0.1", 0)
        reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
        while not tasks:
            await asyncio.sleep(0.01)
        tasks[0].cancel()
        for _ in range(20):                            # the done-callback runs a loop turn or two later
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        await server.wait_closed()
        loop.call_exception_handler({"message": "something else", "exception": ValueError("kept")})
        return seen

    seen = asyncio.run(scenario())
    assert [str(c.get("exception")) for c in seen] == ["kept"], seen
