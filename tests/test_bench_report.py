"""bench/report.py: a GPU bench's result name follows the card it ran on."""
import json

from bench.report import on_this_card, write_results


def test_a_gpu_result_is_named_for_its_card(tmp_path):
    assert on_this_card("h200-gpu-kernels", "NVIDIA H100 80GB HBM3 sm_90") == "h100-gpu-kernels"
    assert on_this_card("h200-gpu-kernels", "NVIDIA H200 sm_90") == "h200-gpu-kernels"
    assert on_this_card("h200-mma", "x86_64  2 cores") == "h200-mma"               # no card named: as it was
    assert on_this_card("mixed-steps", "NVIDIA H100 80GB HBM3 sm_90") == "mixed-steps"
    env = {"date": "2026-12-06 00:00 UTC", "machine": "NVIDIA H100 80GB HBM3 sm_90", "commit": "abc1234"}
    path = write_results("h200-gpu-kernels", env, [{"a": 1}], ["a"], out_dir=tmp_path)
    assert path.name == "2026-12-06-h100-gpu-kernels.md" and path.read_text().startswith("# h100-gpu-kernels")
    assert json.loads(path.with_suffix(".json").read_text())["benchmark"] == "h100-gpu-kernels"
