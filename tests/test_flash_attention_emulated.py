"""The tensor-core prefill attention (kernels_ptx/flash_attention.cu) on the emulated device: which
steps get it, and gpu mode's logits through it against the CPU engine (head dims 64 and 128, GQA
groups 1 to 8, chunks continuing a cached prefix, several prompts in one step, a sliding window)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fake_cuda
import fake_flash
from hf_oracle import relative_error
from kestrel_stream.cuda import flash_attention as fa
from bench.synthetic import random_q8_weights
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.options import Options
from kestrel_stream.run.engine import Engine

BASE = ModelConfig(arch="qwen3", hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=256,
                   rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                   max_position_embeddings=512)


def config(head_dim: int, heads: int, kv_heads: int, **changes) -> ModelConfig:
    return dataclasses.replace(BASE, head_dim=head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                               **changes)


@pytest.fixture
def flash_calls(monkeypatch):
    """The emulated device, and the list of token counts the flash kernel ran for."""
    fake_cuda.install(monkeypatch, mode="deferred")
    calls = []
    twin = fake_flash.flash_attention_paged

    def counting(launch, *args):
        calls.append(args[5])                        # ntok
        twin(launch, *args)
    monkeypatch.setattr(fake_flash, "flash_attention_paged", counting)
    return calls


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 250, n)]


def engines(cfg: ModelConfig, **gpu_options):
    weights = random_q8_weights(cfg, seed=11)
    return (Engine(weights, device="cpu", max_seq_len=256),
            Engine(weights, device="cuda", mode="gpu", max_seq_len=256, max_batch=4, **gpu_options))


def test_shortest_run_and_the_choice():
    rows = np.array([7] * 20 + [3] * 16 + [9] * 30)
    assert fa.shortest_run(rows) == 16 and fa.prefers_flash(128, rows)
    assert fa.shortest_run(np.array([1, 2, 3])) == 1 and not fa.prefers_flash(64, np.array([1] * 15))
    assert fa.shortest_run(np.array([5, 5, 6, 5])) == 1      # a session's rows apart are two runs
    assert fa.flash_supported(128, "f16", 8) and not fa.flash_supported(128, "f32", 2)
    assert not fa.flash_supported(80, "f16", 1) and not fa.flash_supported(64, "f16", 16)
    assert [fa.tile_tokens(g) for g in (1, 2, 3, 4, 8)] == [64, 32, 21, 16, 8]


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 2, 2), (128, 4, 2), (64, 8, 2), (128, 8, 1)])
def test_prefill_through_the_flash_kernel_tracks_the_cpu_engine(flash_calls, head_dim, heads, kv_heads):
    """A 45-token prompt (the graph of its bucket: 48 rows, 3 of them padded, run/device/step_graphs.py), then
    70 tokens continuing it (one eager step on the flash kernel from position 45, its lm_head run per 64
    logits rows), then decodes; tiles of 64 / group tokens."""
    cpu, gpu = engines(config(head_dim, heads, kv_heads))
    first, second = prompt(45, 1), prompt(70, 2)
    with cpu.new_session() as ref, gpu.new_session() as s:
        for chunk in (first, second):
            want, got = ref.prefill(chunk), s.prefill(chunk)
            assert relative_error(got, want) < 2e-3
            np.testing.assert_array_equal(got.argmax(axis=1), want.argmax(axis=1))
        assert flash_calls == [48, 48, 70, 70], flash_calls
        ran = len(flash_calls)
        token = int(np.argmax(want[-1]))
        for _ in range(3):
            want, got = ref.decode(token), s.decode(token)
            assert relative_error(got, want) < 2e-3 and int(np.argmax(got)) == int(np.argmax(want))
            token = int(np.argmax(want))
        assert len(flash_calls) == ran, "decode steps keep the split kernel"
    gpu.close()


def test_several_prompts_in_one_step_and_a_sliding_window(flash_calls):
    """Three sessions' prompts in one step (tiles span two sessions) under a window shorter than them."""
    cpu, gpu = engines(config(64, 4, 1, arch="mistral", sliding_window=24))
    prompts = [prompt(n, 10 + n) for n in (20, 17, 33)]
    refs = [cpu.new_session() for _ in prompts]
    wants = [r.prefill(p) for r, p in zip(refs, prompts)]
    x = gpu.executor
    kvs = [x.alloc_kv(256) for _ in prompts]
    gots = x.forward([(kv, np.array(p), 0) for kv, p in zip(kvs, prompts)], logits="last")   # one 70-row step
    assert flash_calls == [70] * gpu.config.num_hidden_layers
    for got, want in zip(gots, wants):
        assert relative_error(got[0], want[-1]) < 2e-3 and int(np.argmax(got)) == int(np.argmax(want[-1]))
    token = 5      # and the caches the step wrote carry each session on
    for kv, ref, p in zip(kvs, refs, prompts):
        [got] = x.forward([(kv, np.array([token]), len(p))])
        want = ref.decode(token)
        assert relative_error(got[0], want) < 2e-3 and int(np.argmax(got)) == int(np.argmax(want))
    gpu.close()


