"""CI: bench/cpu_batch_decode.py's rows on a tiny model file (the CPU engine)."""
from __future__ import annotations

from bench import cpu_batch_decode
from kestrel_stream.loading.presets import make_model
import kestrel_stream as ks


def test_rows_for_one_and_three_sessions(tmp_path):
    engine = ks.load(str(make_model(tmp_path / "m", "tiny", seed=1, dtype="f32")), device="cpu")
    rows = [cpu_batch_decode.batch_row(engine, s, prompt=5, steps=2, rounds=2) for s in (1, 3)]
    assert [r["sessions"] for r in rows] == [1, 3]
    assert all(r["ms_a_step"] > 0 and len(r["rounds_ms"]) == 2 for r in rows)
    for r in rows:                   # ms a step: the median round's; tok/s: the sessions over it
        assert r["tok_s"] > 0 and min(r["rounds_ms"]) - 0.01 <= r["ms_a_step"] <= max(r["rounds_ms"]) + 0.01
