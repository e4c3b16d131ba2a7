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


@pytest.mark.parametrize("mode,batch", [("gated", 1), ("gated", 32), ("gpu", 1), ("layers=1", 1), ("layers=1+head", 1),
                                        ("cpu", 1)])
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
    if mode.startswith("layers"):     # the output (lm_head: the tied embedding or its own weight) by the mode
        head = {row["side"] for row in plan["weights"] if row["op"] in ("final_norm", "lm_head")}
        assert head == ({"gpu"} if mode.endswith("+head") else {"cpu"}), (mode, head)


def test_plan_text_names_lm_head_and_the_gate(tiny_model):
    text = run_cli("plan", "--model", str(tiny_model), "--mode", "gated", "--profile", "seed").stdout
    assert "model.embed_tokens.weight" in text and "lm_head" in text
    assert "round trip" in text


def test_plan_rejects_bad_batch(tiny_model):
    proc = run_cli("plan", "--model", str(tiny_model), "--batch", "0", check=False)
    assert proc.returncode == 2 and "argument --batch: must be >= 1, got 0" in proc.stderr


@pytest.fixture(scope="module")
def qwen3_17b_config(tmp_path_factory):
    """A checkpoint directory with only the qwen3-1.7b config.json: plan needs no weights."""
    from kestrel_stream.loading.presets import PRESETS
    directory = tmp_path_factory.mktemp("qwen3-1.7b")
    (directory / "config.json").write_text(json.dumps(PRESETS["qwen3-1.7b"].to_hf_dict()))
    return directory


def test_plan_shows_the_residency_window_under_a_budget(qwen3_17b_config):
    args = ["plan", "--model", str(qwen3_17b_config), "--mode", "gpu", "--profile", "h200", "--max-seq-len", "256",
            "--max-batch", "1", "--max-sessions", "1", "--json"]
    window = json.loads(run_cli(*args, "--vram-budget", "1GiB").stdout)["window"]
    assert window["arena_bytes"] <= window["budget_bytes"] == 2**30
    assert 0 < window["resident_bytes"] and window["streamed_bytes_per_step"] > 0
    everything = json.loads(run_cli(*args, "--vram-budget", "8GiB").stdout)["window"]
    assert everything["streamed_bytes_per_step"] == 0
    weights = everything["resident_bytes"]
    assert window["resident_bytes"] + window["streamed_bytes_per_step"] >= 0.95 * weights
    too_small = run_cli(*args, "--vram-budget", "100MB", check=False)
    assert too_small.returncode != 0 and "too small for gpu mode" in too_small.stderr
    assert "Traceback" not in too_small.stderr


@pytest.fixture(scope="module")
def qwen3_30b_a3b_config(tmp_path_factory):
    from kestrel_stream.loading.presets import PRESETS
    directory = tmp_path_factory.mktemp("qwen3-30b-a3b")
    (directory / "config.json").write_text(json.dumps(PRESETS["qwen3-30b-a3b"].to_hf_dict()))
    return directory


def test_plan_offload_of_a_moe_model_keeps_attention_resident_and_the_experts_on_the_host(qwen3_30b_a3b_config):
    """Qwen3-30B-A3B under 4 GiB: every expert listed once, on the host but for those the room left keeps
    resident (with their layer's router); qkv, o and lm_head on the GPU; the placement of each step size and
    the resident experts on stderr."""
    proc = run_cli("plan", "--model", str(qwen3_30b_a3b_config), "--mode", "offload", "--vram-budget", "4GiB",
                   "--profile", "h200", "--max-seq-len", "4096", "--json")
    plan = json.loads(proc.stdout)
    listed = Counter(row["weight"] for row in plan["weights"])
    assert max(listed.values()) == 1
    experts = [row for row in plan["weights"] if row["group"] == "experts"]
    on_gpu = [row for row in experts if row["side"] == "gpu"]
    assert len(experts) == 48 * 128 * 3 and 0 < len(on_gpu) < len(experts) / 4
    assert {row["op"].split(".")[1] for row in on_gpu} == {"experts[gpu]"}
    assert {row["side"] for row in plan["weights"] if row["group"] in ("qkv", "o", "lm_head", "router")} == {"gpu"}
    assert "offload, M=1: layers " + "A" * 48 in proc.stderr and "offload, M=64:" in proc.stderr
    assert "experts on the host" in proc.stderr and f"resident experts (frequency): {len(on_gpu) // 3} of" in proc.stderr
    window = plan["window"]                   # mode offload's own memory plan, not gpu mode's window
    assert 1.2e9 < window["resident_bytes"] < 1.4e9 and window["streamed_bytes_per_step"] == 0
    assert window["arena_bytes"] + window["kv_bytes"] <= window["budget_bytes"] == 4 * 2**30


