"""One-token gpu steps run each layer's rope op as attention's prologue (kernels_ptx/attention_rope.cu).

On the numpy device emulation (fake_cuda) and on a GPU: decode with the fused kernel gives the logits of
the separate rope + attention launches (bit for bit on the emulation, whose twins share one body; within
1e-5 with the same argmax on the GPU, where inlining may contract a multiply-add differently), over
positions that cross KV blocks (16) and attention splits (16 keys each, the new key in split 0, 1, 2),
for a group of 2 q heads per kv head (the _g2 kernels) and of 4; the launch lists and the plan agree
that a one-token step has no rope launch and a two-token one keeps it; Options(fused_rope=False)
(KESTREL_FUSED_ROPE=0) keeps it in every step.  The split blocks' fewest keys (attention_min_keys) moves
no logit past 1e-5.
"""
from __future__ import annotations

import numpy as np
import pytest

import fake_cuda
from kestrel_stream.cuda import driver
from kestrel_stream.cuda.kernels import ATTENTION_MIN_KEYS, ATTENTION_WARPS
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.options import Options
from kestrel_stream.run.compat import GpuExecutor
from bench.synthetic import random_q8_weights

CONFIGS = {   # (q heads per kv head, head_dim): (2, 128) the _g2 kernel, (4, 64) the 8-head one
    "qwen3-g2": ModelConfig(arch="qwen3", hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=512,
                            rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                            max_position_embeddings=512),
    "llama-g4": ModelConfig(arch="llama", hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=384,
                            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                            max_position_embeddings=512),
}
PROMPT = [5, 3, 200, 17, 42, 8, 1, 99, 250, 7, 64, 31]
SEQ = 48     # the last decode step's key at position 45: in split 2 (16 keys per split), KV block 2


@pytest.fixture(params=["emulated", pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not driver.gpu_available(), reason="no GPU")])])
def device(request, monkeypatch):
    if request.param == "emulated":
        fake_cuda.install(monkeypatch, mode="deferred")
    return request.param


def executor(weights, fused: bool, min_keys: int = ATTENTION_MIN_KEYS, warps: int = ATTENTION_WARPS) -> GpuExecutor:
    return GpuExecutor(weights, max_seq_len=SEQ, max_batch=2, max_sessions=2, prefill_chunk=16,
                       options=Options(fused_rope=fused), attention_min_keys=min_keys, attention_warps=warps)


def decode_logits(gpu: GpuExecutor, steps: int) -> np.ndarray:
    kv = gpu.alloc_kv(SEQ)
    rows = [gpu.forward([(kv, np.array(PROMPT), 0)])[0][-1]]
    for i in range(steps):
        token = int(np.argmax(rows[-1]))
        rows.append(gpu.forward([(kv, np.array([token]), len(PROMPT) + i)])[0][-1])
    gpu.free_kv(kv)
    return np.array(rows)


def kernel_names(gpu: GpuExecutor, tokens: int) -> list[str]:
    return [launch.name for launch in gpu.steps.step_launches(tokens)]


@pytest.mark.parametrize("shape", sorted(CONFIGS))
def test_fused_decode_matches_separate_launches(device, shape):
    weights = random_q8_weights(CONFIGS[shape], seed=5)
    steps = SEQ - len(PROMPT) - 2
    separate, fused = executor(weights, False), executor(weights, True)
    try:
        expected, ours = decode_logits(separate, steps), decode_logits(fused, steps)
        layers, group = weights.config.num_hidden_layers, weights.config.gqa_group
        one = kernel_names(fused, 1)
        assert not any(name.startswith("qkv_rope") for name in one)
        assert sum(name.startswith("attention_rope_paged") for name in one) == layers
        rope_attention = [name for name in one if name.startswith("attention_rope")]
        assert all(("_g2" in name) == (group <= 2) for name in rope_attention)
        assert all(name.endswith("_w8") == (ATTENTION_WARPS == 8) for name in rope_attention)
        assert sum(name.startswith("qkv_rope_append_paged") for name in kernel_names(fused, 2)) == layers
        assert len(kernel_names(separate, 1)) == len(one) + layers
        for tokens in (1, 2):      # the plan counts what the launch lists hold
            assert fused.plan(tokens).launches_per_step == len(kernel_names(fused, tokens))
            assert separate.plan(tokens).launches_per_step == len(kernel_names(separate, tokens))
    finally:
        separate.close()
        fused.close()
    if device == "emulated":
        np.testing.assert_array_equal(ours, expected)
    else:
        # the rotation computed in another kernel rounds differently, and a decode feeds it back token by token:
        # 2.1e-5 of the row's largest after 10 tokens on an H200 (qwen3, 2 queries a KV head)
        scale = np.abs(expected).max(axis=1, keepdims=True)
        assert (np.abs(ours - expected) / scale).max() < 1e-4
        np.testing.assert_array_equal(ours.argmax(axis=1), expected.argmax(axis=1))



