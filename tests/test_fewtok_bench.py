"""CI (no GPU): bench/fewtok_decode.py's winners choice -- the split sweep's best variant at the next swept
token count for the swept shapes, the default elsewhere or where the winner would not fit -- and its
install/restore of mma_variants."""
from bench import fewtok_decode
from kestrel_stream.cuda import mma_variants

ROWS = [{"model": "qwen3-1.7b", "op": "down", "tokens": 16, "best": "16x64k128p3c512s8"},
        {"model": "qwen3-1.7b", "op": "down", "tokens": 32, "best": "32x64k64p4c256s4"},
        {"model": "qwen3-1.7b", "op": "qkv", "tokens": 16, "best": "16x64k128s8"},
        {"model": "qwen3-8b", "op": "down", "tokens": 16, "best": "16x64s2"}]


def test_winners_table_keys_by_shape_and_sorts_by_tokens():
    table = fewtok_decode.winners_table(list(reversed(ROWS)), "qwen3-1.7b")
    assert table == {(2048, 6144): [(16, "16x64k128p3c512s8"), (32, "32x64k64p4c256s4")],
                     (4096, 2048): [(16, "16x64k128s8")]}


def test_choice_takes_the_next_swept_count_and_falls_back_elsewhere():
    table = fewtok_decode.winners_table(ROWS, "qwen3-1.7b")
    choose = fewtok_decode.table_choice(table, lambda t, n, k: "fallback")
    assert choose(9, 2048, 6144) == choose(16, 2048, 6144) == "16x64k128p3c512s8"
    assert choose(17, 2048, 6144) == "32x64k64p4c256s4"
    assert choose(33, 2048, 6144) == "fallback", "beyond the swept counts"
    assert choose(16, 2048, 2048) == "fallback", "a shape not swept"
    big = fewtok_decode.table_choice({(151936, 2048): [(64, "16x64s16")]}, lambda t, n, k: "fallback")
    assert big(64, 151936, 2048) == "fallback", "more partials than the executor's scratch holds"


def test_installed_swaps_the_choice_and_the_scratch_tiles_then_restores():
    before = mma_variants.choose_variant, mma_variants.SMALL_STEP_TILES, mma_variants.scratch_bound(64)
    table = fewtok_decode.winners_table(ROWS, "qwen3-1.7b")
    with fewtok_decode.installed(table):
        assert mma_variants.choose_variant(32, 2048, 6144) == "32x64k64p4c256s4"
        assert "32x64k64p4c256" in mma_variants.SMALL_STEP_TILES
        area = max(mma_variants.TILES[name].tokens * mma_variants.TILES[name].rows
                   for name in mma_variants.SMALL_STEP_TILES)
        assert area >= 32 * 64 and mma_variants.scratch_bound(64)[0] == 2 * mma_variants.SPLIT_TARGET_BLOCKS * area, \
            "the 32 x 64 partial tiles counted in the bound"
        assert mma_variants.choose_variant(16, 2048, 2048) == before[0](16, 2048, 2048)
    assert (mma_variants.choose_variant, mma_variants.SMALL_STEP_TILES, mma_variants.scratch_bound(64)) == before


def test_decode_rows_run_the_winner_on_the_emulated_device(monkeypatch):
    """run_choice on a toy qwen3 (emulated device): the winners' down projection of 32 sessions is the
    pipelined 32-token tile split 4 ways, and the decode rows come out with their per-op times."""
    import argparse

    import fake_cuda
    from test_splitk_emulated import CONFIG
    from bench.synthetic import random_q8_weights
    from kestrel_stream.run.compat import GpuExecutor
    fake_cuda.install(monkeypatch, mode="deferred")
    weights = random_q8_weights(CONFIG, seed=5)
    table = {(CONFIG.hidden_size, CONFIG.intermediate_size): [(32, "32x64k64p4c256s4")]}
    with fewtok_decode.installed(table):   # (up to 16 tokens take the fp16 GEMV of q8_gemv_hmma.cu)
        gpu = GpuExecutor(weights, max_seq_len=16, max_batch=32, max_sessions=33)
        down = [launch for launch in gpu.steps.step_launches(32) if launch.labels.get("op") == "down"]
        assert down and all(l.name == "q8_mma_32x64k64p4c256" and l.grid[2] == 4 for l in down), \
            [(l.name, l.grid) for l in down]
        gpu.close()
        args = argparse.Namespace(prompt_len=3, new_tokens=2, ops=True)
        rows = fewtok_decode.run_choice(weights, args, [17, 32], "winners")
    assert [r["sessions"] for r in rows] == [17, 32] and all(r["tok_s"] > 0 and r["ops_us"]["down"] >= 0 for r in rows)


def test_split_count_keeps_one_session_at_most_splits_and_trims_batches():
    from kestrel_stream.cuda.flash_attention import SPLIT_TARGET_BLOCKS, split_count
    assert [split_count(t, 8, 16) for t in (1, 4, 8)] == [16, 16, 16], "decode of few sessions: every split"
    counts = [split_count(t, 8, 16) for t in (1, 9, 16, 32, 64, 512)]
    assert counts == sorted(counts, reverse=True) and counts[-1] == 1
    for tokens in (9, 16, 32, 64):
        splits = split_count(tokens, 8, 16)
        assert 8 * tokens * splits >= SPLIT_TARGET_BLOCKS > 8 * tokens * (splits - 1), tokens
    assert split_count(1, 1, 4) == 4 and split_count(0, 8, 16) == 16