def test_short_runs_f32_kv_and_other_head_dims_keep_the_split_kernel(flash_calls):
    cpu, gpu = engines(config(64, 4, 2))
    x = gpu.executor
    long_kv, short_kv = x.alloc_kv(256), x.alloc_kv(256)
    x.forward([(long_kv, np.array(prompt(40, 3)), 0), (short_kv, np.array(prompt(3, 4)), 0)])
    assert flash_calls == [], "a 3-token run in the step: the split kernel"
    x.forward([(short_kv, np.array(prompt(16, 5)), 3)])
    assert flash_calls == [16] * BASE.num_hidden_layers
    flash_calls.clear()      # one launch list per token count, decided anew each step by its rows
    steps = [[(20, 0), (20, 0)], [(37, 0), (3, 0)], [(40, 0)]]
    # one session's 40 tokens: its bucket's graph (48 rows, 8 padded: run/device/step_graphs.py)
    for step, flash_rows in zip(steps, (40, 0, 48)):
        x.forward([(x.alloc_kv(256), np.array(prompt(n, n)), start) for n, start in step])
        assert flash_calls == [flash_rows] * BASE.num_hidden_layers * bool(flash_rows), step
        flash_calls.clear()
    gpu.close()
    _, f32_kv = engines(config(128, 4, 2), kv_dtype="f32")
    names = {launch.name for launch in f32_kv.executor.steps.step_launches(64)}
    assert not any(isinstance(launch, fa.AttentionChoice) for launch in f32_kv.executor.steps.step_launches(64)), names
    f32_kv.close()
    _, other = engines(config(32, 4, 2))
    assert not any(isinstance(launch, fa.AttentionChoice) for launch in other.executor.steps.step_launches(64))
    other.close()


def test_a_prefill_steps_kernels_are_its_plans_launches(flash_calls):
    """The flash kernel takes the split kernel's place: one launch per layer either way."""
    _, gpu = engines(config(128, 4, 2))
    x = gpu.executor
    kv = x.alloc_kv(256)
    before = x.counters.as_dict()
    x.forward([(kv, np.array(prompt(40, 6)), 0)])
    ran = x.counters.as_dict()["kernels"] - before["kernels"]
    assert flash_calls and ran == x.plan(40).launches_per_step
    gpu.close()


def test_forcing_either_kernel_gives_the_same_logits(flash_calls):
    """AttentionChoice.kernel = "split" / "flash" (the bench's switch, on the eager launch lists: graphs of one
    session's steps off): the same step both ways."""
    _, gpu = engines(config(128, 8, 2), options=Options(step_graphs=False))
    x = gpu.executor
    tokens = np.array(prompt(33, 7))
    outs = {}
    for kernel in ("split", "flash"):
        for launch in x.steps.step_launches(33):
            if isinstance(launch, fa.AttentionChoice):
                launch.kernel = kernel
        kv = x.alloc_kv(256)
        outs[kernel] = x.forward([(kv, tokens, 0)])[0]
        x.free_kv(kv)
    assert flash_calls == [33] * BASE.num_hidden_layers
    assert relative_error(outs["flash"], outs["split"]) < 2e-3
    gpu.close()


def test_split_head_is_the_rows_up_to_the_last_short_run():
    assert fa.split_head(64, np.array([1, 2, 3] + [9] * 30)) == 3           # decodes, then a chunk
    assert fa.split_head(64, np.array([9] * 30 + [1, 2])) == 32             # a decode last: all on split
    assert fa.split_head(64, np.array([1] + [9] * 20 + [2] + [8] * 16)) == 22
    assert fa.split_head(64, np.array([9] * 16 + [8] * 40)) == 0 and fa.split_head(64, np.array([], int)) == 0


def test_decodes_beside_prompts_take_the_split_kernel_and_the_prompts_the_flash_kernel(flash_calls):
    """A serving step: two sessions' decodes, then a fresh prompt (and a continued one), in one step: the decodes'
    rows on the split kernel, the prompts' on the flash kernel (a launch each a layer), every session's numbers
    the CPU engine's; where a short run comes last the whole step stays on the split kernel."""
    cpu, gpu = engines(config(64, 4, 2))
    x, layers = gpu.executor, BASE.num_hidden_layers
    starts = [prompt(5, 20), prompt(7, 21)]
    refs = [cpu.new_session() for _ in starts]
    kvs = [x.alloc_kv(256) for _ in starts]
    for ref, kv, p in zip(refs, kvs, starts):
        ref.prefill(p)
        x.forward([(kv, np.array(p), 0)], logits="last")
    assert flash_calls == []                    # runs of 5 and 7: the split kernel
    fresh, fresh_kv = cpu.new_session(), x.alloc_kv(256)
    chunk = prompt(30, 22)
    gots = x.forward([(kvs[0], np.array([9]), 5), (kvs[1], np.array([11]), 7), (fresh_kv, np.array(chunk), 0)],
                     logits="last")
    assert flash_calls == [30] * layers, flash_calls
    wants = [refs[0].decode(9), refs[1].decode(11), fresh.prefill(chunk)[-1]]
    for got, want in zip(gots, wants):
        assert relative_error(got[0], want) < 2e-3 and int(np.argmax(got)) == int(np.argmax(want))
    flash_calls.clear()
    more = prompt(20, 23)                       # the chunk first, a decode after it: all on the split kernel
    gots = x.forward([(fresh_kv, np.array(more), 30), (kvs[0], np.array([4]), 6)], logits="last")
    assert flash_calls == []
    wants = [fresh.prefill(more)[-1], refs[0].decode(4)]
    for got, want in zip(gots, wants):
        assert relative_error(got[0], want) < 2e-3 and int(np.argmax(got)) == int(np.argmax(want))
    gpu.close()
