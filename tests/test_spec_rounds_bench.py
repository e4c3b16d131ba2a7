"""bench/spec_rounds.py on the CPU engine: a tiny model drafting for itself keeps every draft; each round's parts
are timed (a round holds its draft and its verify pass), and the pass alone comes at every size."""
from __future__ import annotations

import json

import pytest

from bench import spec_rounds


def test_a_model_drafting_for_itself_times_each_rounds_parts(tiny_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox\n---\nOnce upon a time")
    rows = spec_rounds.main(["--target", str(tiny_model), "--draft", str(tiny_model), "--device", "cpu",
                             "--mode", "auto", "--prompts", str(prompts), "--no-chat", "-n", "10",
                             "--draft-max", "3", "-c", "512", "--out", str(tmp_path / "out")])
    spec = [r for r in rows if r["kind"] == "spec"]
    assert [r["prompt"] for r in spec] == [0, 1]
    for r in spec:
        parts = r["parts"]
        assert r["tokens_per_pass"] > 1 and r["spec_tok_s"] > 0 and r["plain_tok_s"] > 0
        # [count, sum ms, median ms]: every round planned (drafted) and verified; the round holds both
        assert parts["round"][0] == parts["plan"][0] >= parts["verify"][0] > 0
        assert parts["round"][1] >= parts["plan"][1] + parts["verify"][1] - 1e-6
    passes = [r for r in rows if r["kind"] == "pass"]
    assert [r["tokens"] for r in passes] == list(spec_rounds.PASS_TOKENS)
    assert all(0 < r["best_ms"] <= r["median_ms"] for r in passes)
    assert not any(r["kind"] == "draft_chain" for r in rows)         # the CPU engine does not chain steps
    assert {r["tokens"] for r in rows if r["kind"] == "draft_catch_up"} == {1, 8}
    saved = json.loads(next((tmp_path / "out").glob("*-spec-rounds.json")).read_text())
    assert len(saved["rows"]) == len(rows)
    # the bench's timing patches are gone: the decoder and the draft stream are as they were
    from kestrel_stream.spec import decoder, draft_model
    assert "timed" not in decoder.SpecDecoder.next_tokens.__qualname__
    assert all(getattr(decoder.SpecDecoder, name).__qualname__.startswith("SpecDecoder.")
               for name in ("next_tokens", "plan", "verdict", "keep", "record"))
    assert draft_model.DraftModelStream._catch_up.__qualname__ == "DraftModelStream._catch_up"


def test_a_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(Exception, match="missing"):
        spec_rounds.main(["--target", str(tmp_path / "missing"), "--draft", str(tmp_path / "missing"),
                          "--device", "cpu"])
