"""A mixed step's device segments replayed as graphs (run/mixed.py's module docstring says when): a segment of a
step of up to SEGMENT_GRAPH_MAX_TOKENS tokens runs eagerly the first time its (tokens, segment, lm rows) comes,
is captured the second and replayed after; its uploads still go eagerly, in the eager order, before the replay
(they read only the host's state, which no device op of the segment changes).  A segment that would need the
device's x back midway (uploads_go_first) stays eager."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kestrel_stream.obs import prof, trace
from kestrel_stream.run.item_graphs import SEGMENT_GRAPH_MAX_TOKENS
from kestrel_stream.run.segment_state import uploads_go_first

if TYPE_CHECKING:
    from kestrel_stream.run.segment_state import SegmentState


class SegmentGraphs:
    def __init__(self, steps):
        """steps: the MixedSteps whose device segments these are (its launches, uploads and counters)."""
        self.steps = steps
        self.graphs: dict = {}           # (tokens, segment index, lm rows) -> its launches as a driver.Graph
        self._seen: set = set()          # the keys run once eagerly (a graph is captured the second time)
        self._eager: set = set()         # the keys whose segment cannot take a graph (needs x back midway)

    def run(self, index: int, ops: list, state: SegmentState, lm: tuple[int, int] | None) -> None:
        """A device segment's ops: eagerly, or its uploads and then one replay of its graph."""
        s = self.steps
        key = (state.T, index, lm)
        graphable = (s.use_graphs and s.ring is None and not s.streams_experts() and not prof.enabled
                     and trace.active is None and state.tree_fields is None and state.kernel_copy is None
                     and not state.graphing
                     and state.T <= SEGMENT_GRAPH_MAX_TOKENS and key not in self._eager)
        graph = self.graphs.get(key) if graphable else None
        if graphable and graph is None and key not in self._seen:
            self._seen.add(key)                    # a size seen once (a prompt's last chunk) costs no capture
            graphable = False
        if graphable:
            prepared = [s._prepared_for(op, state.T, lm) for op in ops]
            if not uploads_go_first(ops, prepared, state):
                self._eager.add(key)
                graphable = False
        if not graphable:
            for op in ops:
                s._device_op(op, state, lm)
            return
        for op, (reads, prologue, launches, _, nbytes, prepares) in zip(ops, prepared):
            s._upload(reads, prologue, state)
            s.counters.launches += len(launches)
            s.counters.gpu_weight_read_bytes += nbytes
            state.device_wrote(op, prepares)
        stream = s.backend.stream
        if graph is None:
            from kestrel_stream.cuda import driver
            with driver.capture(stream) as captured:
                for _, _, launches, _, _, _ in prepared:
                    for launch in launches:
                        launch.enqueue(stream)
            graph = self.graphs[key] = captured.graph
            s.counters.graphs_captured = (s.counters.graphs_captured or 0) + 1
        graph.launch(stream)
        s.counters.graph_replays = (s.counters.graph_replays or 0) + 1

    def drop(self) -> None:
        """Forget every graph (the launch lists changed)."""
        for graph in self.graphs.values():
            graph.destroy()
        self.graphs.clear()
        self._seen.clear()
        self._eager.clear()
