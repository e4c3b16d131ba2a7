"""Numpy twins of sample.cu's kernels (temperature, top-k/p, min-p draws on the device) for the emulated
device; tests/fake_kernels.py registers them."""
from __future__ import annotations

import numpy as np

from fake_cuda import dev
from fake_kernels import rows


SAMPLE_CAP = 64            # sample.cu's SAMPLE_CAP and SAMPLE_MAX_SPLITS
SAMPLE_MAX_SPLITS = 64


def sample_params(words):
    from kestrel_stream.text.sampling import SamplingParams
    temperature, top_p, min_p = words[[0, 2, 3]].view(np.float32).tolist()
    return SamplingParams(temperature=temperature, top_k=int(words[1]), top_p=top_p, min_p=min_p)


def draw_row(x, ids, words, params) -> int:
    """The reference filter and draw over x (ids: their token ids), then the row's Philox step advances."""
    from kestrel_stream.text.sampling import draw, filter_threshold, philox_uniform
    seed, step = int(words[4]) | int(words[5]) << 32, int(words[6]) | int(words[7]) << 32
    if params.greedy:               # temperature 0: the first largest logit (sample.cu's draw with target 0)
        token = int(ids[int(np.argmax(x))])
    else:
        token = int(ids[draw(x, filter_threshold(x, params), params.temperature, philox_uniform(seed, step))])
    step += 1
    words[6], words[7] = step & 0xFFFFFFFF, step >> 32
    return token


def order_key(x: np.ndarray) -> np.ndarray:
    b = np.asarray(x, np.float32).view(np.uint32)
    return np.where(b & 0x80000000, ~b, b | 0x80000000).astype(np.uint32)


def uses_candidates(top_k: int, V: int) -> bool:
    return 0 < top_k <= SAMPLE_CAP and top_k < V


def sample_rows(launch, logits, V, state, out) -> None:
    """sample.cu's twin: the reference sampler (text/sampling.py) with the row's state and Philox draw."""
    T = launch.grid[0]
    assert launch.block[0] == 1024 and T >= 1
    words = dev(state, 4 * 8 * T, np.uint32).reshape(T, 8)
    for t, row in enumerate(rows(logits, T, V, V)):
        x = row.astype(np.float32)
        dev(out, 4 * T, np.int32)[t] = draw_row(x, np.arange(V), words[t], sample_params(words[t]))


def cand_views(cand, t, S):
    words = dev(cand + 4 * t * S * (2 * SAMPLE_CAP + 4), 4 * S * (2 * SAMPLE_CAP + 4), np.uint32)
    vals = words[:S * SAMPLE_CAP].view(np.float32).reshape(S, SAMPLE_CAP)
    ids = words[S * SAMPLE_CAP:2 * S * SAMPLE_CAP].view(np.int32).reshape(S, SAMPLE_CAP)
    return vals, ids, words[2 * S * SAMPLE_CAP:].reshape(S, 4)


def sample_candidates(launch, logits, V, state, cand) -> None:
    """Each slice's top_k logits in id order: keys above its k-th key, then ties at it in id order."""
    S, T = launch.grid[0], launch.grid[1]
    assert launch.block[0] == 256 and 1 <= S <= SAMPLE_MAX_SPLITS, launch.name
    words = dev(state, 4 * 8 * T, np.uint32).reshape(T, 8)
    slice_len = -(-V // S)
    for t, row in enumerate(rows(logits, T, V, V)):
        k = int(words[t, 1])
        if not uses_candidates(k, V):
            continue
        vals, ids, meta = cand_views(cand, t, S)
        for b in range(S):
            begin = min(V, b * slice_len)
            keys = order_key(row[begin:min(V, begin + slice_len)])
            cut = np.uint32(np.sort(keys)[len(keys) - k]) if len(keys) > k else np.uint32(0)
            room = max(0, k - int(np.sum(keys > cut)))
            ties = np.flatnonzero(keys == cut)
            kept = np.sort(np.concatenate([np.flatnonzero(keys > cut), ties[:room]]))
            vals[b, :len(kept)] = row[begin + kept]
            ids[b, :len(kept)] = begin + kept
            meta[b, :3] = len(kept), int(len(ties) > room), cut


def sample_finish(launch, logits, V, state, cand, S, out) -> None:
    """The reference sampler over the candidates; the whole row when top_k is out of the candidates'
    range or a slice left out ties at the row's k-th key."""
    T = launch.grid[0]
    assert launch.block[0] == 1024 and 1 <= S <= SAMPLE_MAX_SPLITS, launch.name
    words = dev(state, 4 * 8 * T, np.uint32).reshape(T, 8)
    for t, row in enumerate(rows(logits, T, V, V)):
        params, x, ids = sample_params(words[t]), row.astype(np.float32), np.arange(V)
        if uses_candidates(params.top_k, V):
            vals, cand_ids, meta = cand_views(cand, t, S)
            cv = np.concatenate([vals[b, :meta[b, 0]] for b in range(S)])
            ci = np.concatenate([cand_ids[b, :meta[b, 0]] for b in range(S)])
            kcut = order_key(np.sort(cv)[len(cv) - params.top_k])
            if not np.any((meta[:, 1] != 0) & (meta[:, 2] == kcut)):
                x, ids = cv, ci
        dev(out, 4 * T, np.int32)[t] = draw_row(x, ids, words[t], params)
