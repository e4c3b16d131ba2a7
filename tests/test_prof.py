"""The per-stage profile table: its arithmetic, and --prof printing it at exit."""
from __future__ import annotations

import pytest

from kestrel_stream.obs import prof

from test_cli import run_cli


@pytest.fixture
def clean_prof():
    prof.reset()
    yield
    prof.reset()


def test_averages_and_shares_follow_the_recorded_calls(clean_prof):
    prof.record_call({"cache_probe": 1.0, "h2d": 10.0, "gemm": 60.0, "d2h+sync": 29.0})
    prof.record_call({"cache_probe": 1.0, "upload": 100.0, "h2d": 10.0, "gemm": 60.0, "d2h+sync": 29.0}, uploads=1)
    snap = prof.snapshot()
    assert (snap["calls"], snap["hits"], snap["uploads"]) == (2, 1, 1)
    assert snap["avg_us"]["gemm"] == 60.0 and snap["avg_us"]["upload"] == 50.0
    assert snap["total_us_per_call"] == pytest.approx(150.0)
    assert snap["share_pct"]["gemm"] == pytest.approx(40.0)
    assert sum(snap["share_pct"].values()) == pytest.approx(100.0)
    text = prof.report()
    assert "calls=2 (hits=1 uploads=1)" in text and "gemm=60.0" in text and "gemm=40.0%" in text


def test_unknown_stage_is_refused(clean_prof):
    with pytest.raises(AssertionError, match="unknown profile stages"):
        prof.record_call({"matmul": 1.0})


def test_prof_flag_prints_the_table_at_exit(tiny_model):
    proc = run_cli("generate", "--model", str(tiny_model), "--prompt-ids", "1,2", "--max-new-tokens", "3",
                   "--device", "cpu", "--prof")
    assert "[kestrel-prof] calls=0" in proc.stderr
    assert "cache_probe=" in proc.stderr and "d2h+sync=" in proc.stderr
