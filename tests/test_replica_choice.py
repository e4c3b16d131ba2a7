"""Where a new session goes (scheduler/replica_choice.py): the least-loaded replica, unless one caching a longer prefix
of its prompt is at most the slack busier; never a replica more than the slack above the least load."""
from __future__ import annotations

import random

from scheduler.replica_choice import DEFAULT_PREFIX_SLACK, choose_replica


def test_balance_alone_without_a_cached_prefix():
    assert choose_replica([0, 0], [0, 0]) == (0, False)           # ties: the lower index
    assert choose_replica([3, 1, 2], [0, 0, 0]) == (1, False)
    assert choose_replica([2, 2, 1], [0, 0, 0]) == (2, False)


def test_a_cached_prefix_wins_within_the_slack_and_loses_past_it():
    assert choose_replica([4, 0], [64, 0], slack=4) == (0, True)      # 4 busier: still within
    assert choose_replica([5, 0], [64, 0], slack=4) == (1, False)     # 5 busier: balance wins
    assert choose_replica([1, 0], [64, 0], slack=0) == (1, False)     # slack 0: the prefix only breaks ties
    assert choose_replica([0, 0], [0, 64], slack=0) == (1, True)


def test_the_longest_prefix_then_the_lower_load():
    assert choose_replica([2, 1, 0], [32, 64, 0]) == (1, True)
    assert choose_replica([2, 1, 0], [64, 64, 0]) == (1, True)
    assert choose_replica([0, 1], [64, 64]) == (0, False)             # the least loaded caches it as well
    assert choose_replica([9, 1, 0], [128, 64, 0], slack=4) == (1, True)   # the longest is too busy


def test_never_more_than_the_slack_above_the_least_load():
    rng = random.Random(7)
    for _ in range(2000):
        n = rng.randint(1, 5)
        loads = [rng.randint(0, 12) for _ in range(n)]
        cached = [rng.choice([0, 0, 16, 32, 48]) for _ in range(n)]
        slack = rng.choice([0, 1, DEFAULT_PREFIX_SLACK, 8])
        index, by_prefix = choose_replica(loads, cached, slack)
        assert loads[index] <= min(loads) + slack
        near = [i for i in range(n) if loads[i] <= min(loads) + slack]
        assert cached[index] == max(cached[i] for i in near)
        assert by_prefix == (index != min(range(n), key=lambda i: (loads[i], i)))     # the prefix moved it
