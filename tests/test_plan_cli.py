"""`kestrel-stream plan` as a user runs it: every weight of a real checkpoint listed exactly once."""
from __future__ import annotations

import json
from collections import Counter

import pytest
from safetensors import safe_open

from test_cli import run_cli


def checkpoint_tensor_names(model_dir) -> set:
    with safe_open(str(model_dir / "model.safetensors"), framework="numpy") as f:
        return set(f.keys())


@pytest.mark.parametrize("mode,batch", [("gated", 1), ("gated", 32), ("gpu", 1), ("layers=1", 1), ("cpu", 1)])
@pytest.mark.parametrize("fixture", ["tiny_model", "llama_model"])
def test_plan_lists_every_checkpoint_weight_once(request, fixture, mode, batch):
    model_dir = request.getfixturevalue(fixture)
    proc = run_cli("plan", "--model", str(model_dir), "--mode", mode, "--batch", str(batch),
                   "--profile", "h200", "--json")
    plan = json.loads(proc.stdout)
    listed = Counter(row["weight"] for row in plan["weights"])
    assert set(listed) == checkpoint_tensor_names(model_dir)
    assert max(listed.values()) == 1
    assert all(row["side"] in ("cpu", "gpu") and row["reason"] for row in plan["weights"])
    if mode == "gpu":
        assert plan["counters"]["syncs_per_step"] == 1


def test_plan_text_names_lm_head_and_the_gate(tiny_model):
    text = run_cli("plan", "--model", str(tiny_model), "--mode", "gated", "--profile", "seed").stdout
    assert "model.embed_tokens.weight" in text and "lm_head" in text
    assert "round trip" in text


def test_plan_rejects_bad_batch(tiny_model):
    proc = run_cli("plan", "--model", str(tiny_model), "--batch", "0", check=False)
    assert proc.returncode != 0 and "at least one token" in proc.stderr
