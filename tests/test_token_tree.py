"""A token tree verified in one step equals its paths verified one by one: every node's logits are those of
its root path fed as a chain, and after keep_branch the session continues as if it had been fed that path
alone; several sessions' trees and a plain decode in one step each equal that session alone (the daemon's
batched verify passes); on the CPU engine (numpy and the native kernels) and on the emulated device (gpu,
layers=1, a streaming window, offload)."""
from __future__ import annotations

import numpy as np
import pytest

import fake_cuda
from bench.synthetic import random_q8_weights
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.run.engine import Engine
from kestrel_stream.run.token_tree import MAX_NODES, TokenTree

CONFIG = ModelConfig(arch="qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=96,
                     rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=128)
PROMPT = [5, 3, 60, 17, 42, 8, 1, 33, 7]
# a root with three children, the first two with children of their own, one path four deep
PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 7, 3]
TOKENS = [11, 20, 21, 22, 30, 31, 32, 40, 50, 33]
TOL = dict(rtol=2e-4, atol=2e-4)


def test_the_tree_shape_gives_depths_masks_and_kernel_fields():
    tree = TokenTree(PARENTS)
    assert tree.depth.tolist() == [0, 1, 1, 1, 2, 2, 2, 3, 4, 2]
    assert tree.path_to(8) == [0, 1, 4, 7, 8] and tree.children(1) == [4, 5] and tree.leaves() == [5, 6, 8, 9]
    assert tree.visible[8].nonzero()[0].tolist() == [0, 1, 4, 7, 8]
    skip, span, bits = tree.device_fields()
    assert skip.tolist() == [0, 0, 1, 2, 2, 3, 4, 4, 4, 7] and span.tolist() == list(range(1, 11))
    assert int(bits[8]) == 0b110010011 and int(bits[0]) == 1
    assert TokenTree.chain(4).is_chain and not tree.is_chain
    for bad in ([0, 0], [-1, 1], [-1, 0, 3], [-1] + list(range(MAX_NODES))):
        with pytest.raises(ValueError):
            TokenTree(bad)


def path_rows(engine, path_tokens):
    """Logits of each token of `path_tokens` fed as a chain after PROMPT, and the logits of a decode after it."""
    with engine.new_session() as s:
        s.prefill(PROMPT)
        rows = s.prefill(path_tokens)
        return rows, s.decode(3)


def check_tree_equals_paths(engine):
    tree = TokenTree(PARENTS)
    with engine.new_session() as s:
        s.prefill(PROMPT)
        rows = s.prefill_tree(TOKENS, PARENTS)
        assert rows.shape == (len(TOKENS), CONFIG.vocab_size) and s.position == len(PROMPT) + len(TOKENS)
        for leaf in tree.leaves():
            path = tree.path_to(leaf)
            expected, _ = path_rows(engine, [TOKENS[n] for n in path])
            np.testing.assert_allclose(rows[path], expected, **TOL, err_msg=f"path {path}")
            assert (rows[path].argmax(1) == expected.argmax(1)).all()
        path = tree.path_to(8)
        s.keep_branch(path)
        assert s.position == len(PROMPT) + len(path) and s.tokens == PROMPT + [TOKENS[n] for n in path]
        after = s.decode(3)
    _, expected_after = path_rows(engine, [TOKENS[n] for n in path])
    np.testing.assert_allclose(after, expected_after, **TOL)


def check_argmax_and_short_branches(engine):
    tree = TokenTree(PARENTS)
    with engine.new_session() as s:
        s.prefill(PROMPT)
        picks = s.prefill_tree(TOKENS, PARENTS, logits="argmax")
        for leaf in tree.leaves():
            path = tree.path_to(leaf)
            expected, _ = path_rows(engine, [TOKENS[n] for n in path])
            assert picks[path].tolist() == expected.argmax(1).tolist()
        s.keep_branch([0, 3])                        # a branch that is not the first child: moved
        assert s.tokens == PROMPT + [TOKENS[0], TOKENS[3]]
        after = s.decode(9)
        s.prefill_tree(TOKENS, PARENTS)
        s.keep_branch([0])                           # the root alone: nothing to move
        again = s.decode(4)
    with engine.new_session() as ref:
        ref.prefill(PROMPT + [TOKENS[0], TOKENS[3]])
        np.testing.assert_allclose(after, ref.decode(9), **TOL)
        ref.decode(TOKENS[0])
        np.testing.assert_allclose(again, ref.decode(4), **TOL)


