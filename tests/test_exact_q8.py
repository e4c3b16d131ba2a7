"""Q4_0, Q5_0 and IQ4_NL blocks as the Q8_0 of the same values (model/exact_q8.py): bit for bit gguf-py's
dequantized floats, in any row chunking, negative scales and every level included."""
import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from bench.synthetic import random_blocks, random_q8_weights
from kestrel_stream.model import exact_q8
from kestrel_stream.model.exact_q8 import EXACT_TYPES, exact_q8_0, levels
from kestrel_stream.model.quant import QTensor, quantize
from kestrel_stream.model.quant4 import BlockTensor, fuse_rows
from kestrel_stream.run.engine import Engine

LEVELS = {"Q4_0": (-8, 7), "Q5_0": (-16, 15), "IQ4_NL": (-127, 113)}


def random_type_blocks(rng, qtype: str, rows: int, cols: int) -> np.ndarray:
    """uint8 [rows, cols/32 * block bytes]: every byte random but the scales, half of them negative."""
    raw = rng.integers(0, 256, (rows, cols // 32, exact_q8.BLOCK_BYTES[qtype]), dtype=np.uint8)
    d = rng.uniform(1e-3, 1e-2, raw.shape[:2]) * rng.choice([-1.0, 1.0], raw.shape[:2])
    raw[:, :, 0:2] = d.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", EXACT_TYPES)
def test_the_q8_0_holds_gguf_pys_values_bit_for_bit(qtype, monkeypatch):
    rng = np.random.default_rng(len(qtype))
    raw = random_type_blocks(rng, qtype, 37, 320)
    floats = gguf_quants.dequantize(raw, T[qtype])
    monkeypatch.setattr(exact_q8, "CHUNK_VALUES", 3 * 320 + 5)        # chunks of 3 rows, the last of 1
    q = exact_q8_0(raw, qtype, (37, 320))
    assert isinstance(q, QTensor) and q.shape == (37, 320)
    assert np.array_equal(q.dequantize(), floats)
    assert (q.scales < 0).any() and (q.scales > 0).any()
    low, high = LEVELS[qtype]
    assert q.qs.min() == low and q.qs.max() == high              # every level reached, none past int8's -127


def test_q5_0_written_by_gguf_py_keeps_its_values_where_requantizing_rounds_them():
    x = np.random.default_rng(5).standard_normal((16, 256)).astype(np.float32) * 0.05
    raw = gguf_quants.quantize(x, T.Q5_0)
    floats = gguf_quants.dequantize(raw, T.Q5_0)
    exact = exact_q8_0(raw, "Q5_0", x.shape)
    assert np.array_equal(exact.dequantize(), floats)
    assert np.abs(quantize(floats).dequantize() - floats).max() > 0
    d, q = levels(raw.reshape(-1, 22), "Q5_0")
    assert d.dtype == np.float16 and q.dtype == np.int8 and q.shape == (16 * 8, 32)


def test_a_q4_0_part_fused_beside_q8_0_keeps_its_values():
    rng = np.random.default_rng(9)
    q4 = BlockTensor("Q4_0", random_blocks(rng, "Q4_0", 6, 256, 0.02), 256)
    q8 = quantize(rng.standard_normal((4, 256)).astype(np.float32) * 0.02)
    fused = fuse_rows([q4, q8])                  # QKV of mixed formats: one Q8_0 weight
    assert isinstance(fused, QTensor)
    assert np.array_equal(fused.dequantize()[:6], q4.dequantize())
    assert np.array_equal(fused.dequantize()[6:], q8.dequantize())


def test_other_types_are_refused_by_name():
    with pytest.raises(ValueError, match="Q4_1 is not one of Q4_0, Q5_0, IQ4_NL"):
        levels(np.zeros((1, 20), np.uint8), "Q4_1")


def negated_halves(weights, seed: int = 0):
    """The same values with about half of every Q8_0 weight's blocks stored as (-qs, -scale): the Q8_0 that
    a GGUF's Q4_0 / Q5_0 / IQ4_NL blocks become (model/exact_q8.py) has negative fp16 scales."""
    rng = np.random.default_rng(seed)
    done = {}

    def flip(q):
        if id(q) not in done:
            sign = rng.choice(np.array([-1, 1], np.int8), q.scales.shape)
            qs = (q.qs.reshape(*sign.shape, -1) * sign[..., None]).reshape(q.qs.shape)
            done[id(q)] = dataclasses.replace(q, qs=qs, scales=q.scales * sign.astype(np.float16))
        return done[id(q)]

    layers = [dataclasses.replace(l, wqkv=flip(l.wqkv), wo=flip(l.wo), w_gate_up=flip(l.w_gate_up),
                                  w_down=flip(l.w_down)) for l in weights.layers]
    return dataclasses.replace(weights, embed=flip(weights.embed), lm_head=flip(weights.lm_head), layers=layers)



def test_the_cpu_engine_gives_negated_blocks_the_same_logits_bit_for_bit():
    from test_gpu_offload import CONFIG, run
    weights = random_q8_weights(CONFIG, seed=5)
    flipped = negated_halves(weights)
    assert (flipped.embed.scales < 0).mean() > 0.3 and flipped.tied
    assert np.array_equal(flipped.layers[0].w_down.dequantize(), weights.layers[0].w_down.dequantize())
    assert not np.array_equal(flipped.layers[0].w_down.qs, weights.layers[0].w_down.qs)
    want = run(Engine(weights, device="cpu", max_seq_len=32, max_batch=4))
    assert np.array_equal(run(Engine(flipped, device="cpu", max_seq_len=32, max_batch=4)), want)
