"""The step batcher under a token budget: decode first, prompts in chunks, fairness and the step log."""
from __future__ import annotations

import pytest

from scheduler.batcher import StepBatcher
from scheduler.step_log import RECENT_TTFT, percentile


def shape(step):
    return [(c.session_key, c.start, c.count, c.final) for c in step]


def test_a_long_prompt_is_cut_into_chunks_behind_every_decode():
    batcher = StepBatcher(max_batch=8, step_tokens=16)
    batcher.add("p", "prompt", 0.0, tokens=40)
    for key in "ab":
        batcher.add(key, key, 0.0)
    assert shape(batcher.take()) == [("a", 0, 1, True), ("b", 0, 1, True), ("p", 0, 14, False)]
    assert batcher.depth == 1 and batcher.queued_tokens() == 26
    for key in "ab":
        batcher.add(key, key + "2", 0.001)
    assert batcher.ready(0.001)                     # the prompt's window ended: its next chunk goes at once
    assert shape(batcher.take()) == [("a", 0, 1, True), ("b", 0, 1, True), ("p", 14, 14, False)]
    assert shape(batcher.take()) == [("p", 28, 12, True)]
    assert batcher.depth == 0 and not batcher.take()
    stats = batcher.stats()
    assert (stats["steps"], stats["mixed_steps"], stats["max_tokens_in_step"], stats["prompt_chunks"]) == (3, 2, 16, 3)


def test_prompts_go_oldest_first_and_share_what_the_budget_leaves():
    batcher = StepBatcher(max_batch=8, step_tokens=10)
    batcher.add("old", 1, 0.0, tokens=7)
    batcher.add("new", 2, 0.1, tokens=7)
    assert shape(batcher.take()) == [("old", 0, 7, True), ("new", 0, 3, False)]
    assert shape(batcher.take()) == [("new", 3, 4, True)]


def test_a_request_that_runs_whole_is_never_cut_and_decodes_leave_it_room():
    """A token tree's rows see each other in one step: it waits for a step with room for all of it, the
    prompts behind it go on, and as the oldest prompt it gets its room from the decodes."""
    batcher = StepBatcher(max_batch=8, step_tokens=10)
    batcher.add("old", 1, 0.0, tokens=6)
    batcher.add("tree", 2, 0.1, tokens=6, whole=True)
    batcher.add("new", 3, 0.2, tokens=3)
    assert shape(batcher.take()) == [("old", 0, 6, True), ("new", 0, 3, True)]
    assert shape(batcher.take()) == [("tree", 0, 6, True)]
    batcher.add("tree", 4, 0.3, tokens=8, whole=True)
    for key in "abcdef":
        batcher.add(key, key, 0.3)
    assert shape(batcher.take()) == [("a", 0, 1, True), ("b", 0, 1, True), ("tree", 0, 8, True)]
    with pytest.raises(ValueError, match="runs whole fits a step"):
        batcher.add("big", 5, 0.4, tokens=11, whole=True)


def test_a_session_runs_one_request_at_a_time_in_order():
    batcher = StepBatcher(max_batch=8, step_tokens=8)
    batcher.add("a", "prompt", 0.0, tokens=12)
    batcher.add("a", "decode", 0.0)
    assert shape(batcher.take()) == [("a", 0, 8, False)]
    assert shape(batcher.take()) == [("a", 8, 4, True)]
    assert [c.payload for c in batcher.take()] == ["decode"]


def test_decodes_that_fill_the_step_leave_a_waiting_prompt_room():
    batcher = StepBatcher(max_batch=4, step_tokens=64)
    for key in "abcd":
        batcher.add(key, key, 0.0)
    batcher.add("p", "prompt", 0.0, tokens=100)
    step = batcher.take()
    assert shape(step) == [("a", 0, 1, True), ("b", 0, 1, True), ("c", 0, 1, True), ("p", 0, 61, False)]
    assert batcher.stats()["max_decode_wait_steps"] == 0
    assert shape(batcher.take())[0] == ("d", 0, 1, True)       # the decode left out goes first next time
    assert batcher.stats()["max_decode_wait_steps"] == 1