def assert_sessions_trees_in_one_step(engine, tol: dict) -> None:
    """Two sessions' trees (at different positions) and a third session's decode in one engine step: each
    session's rows are those of its step alone, each row's argmax likewise, and after keep_branch each tree's
    session continues as one fed its kept path."""
    wide, small = TokenTree(WIDE_PARENTS), TokenTree(PARENTS)
    prompts = (PROMPT, PROMPT[:5], PROMPT[:3])
    items = [np.asarray(WIDE_TOKENS), np.asarray(TOKENS), np.asarray([7])]
    trees = [wide, small, None]
    alone = []
    for prompt, ids, tree in zip(prompts, items, trees):
        with engine.new_session() as ref:
            ref.prefill(prompt)
            alone.append(ref.prefill_tree(ids, tree.parents) if tree is not None else ref.prefill(ids))
    sessions = [engine.new_session() for _ in prompts]
    for session, prompt in zip(sessions, prompts):
        session.prefill(prompt)
    batch = list(zip(sessions, items))
    picks = engine.step(batch, logits="argmax", trees=trees)
    for session, prompt in zip(sessions, prompts):
        session.truncate(len(prompt))
    rows = engine.step(batch, logits="all", trees=trees)
    for i, (got, expected) in enumerate(zip(rows, alone)):
        np.testing.assert_allclose(got, expected, **tol, err_msg=f"session {i}")
        assert picks[i].tolist() == got.argmax(1).tolist(), i
    kept = (wide.path_to(17), small.path_to(8))
    for session, ids, path in zip(sessions, items, kept):
        session.keep_branch(path)
    after = [session.decode(3) for session in sessions[:2]]
    for prompt, ids, path, got in zip(prompts, items, kept, after):
        with engine.new_session() as ref:
            ref.prefill(list(prompt) + [int(ids[n]) for n in path])
            np.testing.assert_allclose(got, ref.decode(3), **tol)
    for session in sessions:
        session.close()


@pytest.mark.parametrize("kernels", ["numpy", "native"])
def test_cpu_tree_equals_its_paths(kernels, monkeypatch):
    monkeypatch.setenv("KESTREL_HOST_KERNELS", kernels)
    engine = Engine(random_q8_weights(CONFIG, seed=2), device="cpu", max_seq_len=64)
    check_tree_equals_paths(engine)
    check_argmax_and_short_branches(engine)
    with engine.new_session() as s, pytest.raises(ValueError, match="not a path"):
        s.prefill(PROMPT)
        s.prefill_tree(TOKENS, PARENTS)
        s.keep_branch([0, 4])
    assert_sessions_trees_in_one_step(engine, TOL)
    engine.close()


DEVICE_CONFIG = ModelConfig(arch="qwen3", hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=96,
                            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                            max_position_embeddings=128)
# 18 nodes: a step the flash kernel takes (FLASH_MIN_ROWS rows of one session), chains and branches
WIDE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 7, 3, 8, 8, 10, 12, 12, 5, 6, 13]
WIDE_TOKENS = [11, 20, 21, 22, 30, 31, 32, 40, 50, 33, 60, 61, 70, 80, 81, 41, 42, 90]
DEVICE_TOL = dict(rtol=3e-2, atol=3e-2)     # f16 KV, and flash's f16 probabilities beside the split kernel


def assert_wide_tree_equals_its_paths(engine, s, mode: str) -> None:
    """After PROMPT, session s's logits of the wide tree in one step equal each root-to-leaf path's, fed as
    plain tokens to a fresh session."""
    tree = TokenTree(WIDE_PARENTS)
    s.prefill(PROMPT)
    rows = s.prefill_tree(WIDE_TOKENS, WIDE_PARENTS)
    for leaf in tree.leaves():
        path = tree.path_to(leaf)
        with engine.new_session() as ref:
            ref.prefill(PROMPT)
            expected = ref.prefill([WIDE_TOKENS[n] for n in path])
        np.testing.assert_allclose(rows[path], expected, **DEVICE_TOL, err_msg=f"{mode} path {path}")


@pytest.mark.parametrize("mode", ["gpu", "layers=1", "window", "offload"],
                         ids=["whole-device", "layers", "window", "offload"])     # "gpu" would mark it a GPU test
def test_device_tree_equals_its_paths(mode, monkeypatch):
    from spec_engines import device_engine
    fake_cuda.install(monkeypatch, mode="deferred")
    engine = device_engine(random_q8_weights(DEVICE_CONFIG, seed=4), mode, max_seq_len=64)
    with engine.new_session() as s:
        assert_wide_tree_equals_its_paths(engine, s, mode)
        path = TokenTree(WIDE_PARENTS).path_to(17)
        s.keep_branch(path)
        after = s.decode(3)
        start = s.position
        picks = s.prefill_tree(WIDE_TOKENS, WIDE_PARENTS, logits="argmax")     # on the device in gpu mode
        s.truncate(start)
        assert picks.tolist() == s.prefill_tree(WIDE_TOKENS, WIDE_PARENTS).argmax(1).tolist()
    with engine.new_session() as ref:
        ref.prefill(PROMPT + [WIDE_TOKENS[n] for n in path])
        np.testing.assert_allclose(after, ref.decode(3), **DEVICE_TOL)
    assert_sessions_trees_in_one_step(engine, DEVICE_TOL)
    engine.close()


@pytest.mark.gpu
def test_gpu_tree_equals_its_paths():
    """The CUDA kernels themselves (kernels_ptx/: the rope op's rotary position by depth, the split and flash
    attention's tree masks) on the GPU machine."""
    from spec_engines import device_engine
    engine = device_engine(random_q8_weights(DEVICE_CONFIG, seed=4), "gpu", max_seq_len=64)
    with engine.new_session() as s:
        assert_wide_tree_equals_its_paths(engine, s, "gpu")
    assert_sessions_trees_in_one_step(engine, DEVICE_TOL)
    engine.close()
