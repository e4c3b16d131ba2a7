"""bench/offload_whatif.py on a small Qwen3 GGUF: every row's predicted step lies at or above its roofline, and
cutting the hand-off costs never predicts a slower step for the same budget (the placement search takes the
best it finds under each)."""
from __future__ import annotations

from dataclasses import replace

from bench.make_gguf import write as write_gguf
from bench.offload_whatif import WHAT_IF, rows
from kestrel_stream.loading.gguf import GGUFFile
from kestrel_stream.loading.gguf_config import config_from_metadata
from kestrel_stream.loading.presets import PRESETS

POOL = {"host_weight_GBps": 84.6, "h2d_GBps": 52.8, "host_joint_GBps": 82.3, "h2d_joint_GBps": 51.1,
        "host_call_us": 54.2, "host_gflops": 1161.7, "round_trip_us": 21.4, "gpu_weight_GBps": 2062.6}


def test_predictions_stay_above_the_roofline_and_fall_with_the_costs(tmp_path):
    path = tmp_path / "small.gguf"
    write_gguf(replace(PRESETS["tiny"], num_hidden_layers=8, hidden_size=512, intermediate_size=1536), None,
               str(path), seed=2)
    config = config_from_metadata(GGUFFile(path), path)
    tensors = GGUFFile(path).tensors
    layer = sum(t.nbytes for name, t in tensors.items() if name.startswith("blk.0."))
    budgets = [3.5 * layer / 1e6, 6.5 * layer / 1e6]
    out = rows(config, budgets, POOL)
    assert len(out) == len(WHAT_IF) * len(budgets)
    for row in out:
        assert row["predicted_ms"] >= row["roofline_ms"] > 0, row
        assert len(row["layers"]) == 8 and set(row["layers"]) <= set("RSHMAE"), row
    for i, budget in enumerate(budgets):
        predicted = [row["predicted_ms"] for row in out[i::len(budgets)]]
        assert all(row["weights_MB"] == budget for row in out[i::len(budgets)])
        assert predicted == sorted(predicted, reverse=True), predicted
        assert predicted[-1] < predicted[0], predicted          # the costs are part of the step