def test_budget_smaller_than_the_decodes_runs_them_over_steps():
    batcher = StepBatcher(max_batch=32, step_tokens=3)
    for key in "abcde":
        batcher.add(key, key, 0.0)
    assert [c.payload for c in batcher.take()] == ["a", "b", "c"]
    assert [c.payload for c in batcher.take()] == ["d", "e"]


@pytest.mark.parametrize("kwargs", [{"max_batch": 1, "step_tokens": 5}, {"max_batch": 4, "step_tokens": 1}])
def test_one_place_a_step_goes_strictly_oldest_first(kwargs):
    batcher = StepBatcher(**kwargs)
    batcher.add("p", "prompt", 0.0, tokens=6)
    batcher.add("a", "a", 0.1)
    budget = kwargs["step_tokens"]
    assert shape(batcher.take()) == [("p", 0, min(budget, 1 if kwargs["max_batch"] > 1 else 5), False)]


def test_a_failed_chunk_drops_the_rest_of_its_prompt():
    batcher = StepBatcher(max_batch=4, step_tokens=4)
    batcher.add("p", "prompt", 0.0, tokens=10)
    batcher.add("a", "a", 0.0)
    chunk = [c for c in batcher.take() if c.session_key == "p"][0]
    batcher.drop(chunk.pending)
    batcher.add("a", "a2", 0.0)
    assert shape(batcher.take()) == [("a", 0, 1, True)]
    assert batcher.depth == 0


def test_a_closed_session_leaves_its_half_run_prompt_to_be_answered():
    batcher = StepBatcher(max_batch=4, step_tokens=4)
    batcher.add("p", "prompt", 0.0, tokens=10)
    batcher.take()
    assert [p.payload for p in batcher.forget("p")] == ["prompt"]
    assert batcher.depth == 0


def test_stats_count_tokens_per_step_and_time_to_first_token():
    batcher = StepBatcher(max_batch=4, step_tokens=8)
    batcher.add("p", "prompt", 0.0, tokens=12)
    batcher.add("a", "a", 0.0)
    batcher.take()
    batcher.take()
    for waited_s in (0.010, 0.020, 0.030):
        batcher.log.first_token(waited_s)
    stats = batcher.stats()
    assert (stats["steps"], stats["tokens_per_step"], stats["max_tokens_in_step"]) == (2, 6.5, 8)
    assert (stats["decode_tokens"], stats["prompt_tokens"], stats["prompt_chunks"]) == (1, 12, 2)
    assert stats["step_tokens"] == 8 and stats["queue_depth"] == 0
    assert stats["ttft_ms"] == {"p50": 20.0, "p99": 30.0, "samples": 3}
    assert stats["step_ms"]["samples"] == 0
    assert percentile([], 0.5) == 0.0


def test_stats_say_how_many_steps_a_prompt_took_and_how_long_steps_ran():
    """A prompt's first token counted in steps (formed from its arrival, its own included) beside its time, and
    the steps' run times: many steps is queueing, one long step the prompt's own work."""
    batcher = StepBatcher(max_batch=4, step_tokens=8)
    for waited_s, steps in ((0.010, 1), (0.020, 1), (0.090, 6)):
        batcher.log.first_token(waited_s, steps)
    for seconds in (0.012, 0.011, 0.013, 0.040):
        batcher.log.ran(seconds)
    stats = batcher.stats()
    assert stats["ttft_ms"] == {"p50": 20.0, "p99": 90.0, "samples": 3, "steps_p50": 1, "steps_p99": 6}
    assert stats["step_ms"] == {"p50": 13.0, "p99": 40.0, "max": 40.0, "samples": 4}


