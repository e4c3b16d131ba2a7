"""scheduler/link_tuner.py: the link share's count (KESTREL_LINK_EXPERTS=auto) chosen by measuring -- counts
tried from 0 up, a few steps each, the climb stopped at the first clearly slower count, the fastest kept,
measured again after `retune` steps."""
from __future__ import annotations

from scheduler.link_tuner import LinkTuner


def drive(tuner: LinkTuner, us_at: dict[int, float], steps: int) -> list[int]:
    """Run `steps` steps of 48 calls each at the tuner's count, each call taking us_at[count]; the counts used."""
    used = []
    for _ in range(steps):
        used.append(tuner.count)
        tuner.observe(48, int(48 * us_at[tuner.count] * 1e3))
    return used


def test_climbs_until_slower_and_keeps_the_fastest():
    tuner = LinkTuner(most=4, steps=2)
    used = drive(tuner, {0: 516.0, 1: 470.0, 2: 430.0, 3: 445.0, 4: 560.0}, 12)
    assert used[:8] == [0, 0, 1, 1, 2, 2, 3, 3]              # 3 is 3.5 % slower than 2: the climb stops
    assert tuner.settled and tuner.count == 2 and used[8:] == [2, 2, 2, 2]
    assert set(tuner.tried) == {0, 1, 2, 3}                   # 4 never tried: 3 was already slower
    assert "kept 2" in tuner.describe() and "3: 445 us" in tuner.describe()


def test_none_when_the_link_never_pays():
    tuner = LinkTuner(most=4, steps=1)
    drive(tuner, {0: 300.0, 1: 340.0, 2: 380.0, 3: 420.0, 4: 460.0}, 5)
    assert tuner.settled and tuner.count == 0 and set(tuner.tried) == {0, 1}


def test_a_count_within_the_margin_keeps_climbing():
    tuner = LinkTuner(most=3, steps=1, margin=0.02)
    drive(tuner, {0: 500.0, 1: 400.0, 2: 405.0, 3: 390.0}, 6)
    assert tuner.tried.keys() == {0, 1, 2, 3} and tuner.count == 3


def test_steps_without_armed_calls_measure_nothing_and_retune_restarts():
    tuner = LinkTuner(most=2, steps=1, retune=3)
    tuner.observe(0, 0)                                       # an eager step: no armed call
    assert tuner.count == 0 and not tuner.tried
    drive(tuner, {0: 500.0, 1: 400.0, 2: 450.0}, 3)
    assert tuner.settled and tuner.count == 1
    assert tuner.changed and tuner.kept == 1
    drive(tuner, {0: 500.0, 1: 400.0, 2: 450.0}, 3)          # `retune` steps later: from 0 again
    assert not tuner.settled and tuner.count == 0 and not tuner.tried
    drive(tuner, {0: 500.0, 1: 400.0, 2: 450.0}, 3)          # the same count kept: nothing to say
    assert tuner.settled and tuner.count == 1 and not tuner.changed
    drive(tuner, {0: 300.0, 1: 400.0, 2: 450.0}, 3 + 2)      # later, the link no longer pays
    assert tuner.settled and tuner.count == 0 and tuner.changed and tuner.kept == 0


def test_a_step_size_of_several_tokens_names_its_share():
    tuner = LinkTuner(most=7, steps=1, tokens=16, chosen=8)
    drive(tuner, {0: 900.0, 1: 800.0, 2: 700.0, 3: 650.0, 4: 640.0, 5: 700.0, 6: 0.0, 7: 0.0}, 6)
    assert tuner.settled and tuner.count == 4
    assert tuner.describe().startswith("link share at 16 tokens: kept 4 / 8 of the host's experts")