def test_plan_offload_with_spec_prices_the_passes_with_the_offload_placement(qwen3_30b_a3b_config):
    """plan --mode offload --spec lookup: the pass-time curve is each step size's offload placement's own
    prediction (the figure its stderr line gives), not a plan without a placement."""
    proc = run_cli("plan", "--model", str(qwen3_30b_a3b_config), "--mode", "offload", "--vram-budget", "4GiB",
                   "--profile", "h200", "--max-seq-len", "4096", "--spec", "lookup", "--json")
    speculation = json.loads(proc.stdout)["speculation"]
    assert speculation is not None and speculation["text"].startswith("speculation: prompt lookup")
    one = [line for line in proc.stderr.splitlines() if line.startswith("offload, M=1:")]
    assert one
    predicted_ms = float(proc.stderr.split("offload, M=1:")[1].split("predicted ")[1].split(" ms")[0])
    assert f"1: {predicted_ms:.3g}" in speculation["text"]


@pytest.mark.parametrize("available_gb", [60, 120])
def test_plan_offload_names_the_experts_ring_s_pinned_host_memory(qwen3_30b_a3b_config, monkeypatch, capsys,
                                                                  available_gb):
    """Qwen3-30B-A3B under 8 GiB with prompt chunks of 512: its ring's images pin every expert of 48 layers
    (30.8 GB).  A 64 GB machine (MemAvailable 60 GB less the 32 GB model and 4 GiB) cannot hold them: no
    ring, the line naming both figures; a 128 GB one can: the placement lines and plan --json name them."""
    from kestrel_stream.cli.main import main
    from kestrel_stream.loading.presets import PRESETS
    from kestrel_stream.run import host_memory
    from kestrel_stream.run.device import expert_pool
    monkeypatch.setattr(host_memory, "available_bytes", lambda: available_gb * 10**9)
    monkeypatch.delenv("KESTREL_STREAM_EXPERTS", raising=False)
    monkeypatch.delenv("KESTREL_HOST_RESERVE", raising=False)
    assert main(["plan", "--model", str(qwen3_30b_a3b_config), "--mode", "offload", "--vram-budget", "8GiB",
                 "--profile", "h200", "--max-seq-len", "4096", "--max-batch", "512", "--json"]) == 0
    out, err = capsys.readouterr()
    ring = json.loads(out)["window"]["expert_ring"]
    images = 48 * expert_pool.layer_slot_bytes(PRESETS["qwen3-30b-a3b"])
    if available_gb == 60:
        assert ring["slots"] == 0 and ring["image_bytes"] == 0
        assert "experts' ring left out for host memory" in ring["left_out"] and "take 30.8 GB" in ring["left_out"]
        assert "MemAvailable 60.0 GB" in err and "through a ring of" not in err
    else:
        assert ring["slots"] == 2 and ring["image_bytes"] == images and ring["left_out"] is None
        assert f"from {images / 1e6:.1f} MB of pinned host images" in err and "left out" not in err


@pytest.mark.parametrize("env, count, images", [({}, 0, False), ({"KESTREL_LINK_EXPERTS": "3"}, 3, True),
                                                ({"KESTREL_LINK_EXPERTS": "auto", "KESTREL_HOST_READS_IMAGES": "1"},
                                                 "auto", True),
                                                ({"KESTREL_LINK_EXPERTS": "defer"}, "defer", False)])
def test_plan_offload_names_the_link_share_and_its_pinned_images(qwen3_30b_a3b_config, monkeypatch, capsys, env,
                                                                 count, images):
    """With every expert on the host (no ring: --stream off's placement), plan names the link share the
    environment sets and the pinned images it would build (48 routed layers' experts, 30.8 GB), and whether
    the host reads its experts there."""
    from kestrel_stream.cli.main import main
    from kestrel_stream.loading.presets import PRESETS
    from kestrel_stream.run.device import expert_pool
    for name in ("KESTREL_LINK_EXPERTS", "KESTREL_HOST_READS_IMAGES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KESTREL_STREAM_EXPERTS", "off")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["plan", "--model", str(qwen3_30b_a3b_config), "--mode", "offload", "--vram-budget", "8GiB",
                 "--profile", "h200", "--json"]) == 0
    link = json.loads(capsys.readouterr().out)["window"]["link_share"]
    expected = 48 * expert_pool.layer_slot_bytes(PRESETS["qwen3-30b-a3b"]) if images else 0
    assert link["count"] == count and link["image_bytes"] == expected
    assert link["host_reads_images"] == (env.get("KESTREL_HOST_READS_IMAGES") == "1")