@pytest.mark.parametrize("min_keys", [1, 32, 64])
def test_keys_per_split_block_change_no_logits(device, min_keys):
    """Fewer, longer split blocks (a context of at most min_keys keys: one block, no merge) attend to the
    same keys, fused rope or not: the same argmax, and logits within 1e-3 of the row's largest.  Another
    split regroups the softmax sums, so the rounding differs and grows over the steps and layers of a
    random model (1.2e-4 at min_keys 1 on the H200)."""
    weights = random_q8_weights(CONFIGS["llama-g4"], seed=6)
    steps = SEQ - len(PROMPT) - 2
    reference, ours, separate = (executor(weights, False), executor(weights, True, min_keys),
                                 executor(weights, False, min_keys))
    try:
        expected = decode_logits(reference, steps)
        results = [decode_logits(ours, steps), decode_logits(separate, steps)]
    finally:
        for gpu in (reference, ours, separate):
            gpu.close()
    scale = np.abs(expected).max(axis=1, keepdims=True)
    for logits in results:
        assert (np.abs(logits - expected) / scale).max() < 1e-3
        np.testing.assert_array_equal(logits.argmax(axis=1), expected.argmax(axis=1))


@pytest.mark.parametrize("shape", sorted(CONFIGS))
@pytest.mark.parametrize("min_keys", [16, 32, 64])
def test_eight_warp_blocks_change_no_logits(device, shape, min_keys):
    """attention_warps=8 (the _w8 kernels: a block's keys in half the passes) attends to the same keys as
    the default 4-warp blocks with the separate rope launch: the same argmax, logits within 1e-3 of the
    row's largest (the warps' merge regroups the softmax sums, as another split does)."""
    weights = random_q8_weights(CONFIGS[shape], seed=7)
    steps = SEQ - len(PROMPT) - 2
    reference, wide = executor(weights, False), executor(weights, True, min_keys, warps=8)
    try:
        names = [n for n in kernel_names(wide, 1) if n.startswith("attention_rope")]
        assert len(names) == weights.config.num_hidden_layers and all(n.endswith("_w8") for n in names)
        expected, logits = decode_logits(reference, steps), decode_logits(wide, steps)
    finally:
        reference.close()
        wide.close()
    scale = np.abs(expected).max(axis=1, keepdims=True)
    assert (np.abs(logits - expected) / scale).max() < 1e-3
    np.testing.assert_array_equal(logits.argmax(axis=1), expected.argmax(axis=1))


def test_rope_attention_table_matches_the_kernel_source():
    import re
    from kernels_ptx import build
    from kestrel_stream.cuda.kernels import ROPE_ATTENTION
    source = (build.source_dir() / "attention_rope.cu").read_text()
    defined = set(re.findall(r"^DEFINE_ATTENTION_ROPE\((\d+), (\w+), \w+, (\w+), (\w*)\)", source, re.M))
    expected = {(str(d), dtype, group, tail) for d, dtype in ROPE_ATTENTION
                for group, tail in (("ATTN_MAX_GROUP", ""), ("2", "_g2"))}
    assert defined == expected
    wide = set(re.findall(r"^DEFINE_ATTENTION_ROPE_W\((\d+), (\w+), \w+, (\w+), ATTN_WIDE_WARPS, (\w*)\)",
                          source, re.M))
    assert wide == {(d, dtype, group, tail + "_w8") for d, dtype, group, tail in expected}


def test_attention_warps_outside_the_kernels_are_refused():
    from kestrel_stream.cuda.kernels import rope_attention_launch
    with pytest.raises(AssertionError, match="attention warps 16"):
        rope_attention_launch(None, 0, [0, 0, 0, 0], 1e-6, 0, 0, 0, 0, 0, 0, 1, 0, 2, 8, 2, 64, 1, 4, "f16",
                              warps=16)
