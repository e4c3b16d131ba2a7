"""bench/offload.py end to end on the emulated device (fake_cuda) with a tiny Qwen3 GGUF: the batch-1 row at the
VRAM llama.cpp's -ngl N takes for weights, and the row of several sessions decoding together, whose engine's KV
pool holds every session (at the batch-1 budget it holds one long session and a block for each other)."""
from __future__ import annotations

import functools
import json

import fake_cuda
from bench.make_gguf import write as write_gguf
from kestrel_stream.loading.presets import PRESETS


def test_the_offload_bench_runs_batch_one_and_several_sessions(tmp_path, monkeypatch):
    from bench import offload
    fake_cuda.install(monkeypatch, mode="deferred")
    path = tmp_path / "tiny.gguf"
    write_gguf(PRESETS["tiny"], None, str(path), seed=1)
    rows = offload.main([str(path), "--fractions", "0.5", "--threads", "1", "--new-tokens", "3", "--repeats", "1",
                         "--max-seq-len", "64", "--sessions", "8", "--no-stream", "--out", str(tmp_path)])
    assert len(rows) == 1
    row = rows[0]
    assert row["ours_tok_s"] > 0 and row["ours_batch_tok_s"] > 0, row
    assert row["predicted_ms"] > 0 and row["placement"]
    assert row["held_MB"] <= row["weight_MB"], row
    # the batch row's placement and its predicted step beside the measured one (8 sessions: 8 tokens a step)
    assert len(row["batch_placement"].split()[0]) == 2 and row["batch_predicted_ms"] > 0, row
    assert abs(row["batch_step_ms"] - 8 / row["ours_batch_tok_s"] * 1e3) < 0.01 + 0.01 * row["batch_step_ms"], row
    saved = json.loads(next(tmp_path.glob("*-offload.json")).read_text())["rows"]
    assert saved[0]["ours_batch_tok_s"] == row["ours_batch_tok_s"]


def test_pure_streaming_runs_the_sessions_on_an_engine_loaded_as_the_batch_rows(tmp_path, monkeypatch):
    """The window alone at several sessions gets the batch row's VRAM, max_seq_len and max_batch (loaded with
    ks.load's defaults it had a KV pool for other sessions than the row's and refused them)."""
    import kestrel_stream as ks
    from bench import offload
    fake_cuda.install(monkeypatch, mode="deferred")
    path = tmp_path / "tiny.gguf"
    write_gguf(PRESETS["tiny"], None, str(path), seed=1)
    loads = []
    real_load = ks.load

    @functools.wraps(real_load)             # the bench reads ks.load's default max_batch from its signature
    def load(*args, **kw):
        loads.append((kw.get("mode"), kw.get("vram_budget"), kw.get("max_seq_len"), kw.get("max_batch")))
        return real_load(*args, **kw)
    monkeypatch.setattr(ks, "load", load)
    planned = offload.offload_budget           # room for gpu mode's workspace (32 MiB) beside the tiny model
    monkeypatch.setattr(offload, "offload_budget", lambda *a, **kw: planned(*a, **kw) + (64 << 20))
    rows = offload.main([str(path), "--fractions", "0.5", "--threads", "1", "--new-tokens", "3", "--repeats", "1",
                         "--max-seq-len", "64", "--sessions", "8", "--out", str(tmp_path)])
    row = rows[0]
    assert isinstance(row["stream_batch_tok_s"], float) and row["stream_batch_tok_s"] > 0, row
    assert isinstance(row["stream_tok_s"], float) and row["stream_tok_s"] > 0, row
    batch = [entry for entry in loads if entry[3] == 8]
    assert [entry[0] for entry in batch] == ["offload", "gpu"], loads
    assert batch[0][1:] == batch[1][1:], loads         # the same budget, max_seq_len and max_batch


def test_the_budget_holds_the_weight_bytes_asked_for_the_engine_as_the_rows_load_it(tmp_path, monkeypatch):
    """offload_budget plans for ks.load's default max_batch, as the rows load the engine: the KV pool's floor
    grows with it, so a budget planned for another max_batch left ours less VRAM for weights than -ngl N's."""
    import kestrel_stream as ks
    from bench import offload
    fake_cuda.install(monkeypatch, mode="deferred")
    path = tmp_path / "tiny.gguf"
    write_gguf(PRESETS["tiny"], None, str(path), seed=1)
    profile, _ = offload.measured_pool(1)
    weights, _ = offload.weight_budget_of(str(path), 2)        # one layer and the output layer
    engine = ks.load(str(path), mode="offload", vram_budget=offload.offload_budget(str(path), weights, 64, profile),
                     max_seq_len=64, cpu_threads=1)
    placement = engine.executor.placement
    held = placement.resident_bytes + placement.ring_bytes
    engine.close()
    assert 0.8 * weights <= held <= weights, (held, weights)     # the ring's slots and the resident items
