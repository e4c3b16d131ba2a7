"""The step batcher's policy: when a batch goes, what it holds, and what a closed session leaves behind."""
from __future__ import annotations

import pytest

from scheduler.batcher import StepBatcher


def test_lone_session_goes_at_once():
    batcher = StepBatcher(max_batch=8, window_s=0.002)
    batcher.add("a", 1, now_s=10.0)
    assert batcher.ready(10.0)                      # no other active session to wait for
    assert [p.payload for p in batcher.take()] == [1]


def test_waits_for_active_sessions_until_the_window_ends():
    batcher = StepBatcher(max_batch=8, window_s=0.002)
    for key in "abc":
        batcher.add(key, key, now_s=10.0)
    batcher.take()
    batcher.add("a", "a2", now_s=10.010)
    assert not batcher.ready(10.0105)               # b and c decoded recently: worth waiting for
    assert batcher.deadline_s() == pytest.approx(10.012)
    batcher.add("b", "b2", now_s=10.011)
    assert not batcher.ready(10.011)
    assert batcher.ready(10.012)                    # the window of the oldest request ended
    batcher.add("c", "c2", now_s=10.0111)
    assert batcher.ready(10.0112)                   # every active session is queued
    assert [p.payload for p in batcher.take()] == ["a2", "b2", "c2"]


def test_idle_sessions_stop_counting_after_the_horizon():
    batcher = StepBatcher(max_batch=8, window_s=0.5, active_horizon_s=0.05)
    batcher.add("idle", 0, now_s=0.0)
    batcher.take()
    batcher.add("a", 1, now_s=1.0)
    assert batcher.ready(1.0)


def test_a_session_is_lone_until_another_asks_within_the_horizon():
    batcher = StepBatcher(max_batch=8, window_s=0.002, active_horizon_s=0.05)
    assert batcher.lone("a", 1.0)
    batcher.run_alone("a", 1.0)                     # run outside the queue: a batch of one, "a" active
    assert batcher.lone("a", 1.01) and not batcher.lone("b", 1.01)
    assert batcher.stats()["batches"] == 1 and batcher.depth == 0
    batcher.add("b", "b1", now_s=1.02)
    assert not batcher.lone("a", 1.03)              # b asked 10 ms ago: a's next step may batch with b's
    assert batcher.lone("a", 1.08)                  # b went quiet past the horizon


def test_full_batch_goes_and_a_session_appears_once():
    batcher = StepBatcher(max_batch=2, window_s=1.0)
    for key, payload in [("a", 1), ("a", 2), ("b", 3), ("c", 4)]:
        batcher.add(key, payload, now_s=0.0)
    assert batcher.ready(0.0)
    assert [p.payload for p in batcher.take()] == [1, 3]
    assert [p.payload for p in batcher.take()] == [2, 4]     # a's second step keeps its order
    assert batcher.take() == [] and batcher.depth == 0
    assert batcher.stats()["mean_batch"] == 2.0


def test_forget_returns_queued_requests_of_a_closed_session():
    batcher = StepBatcher(max_batch=4, window_s=1.0)
    batcher.add("a", 1, now_s=0.0)
    batcher.add("b", 2, now_s=0.0)
    batcher.add("a", 3, now_s=0.0)
    assert [p.payload for p in batcher.forget("a")] == [1, 3]
    assert [p.payload for p in batcher.take()] == [2]
    assert batcher.active_sessions(0.0) == 1


def test_max_batch_one_means_no_batching():
    batcher = StepBatcher(max_batch=1, window_s=0.0)
    batcher.add("a", 1, now_s=0.0)
    batcher.add("b", 2, now_s=0.0)
    assert len(batcher.take()) == 1 and batcher.depth == 1


@pytest.mark.parametrize("kwargs", [{"max_batch": 0}, {"window_s": -1.0}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        StepBatcher(**kwargs)