def test_every_prompt_is_counted_in_histograms_that_two_scrapes_subtract():
    """Besides the latest prompts' percentiles, every prompt since the start by bucket (cumulative, Prometheus'
    `le`): a bound counts the values at or under it, the window of latest samples does not limit them."""
    log = StepBatcher(max_batch=4, step_tokens=8).log
    for waited_s, steps in ((0.010, 1), (0.020, 1), (0.0201, 2), (45.0, 200)):
        log.first_token(waited_s, steps)
    ttft, steps = log.stats()["ttft_histogram"], log.stats()["ttft_steps_histogram"]
    assert ttft["le"]["0.005"] == 0 and ttft["le"]["0.01"] == 1 and ttft["le"]["0.02"] == 2
    assert ttft["le"]["0.03"] == 3 and ttft["le"]["30"] == 3 and ttft["le"]["+Inf"] == 4 == ttft["count"]
    assert ttft["sum"] == pytest.approx(45.0501)
    assert steps["le"]["1"] == 2 and steps["le"]["2"] == 3 and steps["le"]["128"] == 3 and steps["le"]["+Inf"] == 4
    assert steps["sum"] == 204
    for _ in range(RECENT_TTFT):
        log.first_token(0.001, 1)
    assert log.stats()["ttft_histogram"]["count"] == RECENT_TTFT + 4
    assert log.stats()["ttft_ms"]["samples"] == RECENT_TTFT


@pytest.mark.parametrize("kwargs", [{"step_tokens": 0}, {"step_tokens": -3}])
def test_a_budget_below_one_token_is_refused(kwargs):
    with pytest.raises(ValueError, match="step_tokens"):
        StepBatcher(**kwargs)


def test_the_default_budget_is_larger_on_a_gpu_than_on_the_host():
    from scheduler.batcher import DEFAULT_STEP_TOKENS, DEVICE_STEP_TOKENS, default_step_tokens
    assert default_step_tokens(on_device=False) == DEFAULT_STEP_TOKENS == 256
    assert default_step_tokens(on_device=True) == DEVICE_STEP_TOKENS == 2048
    assert StepBatcher().step_tokens == DEFAULT_STEP_TOKENS


def test_shortest_first_lets_a_short_prompt_pass_a_long_one_until_the_long_one_has_waited():
    """prompt_order="shortest": the fewest tokens left take the budget first (ties: the older); a prompt that
    has waited prompt_age_steps steps since it came goes before them; decodes still come first and leave the
    first prompt its token."""
    batcher = StepBatcher(max_batch=8, step_tokens=10, prompt_order="shortest", prompt_age_steps=3)
    batcher.add("long", 1, 0.0, tokens=40)
    batcher.add("short", 2, 0.1, tokens=4)
    batcher.add("tie", 3, 0.2, tokens=4)
    assert shape(batcher.take()) == [("short", 0, 4, True), ("tie", 0, 4, True), ("long", 0, 2, False)]
    batcher.add("s2", 4, 0.3, tokens=5)
    assert shape(batcher.take()) == [("s2", 0, 5, True), ("long", 2, 5, False)]
    batcher.add("s3", 5, 0.4, tokens=6)
    assert shape(batcher.take()) == [("s3", 0, 6, True), ("long", 7, 4, False)]
    batcher.add("s4", 6, 0.5, tokens=6)              # "long" came 3 steps ago: it goes first now
    assert shape(batcher.take()) == [("long", 11, 10, False)]
    for key in "abcdefghi":
        batcher.add(key, key, 0.6)
    # decodes first, leaving the first prompt in order (the aged one) a session: seven of them, then its chunk
    assert shape(batcher.take()) == [(key, 0, 1, True) for key in "abcdefg"] + [("long", 21, 3, False)]


def test_oldest_first_is_the_default_and_an_unknown_order_is_refused():
    assert StepBatcher().prompt_order == "oldest" and StepBatcher().stats()["prompt_order"] == "oldest"
    with pytest.raises(ValueError, match="prompt_order must be one of oldest, shortest"):
        StepBatcher(prompt_order="newest")
    with pytest.raises(ValueError, match="prompt_age_steps"):
        StepBatcher(prompt_order="shortest", prompt_age_steps=0)
