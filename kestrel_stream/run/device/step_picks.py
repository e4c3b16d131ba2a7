"""A mixed step's tokens taken on the device: each logits row's argmax (argmax_split) or a draw (sample.cu,
device/sampler.py) written into the backend's TokenOutputs, whose 4 bytes a row come back in place of the row
(run/segment_state.SegmentState.outputs_to_host enqueues them where the device alone holds the logits)."""
from __future__ import annotations

from kestrel_stream.cuda import driver
from kestrel_stream.run.device.launches import argmax_launch
from kestrel_stream.run.device.sample_state import GREEDY_STATE
from kestrel_stream.run.device.sampler import DeviceSampler


class StepPicks:
    def __init__(self, backend):
        self.backend = backend
        self._argmax: dict = {}            # rows -> its argmax_split launch
        try:
            self.sampler = DeviceSampler(backend)
        except driver.CudaError:           # no room in the arena for its buffers: sampled steps draw on the host
            self.sampler = None

    def pick(self, kind: str | None) -> tuple | None:
        """SegmentState.pick for `kind` ("argmax", "sample"; None: the logits come back)."""
        if kind == "argmax":
            return kind, self._enqueue_argmax, self.backend.token_outputs
        if kind == "sample":
            return kind, self.sampler.enqueue, self.backend.token_outputs
        return None

    def stage_draws(self, states: list, last_rows, lo: int, lm: tuple[int, int]) -> None:
        """The sampling states of the rows lm_head computes in a chunk from row `lo` (lm = (first, count) within
        it): a session's state at its last row (`last_rows`, one a session, over the whole step), the greedy
        padding elsewhere (those rows' draws are not read)."""
        first, count = lm
        span = [GREEDY_STATE] * count
        for state, row in zip(states, last_rows):
            if lo + first <= row < lo + first + count:
                span[row - lo - first] = state
        self.sampler.stage(span)

    def tokens(self, rows: int):
        """The first `rows` tokens the last step picked (int32, a view of the pinned buffer)."""
        return self.backend.token_outputs.tokens_view[:rows]

    def _enqueue_argmax(self, rows: int, stream) -> None:
        launch = self._argmax.get(rows)
        if launch is None:
            launch = self._argmax[rows] = argmax_launch(self.backend, rows, False)
        launch.enqueue(stream)

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
