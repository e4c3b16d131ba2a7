"""A sampled row's state words, as kernels_ptx/sample.cu reads them: packed on the host for the device
sampler (sampler.py), CUDA-free so the engine and generation can pack a row in any mode."""
from __future__ import annotations

import numpy as np

from kestrel_stream.text.sampling import SamplingParams

STATE_WORDS = 8


def pack_state(params, seed: int, step: int) -> np.ndarray:
    """One row's state words: temperature, top_k, top_p, min_p, seed (two words), step (two words).  Greedy
    params (temperature 0) pack as temperature 0 and top_k 1: sample.cu then takes the argmax (the first
    largest logit), so a greedy row can share a step with drawn ones."""
    words = np.zeros(STATE_WORDS, np.uint32)
    if params.greedy:
        temperature, top_k, top_p, min_p = 0.0, 1, 1.0, 0.0
    else:
        temperature, top_k, top_p, min_p = params.temperature, max(params.top_k, 0), min(params.top_p, 1.0), params.min_p
    words[[0, 2, 3]] = np.array([temperature, top_p, min_p], np.float32).view(np.uint32)
    words[1] = top_k
    words[4], words[5] = seed & 0xFFFFFFFF, seed >> 32
    words[6], words[7] = step & 0xFFFFFFFF, step >> 32
    return words


# a greedy row's state (its argmax), and that of rows nobody reads (a graph bucket's padding, the other rows
# of a span lm_head ran on)
GREEDY_STATE = pack_state(SamplingParams(temperature=0.0), 0, 0)
