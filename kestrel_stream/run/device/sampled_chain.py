"""Chained sampled decoding in `gpu` mode: greedy_chain.py with sample.cu in place of the argmax.

The sampling kernel advances each row's Philox step in device memory, so the
state is uploaded once per run and every chained step draws the next number:
the same tokens as one sampled step per sync, with 1/n syncs per token.
"""
from __future__ import annotations

import numpy as np

from kestrel_stream.cuda import driver
from kestrel_stream.run.device.sampler import LaunchSequence
from kestrel_stream.run.device.greedy_chain import GreedyChain


class SampledChain(GreedyChain):
    def _pick_launch(self, bucket: int) -> LaunchSequence:
        return self.x.sampler._launch(bucket)

    def run_sampled(self, rows: list, steps: int, states: list[np.ndarray]) -> np.ndarray:
        x = self.x
        x.sampler.stage(states)
        driver.h2d_async(x.sampler.state.ptr, x.sampler.host_state, len(states) * states[0].nbytes, x.stream)
        x.counters.h2d_bytes += len(states) * states[0].nbytes
        return self.run(rows, steps)
